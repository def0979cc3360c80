"""Divergence-gated importance sampling: a gate on the ratio, the binary KL or the binary TV between π_old and μ,
whose surviving tokens keep their own importance weight (OpenRLHF's ``is_correction_*``, openrlhf 0.11.2, PR #1339;
the binary-KL gate at sequence level is FlashREINFORCE's trust region).

With a = log μ(y_t) (the rollout engine) and b = log π_old(y_t) (``source="mismatch"``; π_θ detached with
``source="total"``), ρ_t = e^(b − a), three orthogonal settings:

* ``gating`` — the per-token statistic s_t: ``ratio`` ρ_t; ``binary_kl`` KL((μ, 1 − μ) ‖ (π, 1 − π)) of the sampled
  token, rollout first; ``tv`` |π − μ| — both probabilities clamped into [1e-6, 1 − 1e-6] as OpenRLHF does, the KL
  computed exactly and ≥ 0 (:func:`offpolicy.binary.bernoulli_kl`);
* ``level`` — the unit the gate decides on: ``token`` (s_t), ``geometric`` (the sequence's length-normalised
  statistic: exp(mean_t log ρ_t) for the ratio, mean_t s_t for a divergence — OpenRLHF's ``seq``) or ``sequence``
  (the product ratio exp Σ_t log ρ_t, or Σ_t s_t);
* ``mode`` — ``mask``: a unit outside [lower, upper] is dropped, the kept tokens weigh w_t = ρ_t (their *own* token
  ratio, at every level); ``truncate`` (OpenRLHF's ``clip``; token-level ratio only): w_t = clamp(ρ_t, lower, upper).

Defaults are OpenRLHF's: token level, mask, the ratio band [0.5, 5] — which is :func:`~offpolicy.icepop` exactly
(tested). Other coincidences: ``mode="truncate"`` is ``tis(lower=…, upper=…)``; the ratio gate at ``geometric``
level drops the same sequences as ``mis(level="geometric")`` (OpenRLHF's "seq-mask-tis"), but weighs each kept token
by ρ_t, where ``mis`` uses the sequence's ρ_geo. A divergence is bounded from above only (``lower`` None or 0); the
binary-KL gate's default bound 5e-3 is FlashREINFORCE's quick start (``is_correction_level seq``, ``binary_kl``,
``5e-3``); the TV gate has no default.

Differences from OpenRLHF 0.11.2 worth knowing (each run against its ``PolicyLoss`` in
``tests/corrections/test_gated_differences.py``):

* its textbook float32 binary KL rounds 1 − μ and 1 − π to float32 (spacing 6e-8), so it comes out negative, and its
  [0, δ] test rejects the token, wherever the exact KL is below about 1e-7: for nearby policies (≈ −4e-8, PR #1354)
  but also at μ ≈ 2.5e-5 for |Δ log p| up to 0.04. Here the KL is ≥ 0 by construction;
* its survivors' weight e^(b − a) is not clamped; here log ρ is clamped to ±20 (the library's rule);
* a token whose log-ratio is not finite is dropped here at every gating, level and mode (its sequence too at sequence
  levels). OpenRLHF agrees for a NaN log-prob in mask mode (a NaN statistic fails the band; in clip mode the NaN
  becomes the coefficient, a NaN loss) and for log μ = −inf under the ratio gate in mask mode (a +inf statistic).
  Otherwise not: its clip mode clamps that +inf ratio to ``upper``; its binary-KL and TV gates clamp μ = 0 to 1e-6,
  a finite statistic that can pass, and then the token weighs e^(b − a) = inf (an inf loss); log π_old = −inf passes
  a divergence gate with weight 0, not counted as filtered;
* its ``is_filter_ratio`` at ``seq`` level averages over every row, an all-padding row (a 0/0 statistic) counted as
  filtered; ``<name>/masked_seq_frac`` here averages over non-empty sequences.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from offpolicy.batch import LogProbBatch
from offpolicy.binary import bernoulli_kl, bernoulli_tv
from offpolicy.corrections.base import Correction, CorrectionResult
from offpolicy.corrections.importance import behaviour_log_ratio, check_name, check_source, check_threshold
from offpolicy.ratios import (
    LEVEL_REDUCE,
    LOG_RATIO_BOUND,
    as_mask,
    broadcast_rows,
    count,
    is_finite,
    keep_only,
    max_where,
    nonfinite_rows,
    per_sequence,
    zero_outside,
)
from offpolicy.registry import register_correction

GATINGS: tuple[str, ...] = ("ratio", "binary_kl", "tv")
GATE_LEVELS: tuple[str, ...] = ("token", "geometric", "sequence")
GATE_MODES: tuple[str, ...] = ("mask", "truncate")
PROB_CLAMP = 1e-6  # OpenRLHF clamps μ(y) and π_old(y) into [1e-6, 1 − 1e-6] before a divergence
RATIO_BAND = (0.5, 5.0)  # OpenRLHF's default is_correction_threshold (IcePop's band)
BINARY_KL_BOUND = 5e-3  # FlashREINFORCE's quick start: is_correction_threshold 5e-3 on the sequence-mean binary KL


# ---------------------------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------------------------


def gate_bounds(gating: str, lower: float | None, upper: float | None) -> tuple[float | None, float | None]:
    """The band a gate keeps, validated: both None → the gating's default (ratio [0.5, 5], binary KL [0, 5e-3]; the
    TV gate has none); otherwise a missing bound is no bound. A divergence takes an upper bound only.

    >>> gate_bounds("ratio", None, None), gate_bounds("ratio", None, 2.0), gate_bounds("binary_kl", None, None)
    ((0.5, 5.0), (None, 2.0), (None, 0.005))
    >>> gate_bounds("binary_kl", 0.5, 5.0)
    Traceback (most recent call last):
    ...
    ValueError: lower: gating='binary_kl' is bounded from above only (a trust region); give upper alone, got lower=0.5
    """
    if gating not in GATINGS:
        raise ValueError(f"gating must be one of {GATINGS}, got {gating!r}")
    lo = check_threshold("lower", lower, allow_zero=True, allow_none=True)
    hi = check_threshold("upper", upper, allow_none=True)
    if gating == "ratio":
        if lo is None and hi is None:
            return RATIO_BAND
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"lower must be <= upper, got lower={lo}, upper={hi}")
        if not lo and hi is None:
            raise ValueError("upper: a ratio gate with lower=0 and no upper bound keeps every token; give a bound")
        return (lo or None), hi  # ρ ≥ 0 always: lower 0 is no bound
    if lo:
        raise ValueError(f"lower: gating={gating!r} is bounded from above only (a trust region); give upper alone, "
                         f"got lower={lo}")
    if hi is None:
        if gating == "tv":
            raise ValueError("upper: gating='tv' has no default bound; give upper (a bound on |π_old(y) − μ(y)|)")
        hi = BINARY_KL_BOUND
    return None, hi


def _check_settings(level: str, mode: str, gating: str) -> None:
    if level not in GATE_LEVELS:
        hint = " (OpenRLHF's 'seq' is the per-sequence mean: 'geometric')" if level in ("seq", "seq_mean") else ""
        raise ValueError(f"level must be one of {GATE_LEVELS}, got {level!r}{hint}")
    if mode not in GATE_MODES:
        hint = " (OpenRLHF's 'clip' is 'truncate')" if mode == "clip" else ""
        raise ValueError(f"mode must be one of {GATE_MODES}, got {mode!r}{hint}")
    if gating not in GATINGS:
        raise ValueError(f"gating must be one of {GATINGS}, got {gating!r}")
    if mode == "truncate" and (level != "token" or gating != "ratio"):
        raise ValueError(f"mode: 'truncate' clamps the token ratio, so it needs level='token' and gating='ratio' "
                         f"(got level={level!r}, gating={gating!r}); a sequence or divergence gate is a mask")


# ---------------------------------------------------------------------------------------------------------------------
# The gate
# ---------------------------------------------------------------------------------------------------------------------


class Gate(NamedTuple):
    """:func:`gate` 's result. ``weights`` / ``keep`` [B, T]; ``statistic`` per unit ([B, T] at token level, else
    [B, 1]; the ratio itself, not its log, for ratio gating); ``unit_valid`` the units that exist (valid tokens, or
    non-empty sequences) and ``unit_defined`` those whose statistic is defined (finite log-ratios); ``filtered`` the
    existing units outside the band or undefined (OpenRLHF's ``is_filter_ratio`` numerator); ``finite`` [B, T] the
    valid tokens with a finite log-ratio."""

    weights: Tensor
    keep: Tensor
    statistic: Tensor
    unit_valid: Tensor
    unit_defined: Tensor
    filtered: Tensor
    finite: Tensor


def token_statistic(log_mu: Tensor, log_num: Tensor, gating: str) -> Tensor:
    """The per-token gate statistic ``[B, T]`` float32: log ρ = log_num − log_mu (``ratio``, in log space), the
    binary KL((μ, 1 − μ) ‖ (π, 1 − π)) (``binary_kl``) or |π − μ| (``tv``), probabilities clamped into [1e-6, 1 − 1e-6].

    >>> mu, pi = torch.tensor([[0.5, 0.25]]).log(), torch.tensor([[0.5, 0.5]]).log()
    >>> token_statistic(mu, pi, "tv"), token_statistic(mu, pi, "binary_kl")   # KL((¼,¾)‖(½,½)) = 0.130812
    (tensor([[0.0000, 0.2500]]), tensor([[0.0000, 0.1308]]))
    """
    if gating == "ratio":
        return log_num.float() - log_mu.float()
    if gating == "binary_kl":
        return bernoulli_kl(log_mu, log_num, min_prob=PROB_CLAMP, max_prob=1.0 - PROB_CLAMP)
    if gating == "tv":
        return bernoulli_tv(log_mu, log_num, min_prob=PROB_CLAMP, max_prob=1.0 - PROB_CLAMP).abs()
    raise ValueError(f"gating must be one of {GATINGS}, got {gating!r}")


def _inside(stat: Tensor, lower: float | None, upper: float | None, log_space: bool) -> Tensor:
    """lower ≤ s ≤ upper; for the ratio compared in log space (a ratio exactly on a bound is kept)."""
    inside = torch.ones_like(stat, dtype=torch.bool)
    if lower is not None:
        inside = inside & (stat >= (math.log(lower) if log_space else lower))
    if upper is not None:
        inside = inside & (stat <= (math.log(upper) if log_space else upper))
    return inside


def gate(log_mu: Tensor, log_num: Tensor, mask: Tensor, *, level: str = "token", mode: str = "mask",
         gating: str = "ratio", lower: float | None = None, upper: float | None = None) -> Gate:
    """Divergence-gated IS weights from the sampled token's log-probs ``[B, T]`` under μ (``log_mu``) and the
    numerator policy π (``log_num``: π_old, or π_θ detached); see the module docstring for the three settings.

    Returns a :class:`Gate`: ``weights`` w_t = ρ_t on kept tokens (``truncate``: clamp(ρ_t, lower, upper)), 0 elsewhere;
    ``keep`` [B, T] bool. Bounds as :func:`gate_bounds` resolves them (both None: the gating's default band).

    >>> mu = torch.tensor([[0.0, 1.0, -2.0], [-0.1, -0.1, 0.0]]); pi = torch.zeros(2, 3); m = torch.ones(2, 3)
    >>> g = gate(mu, pi, m)   # token ratios e^(−a): (1, 0.37, 7.39) and (1.11, 1.11, 1): the band [0.5, 5]
    >>> g.keep
    tensor([[ True, False, False],
            [ True,  True,  True]])
    >>> gate(mu, pi, m, level="geometric").keep   # row means of log ρ: 1/3 → 1.40 and 0.067 → 1.07: both kept
    tensor([[True, True, True],
            [True, True, True]])
    """
    _check_settings(level, mode, gating)
    lo, hi = gate_bounds(gating, lower, upper)
    m = as_mask(mask)
    r = log_num.detach().float() - log_mu.detach().float()  # log ρ_t
    finite = m & is_finite(r)
    rho = torch.exp(zero_outside(r, finite).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))  # 1 where undefined
    # the statistic, 0 at padding and where undefined (those never pass: see `defined`)
    s = zero_outside(token_statistic(log_mu.detach(), log_num.detach(), gating), finite)
    log_space = gating == "ratio"
    if level == "token":
        unit_valid, unit_defined, unit = m, finite, s
    else:
        tokens = count(m, dim=-1).unsqueeze(-1)
        unit_valid = tokens > 0
        unit_defined = unit_valid & ~nonfinite_rows(r, m).unsqueeze(-1)
        unit = per_sequence(s, m, LEVEL_REDUCE[level], keepdim=True)
    inside = _inside(unit, lo, hi, log_space)
    if mode == "truncate":  # token level, ratio: every defined token kept, its ratio clamped into the band
        keep_unit = unit_defined
        weights = keep_only(rho.clamp(min=lo, max=hi), finite)
    else:
        keep_unit = unit_defined & inside
        weights = None
    keep = keep_unit if level == "token" else broadcast_rows(m, keep_unit)
    if weights is None:
        weights = keep_only(rho, keep)
    statistic = torch.exp(unit.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)) if log_space else unit
    filtered = unit_valid & ~(unit_defined & inside)
    return Gate(weights, keep, statistic, unit_valid, unit_defined, filtered, finite)


# ---------------------------------------------------------------------------------------------------------------------
# The registered correction
# ---------------------------------------------------------------------------------------------------------------------


@register_correction("gated_is")
def gated_is(
    level: str = "token",
    mode: str = "mask",
    gating: str = "ratio",
    lower: float | None = None,
    upper: float | None = None,
    source: str = "mismatch",
    name: str = "gated_is",
) -> Correction:
    """Divergence-gated importance sampling (OpenRLHF ``is_correction_level`` / ``_mode`` / ``_gating`` /
    ``_threshold``; module docstring). OpenRLHF's ``seq`` is ``level="geometric"``, its ``clip`` ``mode="truncate"``,
    its ``threshold [low, high]`` ``lower`` / ``upper`` (a single value: ``upper`` alone).

    Metrics (prefix ``<name>/``): ``stat_mean`` / ``stat_max`` (the unit statistic over defined units: the ratio
    itself for ratio gating); ``weight_mean`` (over valid tokens, 0 where dropped); ``nonfinite_frac`` (valid tokens
    with a non-finite log-ratio; dropped); and every correction's ``kept_frac`` / ``masked_frac`` / ``capped_frac`` /
    ``masked_seq_frac`` (:func:`~offpolicy.corrections.base.drop_metrics`). OpenRLHF's ``is_filter_ratio`` is
    ``masked_frac`` at token level in mask mode, ``masked_frac + capped_frac`` in truncate mode, and
    ``masked_seq_frac`` at the sequence levels.

    >>> gated_is(level="geometric", gating="binary_kl")   # FlashREINFORCE's trust region
    gated_is(level='geometric', mode='mask', gating='binary_kl', lower=None, upper=0.005, source='mismatch')
    >>> b = LogProbBatch(logp=torch.zeros(1, 3), rollout_logp=torch.tensor([[0.0, 1.0, -2.0]]), mask=torch.ones(1, 3))
    >>> gated_is()(b).keep   # the defaults are IcePop's band [0.5, 5] on the token ratio (1, 0.37, 7.39)
    tensor([[ True, False, False]])
    """
    check_name(name)
    check_source(source)
    _check_settings(level, mode, gating)
    lo, hi = gate_bounds(gating, lower, upper)
    config: dict[str, object] = {"level": level, "mode": mode, "gating": gating, "lower": lo, "upper": hi,
                                 "source": source}

    def apply(batch: LogProbBatch) -> CorrectionResult:
        r = behaviour_log_ratio(batch, source, name)  # validates μ; log π − log μ, detached
        assert batch.rollout_logp is not None
        numerator = batch.anchor_logp if source == "mismatch" else batch.logp
        g = gate(batch.rollout_logp, numerator, batch.bool_mask, level=level, mode=mode, gating=gating, lower=lo,
                 upper=hi)
        valid = batch.bool_mask
        n = count(valid).clamp(min=1)
        defined = count(g.unit_defined).clamp(min=1)
        metrics = {
            f"{name}/stat_mean": zero_outside(g.statistic, g.unit_defined).sum() / defined,
            f"{name}/stat_max": max_where(zero_outside(g.statistic, g.unit_defined), g.unit_defined),
            f"{name}/weight_mean": g.weights.sum() / n,
            f"{name}/nonfinite_frac": count(valid & ~is_finite(r)) / n,
        }
        # truncate mode keeps every defined token: those outside the band are the ones whose ratio was clamped
        capped = g.keep & g.filtered if mode == "truncate" else None
        return CorrectionResult(g.weights, g.keep, metrics, weight_level="token", capped=capped)

    return Correction(name, apply, config)

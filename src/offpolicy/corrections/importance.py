"""Importance-sampling corrections: truncated (TIS) and masked (MIS) weights at token, sequence or geometric level.

The weight corrects for the rollout engine μ having sampled the data: w = ρ = π/μ, aggregated at
one of three levels (``offpolicy.ratios``), then either *truncated* (TIS, w = clamp(ρ, lower, upper)) or *masked*
(MIS, w = ρ inside [lower, upper], token or sequence dropped outside). Weights are always detached.

Which ratio: ``source="mismatch"`` uses log(π_old/μ), the decoupled-PPO behaviour weight (arXiv 2110.00641, eq. 5) that
multiplies the
PPO term while PPO's own clip handles π/π_old; ``source="total"`` uses log(π_θ/μ) with π_θ detached (verl's
bypass mode, where there is no separate π_old forward).

Name table — each framework's setting written with ours (their defaults in brackets)::

    ms-swift  --rollout_importance_sampling_mode M, --rollout_importance_sampling_threshold τ  [τ = 2]
              NB: ms-swift "sequence" is the *geometric* mean (length-normalised), not the product
        token_truncate                            tis(upper=τ, level="token")
        token_mask                                mis(upper=τ, level="token")
        sequence_truncate                         tis(upper=τ, level="geometric")
        sequence_mask                             mis(upper=τ, level="geometric")
        --off_policy_sequence_mask_delta δ        opsm(delta=δ)                      (sequence_masks.py)

    verl      algorithm.rollout_correction.*  — verl "sequence" is the product, as ours
        rollout_is=token, rollout_is_threshold=C [2.0]       tis(upper=C, level="token")
        rollout_is=sequence                                  tis(upper=C, level="sequence")
        rollout_is_batch_normalize=true                      tis(..., normalize=True)
        rollout_rs=token|sequence|geometric,                 mis(level=token|sequence|geometric, lower=L, upper=U)
          rollout_rs_threshold=U [rollout_is_threshold],
          rollout_rs_threshold_lower=L [1/U]
        rollout_rs=token_k1|seq_sum_k1|seq_mean_k1 (newer    the same masks at token|sequence|geometric level; verl's
          releases), threshold string "L_U"                  k1 statistic is −log ρ, so check which side each bound
                                                             lands on (asymmetric bounds flip: L on ρ is 1/L on −log ρ)
        rollout_rs=token_k2 … seq_max_k3, threshold U        kl_rejection(mode, upper=U)        (trust_region.py)
        rollout_token_veto_threshold=τ                       veto(threshold=τ)                 (sequence_masks.py)
        bypass_mode=true (no π_old forward)                  source="total"

    TRL       GRPOConfig(vllm_importance_sampling_mode=M, vllm_importance_sampling_clip_max=C [3.0],
              vllm_importance_sampling_clip_min=m [None]); C was vllm_importance_sampling_cap in earlier releases
              — TRL "sequence" is the product, as ours; TRL's default mode is sequence_mask
        token_truncate                            tis(upper=C, lower=m, level="token")
        token_mask                                mis(upper=C, lower=m, level="token")
        sequence_truncate                         tis(upper=C, lower=m, level="sequence")
        sequence_mask                             mis(upper=C, lower=m, level="sequence")
        off_policy_mask_threshold=δ               opsm(delta=δ)

ms-swift and TRL compute their ratio from π_old (``old_per_token_logps``) and μ: that is ``source="mismatch"`` (when
π_old is not recomputed both fall back to π_θ detached, as we do). A product ratio over thousands of tokens is nearly
always outside any band (trl issues 4772/5814): prefer ``geometric`` for sequence-level masks.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch
from torch import Tensor

from offpolicy.batch import LogProbBatch, check_mask, check_token_tensor
from offpolicy.corrections.base import Correction, CorrectionResult
from offpolicy.ratios import (
    LEVEL_REDUCE,
    LOG_RATIO_BOUND,
    as_factor,
    as_mask,
    broadcast_rows,
    check_level,
    count,
    is_finite,
    keep_only,
    min_where,
    nonfinite_rows,
    pad_nonempty,
    per_sequence,
    zero_outside,
)
from offpolicy.registry import register_correction

MODES: tuple[str, ...] = ("truncate", "mask")
SOURCES: tuple[str, ...] = ("mismatch", "total")
NORMALIZE_EPS = 1e-8  # verl: skip batch normalisation when the mean weight is this small


# ---------------------------------------------------------------------------------------------------------------------
# Validation and the batch's log-ratio (also used by sequence_masks.py and trust_region.py)
# ---------------------------------------------------------------------------------------------------------------------


def check_threshold(name: str, value: object, *, allow_zero: bool = False, allow_none: bool = False) -> float | None:
    """Validate a scalar threshold argument and return it as a Python float.

    Raises ``ValueError`` naming ``name`` unless ``value`` is a finite real number that is > 0 (≥ 0 with
    ``allow_zero``); ``None`` passes only with ``allow_none``.

    >>> check_threshold("upper", 2)
    2.0
    >>> check_threshold("upper", float("inf"))
    Traceback (most recent call last):
    ...
    ValueError: upper must be finite, got inf
    """
    if value is None:
        if allow_none:
            return None
        raise ValueError(f"{name} is required, got None")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__}")
    v = float(value)
    if not -math.inf < v < math.inf:  # NaN fails both comparisons (and math.isfinite does not trace under dynamo)
        raise ValueError(f"{name} must be finite, got {value!r}")
    if v < 0.0 or (v == 0.0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return v


def check_source(source: str) -> None:
    """``source`` picks the ratio's numerator: ``"mismatch"`` (π_old) or ``"total"`` (π_θ detached).

    >>> check_source("bypass")
    Traceback (most recent call last):
    ...
    ValueError: source must be one of ('mismatch', 'total'), got 'bypass'
    """
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")


def check_name(name: str) -> None:
    """A correction's name prefixes its metrics, so it must be a non-empty string.

    >>> check_name("")
    Traceback (most recent call last):
    ...
    ValueError: name must be a non-empty string, got ''
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")


def behaviour_log_ratio(batch: LogProbBatch, source: str, who: str) -> Tensor:
    """Raw per-token log(numerator/μ) ``[B, T]`` float32, detached, *not* cleaned (NaN/inf and padding kept as is).

    ``source="mismatch"``: numerator π_old, or π_θ detached when ``old_logp`` is None (a single update on fresh
    rollouts has π_old = π_θ). ``source="total"``: numerator π_θ detached. μ = ``batch.rollout_logp`` is required.

    >>> b = LogProbBatch(logp=torch.tensor([[-1.0]]), old_logp=torch.tensor([[-1.5]]),
    ...                  rollout_logp=torch.tensor([[-2.0]]), mask=torch.ones(1, 1))
    >>> behaviour_log_ratio(b, "mismatch", "tis"), behaviour_log_ratio(b, "total", "tis")
    (tensor([[0.5000]]), tensor([[1.]]))
    """
    check_source(source)
    if batch.rollout_logp is None:
        raise ValueError(f"{who} needs rollout_logp (log μ, the rollout engine's log-probs) but the batch has none")
    numerator = batch.anchor_logp if source == "mismatch" else batch.logp
    return numerator.detach().float() - batch.rollout_logp.detach().float()


def defined_positions(log_ratio: Tensor, mask: Tensor, level: str) -> Tensor:
    """Valid positions whose aggregated ratio is defined: all of a row's valid log-ratios finite (sequence levels),
    or the token's own (token level). ``[B, T]`` bool.

    >>> r = torch.tensor([[0.1, float("nan"), 0.2], [0.0, 0.0, float("inf")]]); m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    >>> defined_positions(r, m, "token")
    tensor([[ True, False,  True],
            [ True,  True, False]])
    >>> defined_positions(r, m, "geometric")  # row 0's NaN undefines its whole ratio; row 1's inf is padding
    tensor([[False, False, False],
            [ True,  True, False]])
    """
    m = as_mask(mask)
    ok = m & is_finite(log_ratio)
    if level == "token":
        return ok
    return broadcast_rows(m, count(ok, dim=-1) == count(m, dim=-1))


def _check_weight_args(
    level: str, mode: str, lower: object, upper: object, normalize: object
) -> tuple[float | None, float | None]:
    check_level(level)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    lo = check_threshold("lower", lower, allow_none=True, allow_zero=True)
    if lo == 0.0:  # ρ ≥ 0 always: a lower bound of 0 never binds (TRL's clip_min=0.0 means "none")
        lo = None
    hi = check_threshold("upper", upper, allow_none=True)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"lower ({lo}) must be <= upper ({hi})")
    if mode == "mask" and lo is None and hi is None:
        raise ValueError("mode='mask' needs at least one of lower/upper (a band to mask outside of)")
    if not isinstance(normalize, bool):
        raise ValueError(f"normalize must be a bool, got {type(normalize).__name__}")
    return lo, hi


# ---------------------------------------------------------------------------------------------------------------------
# The weight function
# ---------------------------------------------------------------------------------------------------------------------


def importance_weights(
    log_ratio: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    lower: float | None = None,
    upper: float | None = None,
    normalize: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """TIS / MIS importance weights from per-token log-ratios (TIS: Yao et al., "Your efficient RL framework secretly
    brings you off-policy RL training", 2025; MIS: Liu et al., "When speed kills stability", 2025).

    Args:
        log_ratio: ``[B, T]`` per-token log ρ_t (e.g. log π_old − log μ), any float dtype (computed in float32).
        mask: ``[B, T]`` 1 for tokens that count.
        level: ``token`` ρ_t, ``sequence`` ρ = exp Σ_t log ρ_t, ``geometric`` ρ = exp mean_t log ρ_t.
        mode: ``truncate`` (TIS): w = clamp(ρ, lower, upper), keep = mask (either bound optional).
            ``mask`` (MIS / IcePop): keep = mask & (lower ≤ ρ ≤ upper), w = ρ where kept else 0.
        normalize: verl's batch normalisation, w / mean_valid(w): the mean over valid tokens (``token``) or over
            non-empty sequences, one weight each (``sequence`` / ``geometric``, as verl); a dropped token or sequence
            counts as 0, so the kept ones make up for it. Skipped (``torch.where``, no sync) when the mean ≤ 1e-8.

    Returns:
        ``(weights, keep, raw)``: weights ``[B, T]`` float32 detached (0 where not kept or padding), keep ``[B, T]``
        bool, raw ``[B, T]`` = exp(aggregated log-ratio) before truncation/masking (the aggregated log-ratio is 0 at
        padding, so raw is 1 there; at ``token`` level also where undefined; at sequence levels a row with an
        undefined token gets exp of the aggregate of its finite log-ratios, for inspection — it is dropped).

    Non-finite log-ratios in valid positions make the ratio undefined: that token (``token``) or the whole sequence
    (``sequence`` / ``geometric``) is dropped (keep False, weight 0) in both modes — never a NaN weight, never kept
    silently. The aggregated log-ratio is clamped to ±20 before ``exp``; the mask test compares the *unclamped*
    log-ratio with log(lower) / log(upper), so ρ exactly on a bound is kept and a bound beyond e^±20 still applies.

    >>> r = torch.tensor([[0.0, 1.0, -1.0]]); m = torch.ones(1, 3)
    >>> w, keep, raw = importance_weights(r, m, mode="truncate", upper=2.0)
    >>> w  # exp(0)=1, min(e, 2)=2, exp(-1)=0.3679
    tensor([[1.0000, 2.0000, 0.3679]])
    >>> importance_weights(r, m, mode="mask", lower=0.5, upper=2.0)[1]
    tensor([[ True, False, False]])
    >>> importance_weights(r, m, level="geometric", mode="mask", upper=2.0)[0]  # geo = exp(0/3) = 1
    tensor([[1., 1., 1.]])
    """
    check_token_tensor("log_ratio", log_ratio)
    check_mask(mask, log_ratio, "log_ratio")
    lo, hi = _check_weight_args(level, mode, lower, upper, normalize)
    rows, cols = log_ratio.shape
    # B = 0 or T = 0: computed as an all-masked batch and sliced back (ratios.pad_nonempty)
    out = _weights(pad_nonempty(log_ratio.detach()).float(), as_mask(pad_nonempty(mask, 0)), level, mode, lo, hi,
                   normalize)
    return out.weights[:rows, :cols], out.keep[:rows, :cols], out.raw[:rows, :cols]


class _Weights(NamedTuple):
    """:func:`importance_weights`' result with what its presets' metrics also read."""

    weights: Tensor  # [B, T]
    keep: Tensor  # [B, T] bool
    raw: Tensor  # [B, T] the ratio on every valid token, 1 at padding
    finite: Tensor  # [B, T] bool: valid and the token's own log-ratio finite
    ratio: Tensor  # the ratio per token [B, T] (token level) or per sequence [B, 1]
    outside: Tensor  # the ratio outside [lower, upper], same shape as ratio
    rows: _Rows | None  # the per-sequence decisions (sequence levels)


class _Rows(NamedTuple):
    """A sequence level's decisions, per sequence [B, 1]: valid tokens, defined (no undefined token), kept, weight."""

    tokens: Tensor
    defined: Tensor
    keep: Tensor
    weight: Tensor


def _weights(r: Tensor, m: Tensor, level: str, mode: str, lo: float | None, hi: float | None,
             normalize: bool) -> _Weights:
    finite = m & is_finite(r)
    clean = zero_outside(r, finite)
    rows = None
    if level == "token":
        log_ratio = clean
        ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))  # 1 at padding and where undefined
        keep = finite if mode == "truncate" else finite & _inside(log_ratio, lo, hi)
        weights = ratio if mode == "mask" or (lo is None and hi is None) else ratio.clamp(min=lo, max=hi)
        weights, raw = keep_only(weights, keep), ratio
    else:  # every decision is per sequence: taken on [B, 1] and broadcast to the sequence's tokens
        tokens = count(m, dim=-1).unsqueeze(-1)
        defined = ~nonfinite_rows(r, m).unsqueeze(-1) & (tokens > 0)  # not empty, nothing undefined
        log_ratio = per_sequence(clean, m, LEVEL_REDUCE[level], keepdim=True)
        ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        # a mask compares the unclamped log-ratio: exp rounding must not drop a ratio exactly on a bound
        row_keep = defined if mode == "truncate" else defined & _inside(log_ratio, lo, hi)
        row_weight = ratio if mode == "mask" or (lo is None and hi is None) else ratio.clamp(min=lo, max=hi)
        row_weight = keep_only(row_weight, row_keep)
        rows = _Rows(tokens, defined, row_keep, row_weight)
        keep = broadcast_rows(m, row_keep)
        weights = keep_only(row_weight.expand_as(clean), m)
        raw = keep_only(ratio.expand_as(clean), m) + (1 - as_factor(m))  # the sequence's ratio, 1 at padding
    if normalize:
        weights = weights / _batch_mean(weights, m, rows)
    outside = ~_inside(ratio.log(), lo, hi) if mode == "truncate" else torch.zeros_like(ratio, dtype=torch.bool)
    return _Weights(weights, keep, raw, finite, ratio, outside, rows)


def _inside(log_rho: Tensor, lower: float | None, upper: float | None) -> Tensor:
    """log(lower) ≤ log ρ ≤ log(upper), a missing bound always satisfied."""
    inside = torch.ones_like(log_rho, dtype=torch.bool)
    if lower is not None:
        inside = inside & (log_rho >= math.log(lower))
    if upper is not None:
        inside = inside & (log_rho <= math.log(upper))
    return inside


def _batch_mean(weights: Tensor, m: Tensor, rows: _Rows | None) -> Tensor:
    """verl's normaliser: the mean weight over valid tokens (token level) or over non-empty sequences, one weight each
    (sequence levels); 1 when it is ≤ 1e-8 (then the weights are left as they are)."""
    if rows is None:
        mean = weights.sum() / count(m).clamp(min=1)
    else:
        mean = rows.weight.sum() / count(rows.tokens > 0).clamp(min=1)
    return torch.where(mean > NORMALIZE_EPS, mean, 1.0)


# ---------------------------------------------------------------------------------------------------------------------
# Presets: the weight function on the batch's log-ratio, plus its metrics
# ---------------------------------------------------------------------------------------------------------------------


def _importance(
    name: str,
    config: dict[str, object],
    *,
    level: str,
    mode: str,
    lower: float | None,
    upper: float | None,
    normalize: bool,
    source: str,
) -> Correction:
    check_name(name)
    check_source(source)
    lo, hi = _check_weight_args(level, mode, lower, upper, normalize)

    def apply(batch: LogProbBatch) -> CorrectionResult:
        valid = batch.bool_mask
        out = _weights(behaviour_log_ratio(batch, source, name), valid, level, mode, lo, hi, normalize)
        n_valid = count(valid)
        n = n_valid.clamp(min=1)
        tokens: Tensor | int
        if out.rows is None:  # token level: the raw ratio over the tokens where it is defined (finite)
            defined, tokens = out.finite, 1
        else:  # sequence levels: each defined sequence's ratio, once per valid token
            defined, tokens = out.rows.defined, out.rows.tokens
        n_defined = (tokens * keep_only(torch.ones_like(out.ratio), defined)).sum()
        ratio_defined = keep_only(out.ratio, defined)  # > 0 where defined: a 0 never wins the max
        metrics = {
            f"{name}/raw_ratio_mean": (tokens * ratio_defined).sum() / n_defined.clamp(min=1),
            f"{name}/raw_ratio_max": ratio_defined.amax(),
            f"{name}/raw_ratio_min": min_where(out.ratio, defined),
            f"{name}/weight_mean": out.weights.sum() / n,  # weights are 0 at padding
            f"{name}/nonfinite_frac": (n_valid - count(out.finite)) / n,
        }
        # truncation: the kept tokens (sequences) whose ratio the clamp moved; a mask truncates nothing
        capped = broadcast_rows(out.keep, out.outside) if mode == "truncate" else None
        return CorrectionResult(out.weights, out.keep, metrics, weight_level=level, capped=capped)

    return Correction(name, apply, config)


@register_correction("importance")
def importance_correction(
    level: str,
    mode: str,
    lower: float | None = None,
    upper: float | None = None,
    normalize: bool = False,
    source: str = "mismatch",
    name: str = "importance",
) -> Correction:
    """General TIS/MIS correction on log(π_old/μ) (``source="mismatch"``) or log(π_θ/μ) (``"total"``); see
    :func:`importance_weights` for the formula and the module docstring for each framework's equivalent.

    Metrics (0-d tensors, prefixed ``<name>/``): ``raw_ratio_mean/max/min`` (ratio *before* truncation, over valid
    tokens where it is defined — TRL logs only the truncated one), ``weight_mean`` (final weight over valid tokens, 0
    where dropped) and ``nonfinite_frac`` (valid tokens with a non-finite log-ratio; they are dropped), beside every
    correction's ``kept_frac`` / ``masked_frac`` / ``capped_frac`` / ``masked_seq_frac``
    (:func:`~offpolicy.corrections.base.drop_metrics`; ``capped`` = the tokens whose ratio truncation moved). The
    named presets (:func:`tis`, :func:`mis`, :func:`geo_mask`, :func:`icepop`) log the same metrics under their own
    name.

    >>> from offpolicy.batch import LogProbBatch
    >>> b = LogProbBatch(logp=torch.zeros(1, 2), rollout_logp=torch.tensor([[0.0, -2.0]]), mask=torch.ones(1, 2))
    >>> importance_correction("token", "mask", upper=2.0)(b).keep  # ρ = (1, e²=7.39)
    tensor([[ True, False]])
    """
    config = {"level": level, "mode": mode, "lower": _f(lower), "upper": _f(upper), "normalize": normalize, "source": source}
    return _importance(
        name, config, level=level, mode=mode, lower=lower, upper=upper, normalize=normalize, source=source
    )


def _mode_preset(
    name: str, mode: str, level: str, lower: float | None, upper: float | None, normalize: bool, source: str
) -> Correction:
    """:func:`tis` / :func:`mis`: the general correction with ``mode`` fixed by the name (so not in the repr)."""
    config = {"level": level, "lower": _f(lower), "upper": _f(upper), "normalize": normalize, "source": source}
    return _importance(name, config, level=level, mode=mode, lower=lower, upper=upper, normalize=normalize, source=source)


@register_correction("tis")
def tis(
    upper: float | None = 2.0,
    level: str = "token",
    lower: float | None = None,
    normalize: bool = False,
    source: str = "mismatch",
) -> Correction:
    """Truncated importance sampling: w = clamp(ρ, lower, upper) (Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training"; ms-swift ``*_truncate``). Default cap 2, as ms-swift and verl.

    >>> tis()
    tis(level='token', lower=None, upper=2.0, normalize=False, source='mismatch')
    >>> b = LogProbBatch(logp=torch.zeros(1, 2), rollout_logp=torch.tensor([[0.0, -2.0]]), mask=torch.ones(1, 2))
    >>> tis(upper=2.0)(b).weights  # ρ = (1, 7.39) → (1, 2)
    tensor([[1., 2.]])
    """
    return _mode_preset("tis", "truncate", level, lower, upper, normalize, source)


@register_correction("mis")
def mis(
    upper: float | None = 2.0,
    level: str = "token",
    lower: float | None = None,
    normalize: bool = False,
    source: str = "mismatch",
) -> Correction:
    """Masked importance sampling: w = ρ if lower ≤ ρ ≤ upper else the token/sequence is dropped (Liu et al. 2025,
    "When speed kills stability"; ms-swift ``*_mask``).

    >>> mis(upper=2.0, level="sequence")
    mis(level='sequence', lower=None, upper=2.0, normalize=False, source='mismatch')
    """
    return _mode_preset("mis", "mask", level, lower, upper, normalize, source)


@register_correction("geo_mask")
def geo_mask(lower: float | None = 0.999, upper: float | None = 1.001, source: str = "mismatch") -> Correction:
    """Geometric sequence mask: keep a sequence iff lower ≤ exp(mean_t log ρ_t) ≤ upper; w = ρ_geo (verl's and
    ms-swift's ``geo_mask``).

    Length-invariant, unlike the product. The per-token geometric mean drifts little, so the default band is tight
    (±0.1 % per token); widen it if the masked share (``geo_mask/masked_frac``) grows.

    >>> geo_mask(lower=0.5, upper=2.0)
    geo_mask(lower=0.5, upper=2.0, source='mismatch')
    """
    config = {"lower": _f(lower), "upper": _f(upper), "source": source}
    return _importance(
        "geo_mask", config, level="geometric", mode="mask", lower=lower, upper=upper, normalize=False, source=source
    )


@register_correction("icepop")
def icepop(lower: float = 0.5, upper: float = 5.0, source: str = "mismatch") -> Correction:
    """IcePop (Ring-1T, arXiv 2510.18855): token-level mask with the two-sided band [0.5, 5].

    >>> icepop()
    icepop(lower=0.5, upper=5.0, source='mismatch')
    >>> b = LogProbBatch(logp=torch.zeros(1, 3), rollout_logp=torch.tensor([[0.0, 1.0, -2.0]]), mask=torch.ones(1, 3))
    >>> icepop()(b).keep  # ρ = (1, e⁻¹=0.37, e²=7.39): only the first is inside [0.5, 5]
    tensor([[ True, False, False]])
    """
    config = {"lower": _f(lower), "upper": _f(upper), "source": source}
    return _importance(
        "icepop", config, level="token", mode="mask", lower=lower, upper=upper, normalize=False, source=source
    )


def _f(x: object) -> object:
    """Threshold as float for the repr (2 and 2.0 print the same); bad values are left for validation to reject."""
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        return float(x)
    return x

"""Importance-sampling corrections: truncated (TIS) and masked (MIS) weights at token, sequence or geometric level.

The weight corrects for the rollout engine μ having sampled the data (seed 002, seed 004): w = ρ = π/μ, aggregated at
one of three levels (``offpolicy.ratios``), then either *truncated* (TIS, w = clamp(ρ, lower, upper)) or *masked*
(MIS, w = ρ inside [lower, upper], token or sequence dropped outside). Weights are always detached.

Which ratio: ``source="mismatch"`` uses log(π_old/μ), the decoupled-PPO mismatch weight (seed 004) that multiplies the
PPO term while PPO's own clip handles π/π_old; ``source="total"`` uses log(π_θ/μ) with π_θ detached (verl's bypass
mode, where there is no separate π_old forward).

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
                                                             lands on (REFERENCE.md: asymmetric bounds flip)
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
from dataclasses import dataclass

import torch
from torch import Tensor

from offpolicy.batch import LogProbBatch, check_mask, check_token_tensor
from offpolicy.corrections.base import Correction, CorrectionResult
from offpolicy.ratios import (
    LOG_RATIO_BOUND,
    as_mask,
    broadcast_rows,
    check_level,
    float_mask,
    nan_to_num,
    pad_nonempty,
)

MODES: tuple[str, ...] = ("truncate", "mask")
SOURCES: tuple[str, ...] = ("mismatch", "total")
NORMALIZE_EPS = 1e-8  # verl: skip batch normalisation when the mean weight is this small


# ---------------------------------------------------------------------------------------------------------------------
# Shared validation / inputs (also used by sequence_masks.py and trust_region.py)
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
    ok = m & torch.isfinite(log_ratio)
    if level == "token":
        return ok
    row_ok = ~(m & ~ok).any(dim=-1, keepdim=True)
    return m & row_ok


# ---------------------------------------------------------------------------------------------------------------------
# Shared per-batch terms
#
# Why: every correction of a chain reads the same log(π_old/μ) (or log(π_θ/μ)), its finiteness and its row sums. On a
# CPU each fresh [B, T] temporary costs about as much as the arithmetic, and `isfinite`/`where`/bool casts are ~10×
# a float multiply, so they are computed once per batch (``LogProbBatch.memo``) with float masks and ``nan_to_num``,
# and sequence-level decisions are taken on [B] row statistics and broadcast once.
# Semantics are those of ``ratios.masked_fill_invalid`` / ``defined_positions``: the only difference is that a
# difference of two finite log-probs beyond ±1.7e38 (not a log-probability) overflows to inf and counts as non-finite.
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RatioTerms:
    """A per-token log-ratio ``[B, T]`` with its validity, computed once and shared (see the section comment).

    ``raw``: float32 detached, uncleaned; ``mf``: valid tokens as float 0/1; ``ok``: valid *and* finite (float 0/1);
    ``clean``: ``raw`` with padding and non-finite entries set to 0 (not clamped); ``n_row`` / ``ok_row`` / ``sum_row``:
    [B] counts of valid / valid-finite tokens and Σ_t clean; ``n``: number of valid tokens (0-d).
    """

    raw: Tensor
    mask: Tensor
    mf: Tensor
    ok: Tensor
    clean: Tensor
    n_row: Tensor
    ok_row: Tensor
    sum_row: Tensor
    n: Tensor


def ratio_terms(log_ratio: Tensor, mask: Tensor, mf: Tensor | None = None) -> RatioTerms:
    """Build :class:`RatioTerms` from a per-token log-ratio ``[B, T]`` (any float dtype) and a mask ``[B, T]``.

    >>> t = ratio_terms(torch.tensor([[0.5, float("nan"), 9.0]]), torch.tensor([[1, 1, 0]]))
    >>> t.clean, t.ok, t.n_row, t.ok_row
    (tensor([[0.5000, 0.0000, 0.0000]]), tensor([[1., 0., 0.]]), tensor([2.]), tensor([1.]))
    """
    m = as_mask(mask)
    mf = float_mask(m) if mf is None else mf  # ``mf`` lets a batch share one float mask across sources
    raw = log_ratio.detach().float()
    bad = raw * 0.0  # x·0 is 0 for finite x, NaN otherwise → 1.0 where non-finite
    bad = nan_to_num(bad, 1.0, 1.0, 1.0, out=bad)
    ok = torch.addcmul(mf, mf, bad, value=-1.0)  # mf − mf·bad = mf·(1 − bad) exactly (0/1 values), in one pass
    clean = nan_to_num(raw, 0.0, 0.0, 0.0).mul_(ok)
    n_row = mf.sum(dim=-1)
    return RatioTerms(raw, m, mf, ok, clean, n_row, ok.sum(dim=-1), clean.sum(dim=-1), n_row.sum())


def source_terms(batch: LogProbBatch, source: str, who: str) -> RatioTerms:
    """:class:`RatioTerms` of :func:`behaviour_log_ratio` ``(batch, source)``, memoised on the batch (one per source;
    ``who`` only names the caller in the error when ``rollout_logp`` is missing).

    >>> b = LogProbBatch(logp=torch.zeros(1, 2), rollout_logp=torch.tensor([[0.0, -1.0]]), mask=torch.ones(1, 2))
    >>> source_terms(b, "mismatch", "tis").sum_row
    tensor([1.])
    """
    check_source(source)
    if batch.rollout_logp is None:
        raise ValueError(f"{who} needs rollout_logp (log μ, the rollout engine's log-probs) but the batch has none")
    # π_old falls back to π_θ: both sources then hold the same numbers (kept under separate keys for simplicity)
    return batch.memo(
        ("ratio_terms", source), lambda b: ratio_terms(behaviour_log_ratio(b, source, who), b.mask, batch_float_mask(b))
    )


@dataclass(frozen=True)
class SharedLogRatio:
    """A correction's cleaned log(numerator/μ) handed on to the diagnostics (``CorrectionResult.shared``).

    ``origin`` is the (numerator, denominator, mask) tensors it was computed from and ``versions`` their in-place
    version counters at that time: :func:`find_shared_log_ratio` reuses it only for the very same, unmodified tensors.
    ``clamped`` is the token-level log-ratio clamped ±20 and ``rho`` its exp (1 where undefined) when a token-level
    correction computed them, else None.
    """

    origin: tuple[Tensor, Tensor, Tensor]
    versions: tuple[int, int, int]
    terms: RatioTerms
    clamped: Tensor | None
    rho: Tensor | None = None


def share_log_ratio(
    batch: LogProbBatch, source: str, terms: RatioTerms, token: TokenRatio | None
) -> dict[object, object]:
    """``{("log_ratio", source): SharedLogRatio}`` for a correction's ``CorrectionResult.shared``: the ``terms`` of
    :func:`source_terms` ``(batch, source)`` and, for a token-level correction, its ``token`` ratio (empty under
    ``torch.compile``, where the whole step fuses anyway and version counters are not traced)."""
    if torch.compiler.is_compiling():
        return {}
    numerator = batch.anchor_logp if source == "mismatch" else batch.logp
    origin = (numerator, batch.rollout_logp, batch.mask)
    clamped, rho = (token.agg, token.rho) if token is not None else (None, None)
    shared = SharedLogRatio(origin, tuple(t._version for t in origin), terms, clamped, rho)  # type: ignore[arg-type]
    return {("log_ratio", source): shared}


def find_shared_log_ratio(
    shared: dict[object, object], numerator: Tensor, denominator: Tensor, mask: Tensor
) -> SharedLogRatio | None:
    """The :class:`SharedLogRatio` in ``shared`` computed from exactly these tensors, unmodified since; else None."""
    if torch.compiler.is_compiling():
        return None
    for source in SOURCES:
        s = shared.get(("log_ratio", source))
        if not isinstance(s, SharedLogRatio):
            continue
        tensors = (numerator, denominator, mask)
        if all(a is b for a, b in zip(s.origin, tensors)) and tuple(t._version for t in tensors) == s.versions:
            return s
    return None


def batch_float_mask(batch: LogProbBatch) -> Tensor:
    """``batch.mask`` as float32 0/1 ``[B, T]``, memoised on the batch. Shared: never modify it in place (clone it).

    >>> b = LogProbBatch(logp=torch.zeros(1, 2), mask=torch.tensor([[1, 0]]))
    >>> batch_float_mask(b)
    tensor([[1., 0.]])
    """
    return batch.memo("float_mask", lambda b: float_mask(b.mask))


@dataclass(frozen=True)
class TokenRatio:
    """Token-level ratio of one :class:`RatioTerms`: ``agg`` = clean log-ratio clamped ±20 (0 where undefined),
    ``rho`` = exp(agg) (1 where undefined), ``rho_def`` = ρ on defined tokens and 0 elsewhere, ``defined`` [B, T]
    bool, ``n_def`` (0-d)."""

    agg: Tensor
    rho: Tensor
    rho_def: Tensor
    defined: Tensor
    n_def: Tensor
    raw_stats: tuple[Tensor, Tensor, Tensor]  # mean / max / min of ρ over defined tokens (0 if none)


_FLOAT_MAX = float(torch.finfo(torch.float32).max)


def token_ratio(terms: RatioTerms) -> TokenRatio:
    """:class:`TokenRatio` of ``terms`` (see there).

    >>> tr = token_ratio(ratio_terms(torch.tensor([[0.0, float("inf"), 1.0]]), torch.tensor([[1, 1, 0]])))
    >>> tr.rho, tr.rho_def, tr.defined
    (tensor([[1., 1., 1.]]), tensor([[1., 0., 0.]]), tensor([[ True, False, False]]))
    """
    agg = terms.clean.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    rho = torch.exp(agg)
    rho_def = rho * terms.ok
    n_def = terms.ok_row.sum()
    # ρ > 0, so the 0s at undefined positions never win the max; an empty batch gives 0 (as ratios.masked_max).
    # For the min, undefined positions are pushed to float32-max (ρ ≤ e^20 is far below one ulp of it).
    rho_min = (1.0 - terms.ok).mul_(_FLOAT_MAX).add_(rho).amin()
    stats = (rho_def.sum() / n_def.clamp(min=1.0), rho_def.amax(), torch.where(n_def > 0, rho_min, 0.0))
    return TokenRatio(agg, rho, rho_def, terms.ok.bool(), n_def, stats)


def _memo_token_ratio(batch: LogProbBatch, source: str, terms: RatioTerms) -> TokenRatio:
    return batch.memo(("token_ratio", source), lambda b: token_ratio(terms))


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
    """TIS / MIS importance weights from per-token log-ratios (seed 002 "Truncate vs. Mask", seed 004 TIS/MIS).

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
    terms = ratio_terms(pad_nonempty(log_ratio.detach()), pad_nonempty(mask, 0))
    tr = token_ratio(terms) if level == "token" else None
    imp = _weights(terms, tr, level, mode, lo, hi, normalize)
    if tr is not None:
        raw = tr.rho
    else:  # the sequence ratio on every valid token, 1 at padding
        raw = torch.where(terms.mask, imp.row_rho.unsqueeze(-1).expand_as(terms.mask), torch.ones_like(terms.raw))
    return imp.weights[:rows, :cols], imp.keep[:rows, :cols], raw.detach()[:rows, :cols]


@dataclass(frozen=True)
class _Importance:
    """Weights, keep mask and the counts the presets' metrics need (see :func:`_weights`)."""

    weights: Tensor  # [B, T] float32, 0 where not kept
    keep: Tensor  # [B, T] bool, ⊂ valid
    raw_stats: tuple[Tensor, Tensor, Tensor]  # mean / max / min of the raw ratio over defined tokens
    n_keep: Tensor  # kept tokens (0-d float)
    n_changed: Tensor  # valid tokens dropped (masked or undefined) or moved by the truncation (0-d float)
    row_rho: Tensor | None  # [B] sequence ratio (sequence levels only)
    row_weights: Tensor | None = None  # [B] the weight of each sequence, 0 where dropped (sequence levels only)


def _weights(
    terms: RatioTerms, tr: TokenRatio | None, level: str, mode: str, lo: float | None, hi: float | None, normalize: bool
) -> _Importance:
    """The formula of :func:`importance_weights` on shared terms: token level on [B, T], sequence levels on [B]."""
    imp = _token_weights(terms, tr, mode, lo, hi) if tr is not None else _row_weights(terms, level, mode, lo, hi)
    if not normalize:
        return imp
    # verl's batch normalisation, w / mean_valid(w): the mean over valid tokens at token level, over non-empty
    # sequences (one weight each) at sequence levels, as verl does; a dropped token or sequence counts with weight 0,
    # so the kept ones make up for it. where() on a 0-d divisor instead of on [B, T] (w / 1 is w exactly), no sync
    if imp.row_weights is None:
        mean = imp.weights.sum() / terms.n.clamp(min=1.0)
    else:
        mean = imp.row_weights.sum() / (terms.n_row > 0).sum().clamp(min=1).float()
    divisor = torch.where(mean > NORMALIZE_EPS, mean.clamp(min=NORMALIZE_EPS), 1.0)
    return _Importance(imp.weights / divisor, imp.keep, imp.raw_stats, imp.n_keep, imp.n_changed, imp.row_rho,
                       None if imp.row_weights is None else imp.row_weights / divisor)


def _token_weights(terms: RatioTerms, tr: TokenRatio, mode: str, lo: float | None, hi: float | None) -> _Importance:
    if mode == "mask":
        # compare in log space: exp() rounding must not drop a ratio that sits exactly on a bound; and on the
        # unclamped log-ratio, so a bound beyond e^±20 still applies (in-place ANDs: every fresh [B, T] buffer costs
        # page faults on CPU)
        keep = tr.defined.clone()
        if lo is not None:
            keep &= terms.clean >= math.log(lo)
        if hi is not None:
            keep &= terms.clean <= math.log(hi)
        weights = float_mask(keep).mul_(tr.rho)
        n_keep = torch.count_nonzero(keep).float()
        return _Importance(weights, keep, tr.raw_stats, n_keep, terms.n - n_keep, None)
    if lo is None and hi is None:
        weights = tr.rho_def.clone()  # never hand out the memoised tensor itself
    else:
        weights = tr.rho.clamp(min=lo, max=hi).mul_(terms.ok)
    # changed = undefined, or defined and outside [lo, hi]. rho_def is 0 where undefined: never above upper (> 0),
    # always below lower (> 0), so the undefined positions (all B·T − n_def of them) are taken back out of that count
    n_changed = terms.n - tr.n_def
    if lo is not None:
        n_below = torch.count_nonzero(tr.rho_def < lo).float() - (tr.rho_def.numel() - tr.n_def)
        n_changed = n_changed + n_below
    if hi is not None:
        n_changed = n_changed + torch.count_nonzero(tr.rho_def > hi).float()
    return _Importance(weights, tr.defined, tr.raw_stats, tr.n_def, n_changed, None)


def _row_weights(terms: RatioTerms, level: str, mode: str, lo: float | None, hi: float | None) -> _Importance:
    """Sequence / geometric level: every decision is per sequence, so it is taken on [B] and broadcast once."""
    n_row = terms.n_row
    s = terms.sum_row if level == "sequence" else terms.sum_row / n_row.clamp(min=1.0)
    agg = s.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    rho = torch.exp(agg)
    defined = (terms.ok_row == n_row) & (n_row > 0)  # no non-finite valid log-ratio in the row
    keep_row = defined
    out_of_band = torch.zeros_like(defined)
    if lo is not None:  # a mask compares the unclamped log-ratio: a bound beyond e^±20 still applies
        out_of_band = out_of_band | (s < math.log(lo) if mode == "mask" else rho < lo)
    if hi is not None:
        out_of_band = out_of_band | (s > math.log(hi) if mode == "mask" else rho > hi)
    if mode == "mask":
        keep_row = defined & ~out_of_band
        w_row = rho
    else:
        w_row = rho if lo is None and hi is None else rho.clamp(min=lo, max=hi)
    w_row = torch.where(keep_row, w_row, torch.zeros_like(w_row))
    def_f, keep_f = defined.float(), keep_row.float()
    n_def = (n_row * def_f).sum()
    n_keep = (n_row * keep_f).sum()
    raw_stats = (
        (rho * n_row * def_f).sum() / n_def.clamp(min=1.0),
        (rho * def_f).amax(),
        torch.where(n_def > 0, (rho + (1.0 - def_f) * _FLOAT_MAX).amin(), 0.0),
    )
    n_changed = terms.n - n_keep
    if mode == "truncate":
        n_changed = n_changed + (n_row * (defined & out_of_band).float()).sum()
    weights = w_row.unsqueeze(-1) * terms.mf
    return _Importance(weights, broadcast_rows(terms.mask, keep_row), raw_stats, n_keep, n_changed, rho, w_row)


# ---------------------------------------------------------------------------------------------------------------------
# Presets
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
        terms = source_terms(batch, source, name)
        tr = _memo_token_ratio(batch, source, terms) if level == "token" else None
        imp = _weights(terms, tr, level, mode, lo, hi, normalize)
        n = terms.n.clamp(min=1.0)
        raw_mean, raw_max, raw_min = imp.raw_stats  # over valid tokens whose ratio is defined (finite)
        metrics = {
            f"{name}/raw_ratio_mean": raw_mean,
            f"{name}/raw_ratio_max": raw_max,
            f"{name}/raw_ratio_min": raw_min,
            f"{name}/weight_mean": imp.weights.sum() / n,  # weights are 0 at padding
            f"{name}/kept_frac": imp.n_keep / n,
            f"{name}/clipped_frac": imp.n_changed / n,  # masked, undefined, or moved by the clamp
            f"{name}/nonfinite_frac": (terms.n - terms.ok_row.sum()) / n,
        }
        return CorrectionResult(imp.weights, imp.keep, metrics, share_log_ratio(batch, source, terms, tr),
                                weight_level=level)

    return Correction(name, apply, config)


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
    where dropped), ``kept_frac``, ``clipped_frac`` (valid tokens whose weight was changed by truncation or that were
    masked) and ``nonfinite_frac`` (valid tokens with a non-finite log-ratio; they are dropped). The named presets
    (:func:`tis`, :func:`mis`, :func:`geo_mask`, :func:`icepop`) log the same metrics under their own name.

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


def tis(
    upper: float | None = 2.0,
    level: str = "token",
    lower: float | None = None,
    normalize: bool = False,
    source: str = "mismatch",
) -> Correction:
    """Truncated importance sampling: w = clamp(ρ, lower, upper) (Yao et al. "Your efficient RL framework secretly
    brings you off-policy RL"; seed 002 ``*_truncate``). Default cap 2, as ms-swift and verl.

    >>> tis()
    tis(level='token', lower=None, upper=2.0, normalize=False, source='mismatch')
    >>> b = LogProbBatch(logp=torch.zeros(1, 2), rollout_logp=torch.tensor([[0.0, -2.0]]), mask=torch.ones(1, 2))
    >>> tis(upper=2.0)(b).weights  # ρ = (1, 7.39) → (1, 2)
    tensor([[1., 2.]])
    """
    return _mode_preset("tis", "truncate", level, lower, upper, normalize, source)


def mis(
    upper: float | None = 2.0,
    level: str = "token",
    lower: float | None = None,
    normalize: bool = False,
    source: str = "mismatch",
) -> Correction:
    """Masked importance sampling: w = ρ if lower ≤ ρ ≤ upper else the token/sequence is dropped (seed 002
    ``*_mask``, seed 004 MIS).

    >>> mis(upper=2.0, level="sequence")
    mis(level='sequence', lower=None, upper=2.0, normalize=False, source='mismatch')
    """
    return _mode_preset("mis", "mask", level, lower, upper, normalize, source)


def geo_mask(lower: float | None = 0.999, upper: float | None = 1.001, source: str = "mismatch") -> Correction:
    """Geometric sequence mask (seed 004): keep a sequence iff lower ≤ exp(mean_t log ρ_t) ≤ upper; w = ρ_geo.

    Length-invariant, unlike the product. The per-token geometric mean drifts little, so the default band is tight
    (±0.1 % per token); widen it if the acceptance rate (``geo_mask/kept_frac``) drops.

    >>> geo_mask(lower=0.5, upper=2.0)
    geo_mask(lower=0.5, upper=2.0, source='mismatch')
    """
    config = {"lower": _f(lower), "upper": _f(upper), "source": source}
    return _importance(
        "geo_mask", config, level="geometric", mode="mask", lower=lower, upper=upper, normalize=False, source=source
    )


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

"""Trust Region Masking (arXiv 2512.23075): drop whole sequences that leave the trust region.

* TRM-Max keeps a sequence iff max_t D_t ≤ δ (paper δ = 0.05), TRM-Avg iff mean_t D_t ≤ δ_avg (0.001), combined = both
  (§4).
  D_t = KL(π_roll(·|c_t) ‖ π_θ(·|c_t)), rollout first, ideally exact over the vocabulary (``offpolicy.divergence``).
  Without full logits the paper falls back to sample estimates on r = log(π/μ) of the sampled token: max test on k2,
  average test on k3 — only the exact KL carries the paper's guarantee (its App. E).
* Max-TRM rejects long sequences more often: with i.i.d. per-token violation probability p the acceptance rate is
  (1 − p)^T (0.774 / 0.359 / 0.017 at p = 1e-3, T = 256 / 1024 / 4096; the paper prints 0.358). LN-TRM and SER
  (its App. F) are length-neutral alternatives.

Masked sequences keep their place in the loss denominator (the paper normalises by the total batch size N).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from offpolicy.batch import LogProbBatch, check_mask, check_token_tensor
from offpolicy.corrections.base import Correction, CorrectionResult
from offpolicy.corrections.importance import behaviour_log_ratio, check_source, check_threshold
from offpolicy.ratios import (
    LOG_RATIO_BOUND,
    Reduce,
    as_mask,
    broadcast_rows,
    count,
    float_mask,
    is_finite,
    masked_fill_invalid,
    mean_over_sequences,
    nonfinite_rows,
    pad_nonempty,
    per_sequence,
    zero_outside,
)
from offpolicy.registry import register_correction

# ---------------------------------------------------------------------------------------------------------------------
# k-estimators (Schulman 2020, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html)
# ---------------------------------------------------------------------------------------------------------------------


def k1(r: Tensor) -> Tensor:
    """k1 = −r, r = log(π/μ) per token: unbiased for KL(μ‖π) under μ-samples but can be negative. float32.

    >>> k1(torch.tensor([0.5, -0.5]))
    tensor([-0.5000,  0.5000])
    """
    return -r.float()


def k2(r: Tensor) -> Tensor:
    """k2 = ½ r², r = log(π/μ): ≥ 0, low variance, biased; the TRM paper's token-level *max* test. float32.

    >>> k2(torch.tensor([0.5, -0.5]))  # 0.5 * 0.25
    tensor([0.1250, 0.1250])
    """
    r = r.float()
    return 0.5 * r * r


def k3(r: Tensor) -> Tensor:
    """k3 = e^r − 1 − r, r = log(π/μ): ≥ 0 and unbiased for KL(μ‖π) under μ-samples (E_μ[ρ] = 1); the TRM paper's
    *average* test. float32; ``expm1`` keeps small r accurate (the result is exactly ≥ 0 in floating point because
    fl(expm1(r)) ≥ r). r is clamped at +20 only, against overflow (k3(20) = 4.9e8, beyond any threshold): below −20 the
    linear term is the whole story (k3(−40) = 39, and −inf gives +inf), so a catastrophic token is never understated.

    >>> k3(torch.tensor([0.0, 1.0, -1.0, -40.0]))  # 0; e - 2 = 0.7183; 1/e = 0.3679; e^-40 - 1 + 40 = 39
    tensor([ 0.0000,  0.7183,  0.3679, 39.0000])
    """
    r = r.float().clamp(max=LOG_RATIO_BOUND)
    return torch.expm1(r) - r


# ---------------------------------------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------------------------------------


def _row_keep(m: Tensor, row_ok: Tensor) -> Tensor:
    return broadcast_rows(m, row_ok)


def trust_region_mask(
    token_divergence: Tensor,
    mask: Tensor,
    *,
    max_kl: float | None = None,
    avg_kl: float | None = None,
) -> Tensor:
    """TRM keep mask ``[B, T]`` (arXiv 2512.23075 §4, Eq. TRM-Max / TRM-Avg).

    ``token_divergence`` ``[B, T]``: per-token divergence D_t (exact KL(μ‖π), or a k-estimate). TRM-Max keeps
    sequence i iff max_t m_t D_t ≤ ``max_kl``; TRM-Avg iff (1/|y_i|) Σ_t m_t D_t ≤ ``avg_kl``; give both for the
    combined criterion (both must hold); at least one is required. A non-finite D_t in a valid position drops its
    sequence. Thresholds are finite and ≥ 0.

    >>> d = torch.tensor([[0.01, 0.02, 0.0], [0.001, 0.09, 0.0]]); m = torch.tensor([[1, 1, 0], [1, 1, 1]])
    >>> trust_region_mask(d, m, max_kl=0.05)  # row maxima 0.02 and 0.09
    tensor([[ True,  True, False],
            [False, False, False]])
    >>> trust_region_mask(d, m, avg_kl=0.02)  # row means 0.015 and 0.0303
    tensor([[ True,  True, False],
            [False, False, False]])
    """
    check_token_tensor("token_divergence", token_divergence)
    check_mask(mask, token_divergence, "token_divergence")
    mx = check_threshold("max_kl", max_kl, allow_zero=True, allow_none=True)
    av = check_threshold("avg_kl", avg_kl, allow_zero=True, allow_none=True)
    if mx is None and av is None:
        raise ValueError("trust_region_mask needs max_kl and/or avg_kl (both are None)")
    rows, cols = token_divergence.shape  # B = 0 or T = 0: as an all-masked batch (ratios.pad_nonempty)
    div, m = pad_nonempty(token_divergence.detach()), as_mask(pad_nonempty(mask, 0))
    return _trm_keep(div, div, m, mx, av)[:rows, :cols]


def _trm_keep(max_div: Tensor, avg_div: Tensor, m: Tensor, mx: float | None, av: float | None) -> Tensor:
    ok = torch.ones(m.shape[0], dtype=torch.bool, device=m.device)
    if mx is not None:
        ok = ok & (per_sequence(max_div, m, "max") <= mx) & ~nonfinite_rows(max_div, m)
    if av is not None:
        ok = ok & (per_sequence(avg_div, m, "mean") <= av) & ~nonfinite_rows(avg_div, m)
    return _row_keep(m, ok)


def _ln_trm_statistic(log_ratio: Tensor, m: Tensor, eps: float, delta: float) -> Tensor:
    r = masked_fill_invalid(log_ratio, m)  # padding / non-finite → 0 (non-finite rows are dropped by the caller)
    dev = (torch.exp(r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)) - 1.0).abs()
    t = m.cumsum(dim=-1)  # 1-based index among valid tokens
    T = count(m, dim=-1).unsqueeze(-1)
    ahead = (T - t).clamp(min=0).float()  # T − t: how many later tokens this one's context shift reaches
    w = torch.minimum(ahead * eps, torch.sqrt(ahead * (delta / 2.0))).clamp(max=1.0) * m
    W = (dev * w).sum(dim=-1)
    Z = w.sum(dim=-1)
    # Z = 0 only when T ≤ 1: a single token shifts no later context, the weighted deviation is defined as 0
    return torch.where(Z > 0, W / Z.clamp(min=1e-30), 0.0)


def ln_trm_mask(log_ratio: Tensor, mask: Tensor, *, eps: float, delta: float, threshold: float) -> Tensor:
    """Length-Neutral TRM keep mask ``[B, T]`` (arXiv 2512.23075 App. F).

    For sequence i let T be its number of valid tokens and t = 1..T the position of a valid token *among the valid
    tokens* (padding skipped). With ρ_t = exp(log_ratio_t):
    w_t = min(1, (T − t) ε, √((T − t) δ / 2)), W = Σ_t |ρ_t − 1| w_t, Z = Σ_t w_t, keep iff W / Z ≤ ``threshold``.
    The last token has w_T = 0 (it shifts no later context); a sequence with T ≤ 1 has Z = 0 and W/Z := 0 (kept).
    ε (max token TV) and δ (max token KL) shape the weights, as in the Adaptive bound; all three arguments are finite,
    ε, δ > 0, threshold ≥ 0. A non-finite log-ratio in a valid position drops its sequence.

    >>> r = torch.log(torch.tensor([[1.2, 1.0, 1.0]])); m = torch.ones(1, 3)
    >>> # T=3: w = min(1, (2, 1, 0)·0.5, √((2, 1, 0)·0.5)) = (1, 0.5, 0); W = 0.2·1 = 0.2; Z = 1.5; W/Z = 0.1333
    >>> ln_trm_mask(r, m, eps=0.5, delta=1.0, threshold=0.14), ln_trm_mask(r, m, eps=0.5, delta=1.0, threshold=0.13)
    (tensor([[True, True, True]]), tensor([[False, False, False]]))
    """
    check_token_tensor("log_ratio", log_ratio)
    check_mask(mask, log_ratio, "log_ratio")
    e = check_threshold("eps", eps)
    d = check_threshold("delta", delta)
    th = check_threshold("threshold", threshold, allow_zero=True)
    assert e is not None and d is not None and th is not None
    m = as_mask(mask)
    return _keep_rows_at_most(_ln_trm_statistic(log_ratio, m, e, d), th, log_ratio, m)


def _ser_statistic(log_ratio: Tensor, m: Tensor) -> Tensor:
    r = masked_fill_invalid(log_ratio, m)
    dev = (torch.exp(r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)) - 1.0).abs()
    return per_sequence(dev, m, "mean")


def ser_mask(log_ratio: Tensor, mask: Tensor, *, threshold: float) -> Tensor:
    """Sequence Error Rate keep mask ``[B, T]`` (arXiv 2512.23075 App. F): keep iff (1/T) Σ_t |ρ_t − 1| ≤ threshold,
    ρ_t = exp(log_ratio_t), T = valid tokens; recommended threshold ∈ [0.03, 0.10]. A non-finite log-ratio in a valid
    position drops its sequence.

    >>> r = torch.log(torch.tensor([[1.1, 0.9, 1.0], [1.5, 1.0, 1.0]])); m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    >>> ser_mask(r, m, threshold=0.1)  # (0.1+0.1+0)/3 = 0.067 kept; (0.5+0)/2 = 0.25 dropped
    tensor([[ True,  True,  True],
            [False, False, False]])
    """
    check_token_tensor("log_ratio", log_ratio)
    check_mask(mask, log_ratio, "log_ratio")
    th = check_threshold("threshold", threshold, allow_zero=True)
    assert th is not None
    m = as_mask(mask)
    return _keep_rows_at_most(_ser_statistic(log_ratio, m), th, log_ratio, m)


def _keep_rows_at_most(statistic: Tensor, threshold: float, log_ratio: Tensor, m: Tensor) -> Tensor:
    """Keep a sequence iff its ``statistic`` [B] ≤ ``threshold`` and none of its valid log-ratios is non-finite."""
    return _row_keep(m, (statistic <= threshold) & ~nonfinite_rows(log_ratio, m))


# ---------------------------------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------------------------------


@register_correction("trm")
def trm(max_kl: float | None = 0.05, avg_kl: float | None = 0.001, source: str = "total") -> Correction:
    """Trust Region Masking preset (arXiv 2512.23075; paper thresholds δ = 0.05 max, 0.001 avg; None disables one).

    Uses ``batch.token_divergence`` for both tests when given (``batch.token_divergence_kind`` says "exact" or
    "topk"); otherwise the paper's fallback on r = log(π_θ/μ) (``source="total"``, the default: the paper measures
    the rollout against the *current* policy, so policy drift over the minibatches counts too) or log(π_old/μ)
    (``"mismatch"``: the inference error alone): max test on k2(r), average test on k3(r) (needs ``rollout_logp``).

    Metrics: ``trm/max_divergence_mean`` (mean over sequences of the max-test divergence), ``trm/avg_divergence_mean``
    (of the avg-test divergence), ``trm/divergence_exact`` / ``trm/divergence_topk`` / ``trm/divergence_k_estimator``
    (one is 1, the others 0), and every correction's (:func:`~offpolicy.corrections.base.drop_metrics`):
    ``trm/masked_seq_frac`` of the sequences with ≥ 1 valid token (the paper's acceptance rate is 1 − it),
    ``trm/masked_frac`` of their tokens.

    >>> mu = torch.tensor([[0.0, 0.1], [0.0, 0.5]])
    >>> b = LogProbBatch(logp=torch.zeros(2, 2), rollout_logp=mu, mask=torch.ones(2, 2))
    >>> r = trm(avg_kl=None)(b)  # k2 maxima: 0.5·0.1² = 0.005 and 0.5·0.5² = 0.125 vs 0.05
    >>> r.keep, r.metrics["trm/masked_seq_frac"], r.metrics["trm/divergence_k_estimator"]
    (tensor([[ True,  True],
            [False, False]]), tensor(0.5000), tensor(1.))
    """
    mx = check_threshold("max_kl", max_kl, allow_zero=True, allow_none=True)
    av = check_threshold("avg_kl", avg_kl, allow_zero=True, allow_none=True)
    if mx is None and av is None:
        raise ValueError("trm needs max_kl and/or avg_kl (both are None)")
    check_source(source)

    def apply(batch: LogProbBatch) -> CorrectionResult:
        m = batch.bool_mask
        if batch.token_divergence is not None:
            max_divergence = avg_divergence = batch.token_divergence.detach().float()
            kind = batch.token_divergence_kind
        else:  # the paper's fallback: k2 for the max test, k3 for the average test
            kind = "k_estimator"
            r = behaviour_log_ratio(batch, source, "trm")
            finite = m & is_finite(r)
            clean = zero_outside(r, finite)
            max_divergence, avg_divergence = k2(clean), k3(clean)  # 0 where r is not finite (in the statistics) …
        keep = _trm_keep(max_divergence, avg_divergence, m, mx, av)
        if batch.token_divergence is None:  # … but a non-finite r is an unbounded divergence: its sequence is dropped
            keep = broadcast_rows(keep, ~nonfinite_rows(r, m))
        nonempty = count(m, dim=-1) > 0
        metrics = {
            # the statistics leave non-finite divergences out (they count as 0 in the mean)
            "trm/max_divergence_mean": mean_over_sequences(per_sequence(max_divergence, m, "max"), nonempty),
            "trm/avg_divergence_mean": mean_over_sequences(per_sequence(avg_divergence, m, "mean"), nonempty),
        }
        for name in ("exact", "topk", "k_estimator"):
            metrics[f"trm/divergence_{name}"] = torch.tensor(float(kind == name), device=m.device)
        return CorrectionResult(float_mask(m), keep, metrics, weight_level=None)

    return Correction("trm", apply, {"max_kl": mx, "avg_kl": av, "source": source})


@register_correction("ln_trm")
def ln_trm(eps: float = 5e-3, delta: float = 1e-4, threshold: float = 0.05, source: str = "total") -> Correction:
    """Length-Neutral TRM preset on log(π_θ/μ) (or log(π_old/μ), ``source="mismatch"``); see :func:`ln_trm_mask`.

    The defaults are not the paper's (it gives none): ε, δ from its worked example (ε = 5e-3, δ = 1e-4) and the
    threshold from SER's recommended range, since W/Z is a weighted mean of the same |ρ_t − 1|.
    Metrics: ``ln_trm/stat_mean`` (mean W/Z over sequences) and every correction's (``ln_trm/masked_seq_frac`` …).

    >>> ln_trm()
    ln_trm(eps=0.005, delta=0.0001, threshold=0.05, source='total')
    """
    e = check_threshold("eps", eps)
    d = check_threshold("delta", delta)
    th = check_threshold("threshold", threshold, allow_zero=True)
    assert e is not None and d is not None and th is not None
    check_source(source)

    statistic = partial(_ln_trm_statistic, eps=e, delta=d)
    return _row_statistic_mask("ln_trm", statistic, th, source, {"eps": e, "delta": d, "threshold": th, "source": source})


@register_correction("ser")
def ser(threshold: float = 0.05, source: str = "total") -> Correction:
    """Sequence-Error-Rate preset on log(π_θ/μ) (or log(π_old/μ), ``source="mismatch"``; see :func:`ser_mask`;
    recommended threshold 0.03–0.10).
    Metrics: ``ser/stat_mean`` (mean over sequences of mean_t |ρ_t − 1|) and every correction's
    (``ser/masked_seq_frac`` …).

    >>> ser()
    ser(threshold=0.05, source='total')
    """
    th = check_threshold("threshold", threshold, allow_zero=True)
    assert th is not None
    check_source(source)

    return _row_statistic_mask("ser", _ser_statistic, th, source, {"threshold": th, "source": source})


def _row_statistic_mask(
    name: str, statistic: Callable[[Tensor, Tensor], Tensor], threshold: float, source: str, config: dict[str, object]
) -> Correction:
    """A sequence mask that keeps a row iff ``statistic(raw log-ratio, mask) [B] <= threshold`` (LN-TRM, SER).

    Metric ``<name>/stat_mean`` (and every correction's); a non-finite valid log-ratio drops its sequence.
    """

    def apply(batch: LogProbBatch) -> CorrectionResult:
        r = behaviour_log_ratio(batch, source, name)
        m = batch.bool_mask
        stat = statistic(r, m)  # once, for the mask (as ln_trm_mask / ser_mask) and the metric
        keep = _keep_rows_at_most(stat, threshold, r, m)
        nonempty = count(m, dim=-1) > 0
        metrics = {f"{name}/stat_mean": mean_over_sequences(stat, nonempty)}
        return CorrectionResult(float_mask(m), keep, metrics, weight_level=None)

    return Correction(name, apply, config)


# ---------------------------------------------------------------------------------------------------------------------
# verl's divergence rejection modes (rollout_rs = token_k2 … seq_max_k3)
# ---------------------------------------------------------------------------------------------------------------------

_K_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {"k2": k2, "k3": k3}
_SEQUENCE_REDUCE: dict[str, Reduce] = {"seq_sum": "sum", "seq_mean": "mean", "seq_max": "max"}  # k ≥ 0 per token
KL_REJECTION_MODES: tuple[str, ...] = tuple(
    f"{agg}_{k}" for agg in ("token", *_SEQUENCE_REDUCE) for k in ("k2", "k3")
)


@register_correction("kl_rejection")
def kl_rejection(mode: str, upper: float, source: str = "mismatch", name: str | None = None) -> Correction:
    """verl's divergence rejection (``rollout_rs=<mode>``, ``rollout_rs_threshold=<upper>``): drop what a per-token
    k-estimate of KL(μ‖π) on r = log(π/μ) puts above ``upper``.

    ``mode`` is verl's name, ``<aggregate>_<estimator>``: estimator ``k2`` = ½r² or ``k3`` = e^r − 1 − r
    (:func:`k2`, :func:`k3`); aggregate ``token`` (drop the token iff k_t > upper), ``seq_sum`` (drop the sequence iff
    Σ_t k_t > upper), ``seq_mean`` (iff the mean over its valid tokens is) or ``seq_max`` (iff its largest k_t is).
    Kept iff ≤ ``upper`` (> 0, finite). A NaN/±inf log-ratio in a valid position drops its token (``token``) or its
    sequence. r = log(π_old/μ) (``source="mismatch"``, verl's decoupled mode) or log(π_θ/μ) (``"total"``).
    verl's ``*_k1`` modes are ratio bands at token / sequence (sum) / geometric (mean) level: use
    ``mis(level=…, lower=…, upper=…)``, whose bounds act on ρ itself (verl's k1 bounds act on −log ρ).

    Differences from verl worth knowing: verl writes a rejection into ``response_mask`` (its token-mean denominator
    shrinks), here a dropped token keeps its place in the denominator; verl's k3 clamps log ρ at ±20 on both sides,
    ours only at +20, so a token below e^−20 is not understated (:func:`k3`).

    Metrics (prefix ``name``, default ``mode``): ``<name>/stat_mean`` (mean of the statistic over valid tokens, or over
    non-empty sequences) and every correction's: the rejected share is ``<name>/masked_frac`` of the tokens and
    ``<name>/masked_seq_frac`` of the sequences (:func:`~offpolicy.corrections.base.drop_metrics`).

    >>> mu = torch.zeros(2, 2); logp = torch.tensor([[0.1, 0.1], [0.1, 0.5]])
    >>> b = LogProbBatch(logp=logp, rollout_logp=mu, mask=torch.ones(2, 2))
    >>> r = kl_rejection("seq_max_k2", upper=0.05)(b)  # row maxima ½·0.1² = 0.005 and ½·0.5² = 0.125
    >>> r.keep, r.metrics["seq_max_k2/masked_seq_frac"]
    (tensor([[ True,  True],
            [False, False]]), tensor(0.5000))
    """
    if mode not in KL_REJECTION_MODES:
        hint = " (k1 modes are ratio bands: use mis(level=token|sequence|geometric, ...))" if str(mode).endswith("k1") else ""
        raise ValueError(f"mode must be one of {KL_REJECTION_MODES}, got {mode!r}{hint}")
    u = check_threshold("upper", upper)
    assert u is not None
    check_source(source)
    label = mode if name is None else name
    aggregate, estimator = mode.rsplit("_", 1)
    k_of = _K_ESTIMATORS[estimator]

    def apply(batch: LogProbBatch) -> CorrectionResult:
        r = behaviour_log_ratio(batch, source, label)
        m = batch.bool_mask
        defined = m & is_finite(r)
        k = k_of(zero_outside(r, defined))  # 0 at padding and at an undefined r (dropped below)
        if aggregate == "token":
            keep = defined & (k <= u)
            stat_mean = k.sum() / count(m).clamp(min=1)
        else:
            stat = per_sequence(k, m, _SEQUENCE_REDUCE[aggregate])
            keep_row = (stat <= u) & ~nonfinite_rows(r, m)
            keep = broadcast_rows(m, keep_row)
            nonempty = count(m, dim=-1) > 0
            stat_mean = mean_over_sequences(stat, nonempty)
        metrics = {f"{label}/stat_mean": stat_mean}
        return CorrectionResult(float_mask(m), keep, metrics, weight_level=None)

    return Correction(label, apply, {"mode": mode, "upper": u, "source": source})

"""Training–inference mismatch diagnostics, under ms-swift's, verl's or TRL's metric names.

Notation: π = ``train_logp`` (the training engine: π_old or π_θ, whatever you want to compare), μ = ``rollout_logp``
(the inference engine that sampled), valid tokens V = mask=1 *and* both log-probs finite, per-token log-ratio
r_t = log π_t − log μ_t, ρ_t = exp(clamp(r_t, ±20)), sequences S = those with ≥ 1 valid token, |y_i| = valid tokens
of sequence i. ``E_V`` is the mean over valid tokens, ``E_S`` the mean over non-empty sequences.

=========================  ================================================================================================
name (prefix + …)          definition
=========================  ================================================================================================
``kl``                     E_V[log μ − log π]            direct estimator of KL(μ‖π) under μ-samples (can be < 0)
``k3_kl``                  E_V[ρ − log ρ − 1]            Schulman's k3, ≥ 0 (log ρ clamped ±20)
``k2_kl``                  E_V[½ (log π − log μ)²]        Schulman's k2, ≥ 0 (Tinker's ``kl_sample_train_v2``)
``training_ppl``           E_S[exp(−(1/|y_i|) Σ_t log π)]  per-sequence PPL, then averaged (verl / ms-swift)
``training_log_ppl``       E_S[−(1/|y_i|) Σ_t log π]
``rollout_ppl``            E_S[exp(−(1/|y_i|) Σ_t log μ)]
``rollout_log_ppl``        E_S[−(1/|y_i|) Σ_t log μ]
``log_ppl_diff``           E_S[d_i], d_i = mean_t log μ − mean_t log π = log PPL_π,i − log PPL_μ,i
                           (positive ⇔ the training policy assigns *lower* probability)
``log_ppl_abs_diff``       E_S[|d_i|]
``log_ppl_diff_max/_min``  max_S d_i / min_S d_i
``ppl_ratio``              E_S[exp(d_i)] = E_S[PPL_π,i / PPL_μ,i]  (per sequence first, then averaged)
``chi2_token``             E_V[ρ_t²] − 1
``chi2_seq``               E_S[ρ_geo,i²] − 1, ρ_geo,i = exp(clamp(mean_t r_t, ±20))   (ms-swift: geometric)
``chi2_seq_product``       E_S[exp(2 · clamp(Σ_t r_t, ±20))] − 1                      (verl's ``chi2_seq``: product)
``ess``                    (E_V w)² / E_V[w²] ∈ [0, 1]  (normalised effective sample size; 0 when every weight is 0)
``is_weight_mean/max/min`` E_V[w], max_V w, min_V w
``clipped_frac``           fraction of valid tokens whose weight differs from the raw ratio at ``level``,
                           |w − ρ_level| > 1e-6·ρ_level (truncated or masked; 0 when ``weights`` is None)
``raw_ratio_mean/max/min`` mean / max / min over V of the raw token ratio ρ_t, before any truncation
``logp_abs_diff_mean/max`` E_V|r_t| / max_V |r_t| (TRL's ``sampling_logp_difference``)
``masked_frac``            fraction of valid tokens with w = 0;  ``accepted_frac`` = 1 − masked_frac
``nonfinite_tokens``       number of mask=1 positions where log π or log μ is NaN/±inf (excluded from everything)
``nonfinite_rollout_tokens``  those of them where log μ is: the rollout engine's failures (a batch is refused past
                           ``LogProbBatch.max_nonfinite_rollout`` of the valid tokens, 1e-3 by default)
=========================  ================================================================================================

w is ``weights`` (the correction weights actually applied) or, when None, the raw token ratio ρ_t. Empty input
(no valid token) gives the on-policy values: kl = k3 = k2 = χ² = 0, PPLs and ppl_ratio = 1, log-PPLs = 0, ess = 1,
weight and raw ratio stats = 1, |r| stats 0, fractions 0 (accepted_frac 1) — finite, never NaN. Sequences without a
valid token are left out of E_S (verl averages them in as PPL 1).

Names (``naming=``): ``swift`` (the default, ms-swift's ``rollout_correction/<name>``), ``verl`` (verl's
``rollout_corr/<name>``, with verl's own names where it has the metric: ``chi2_seq`` is the product there and ours
is ``chi2_seq_geometric``, ``ess`` → ``rollout_is_eff_sample_size``, ``is_weight_*`` → ``rollout_is_*``,
``masked_frac`` → ``rollout_rs_masked_fraction``), ``trl`` (``sampling/<name>``, with TRL's
``sampling_logp_difference/mean|max`` and ``importance_sampling_ratio/mean|min|max``), ``openrlhf`` (``train/<name>``
as OpenRLHF logs, ``kl`` → ``vllm_kl``: its mean of log μ − log π_old) and ``tinker`` (``optim/<name>``, as the
Tinker cookbook logs, ``kl`` → ``kl_sample_train_v1``: the mean of the sampler's minus the trainer's log-prob, and
``k2_kl`` → ``kl_sample_train_v2``: half their mean squared difference). Names a framework has no metric for keep
ours under its prefix. :data:`NAMINGS` has the tables.

Differences from ms-swift worth knowing: ms-swift's ``ess`` uses the weights clamped to the threshold band *before*
masking, ours uses the weights you pass (pass the truncated-only weights to reproduce it); its ``clipped_frac`` counts
ratios above the threshold, which for a truncation is the same set of tokens as "weight ≠ raw ratio". TRL's
importance-ratio statistics are per sequence at sequence level; ours are per token.

Nothing here calls ``.item()``: the caller decides when to sync and log.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from offpolicy.batch import check_mask, check_same_shape, check_token_tensor
from offpolicy.corrections.base import CorrectionResult
from offpolicy.ratios import (
    FLOAT32_MAX,
    LEVELS,
    LOG_RATIO_BOUND,
    Level,
    as_factor,
    as_mask,
    count,
    is_finite,
    keep_only,
    max_where,
    mean_over_sequences,
    min_where,
    pad_nonempty,
    per_sequence,
    sequence_log_ratio,
    zero_outside,
)

METRIC_NAMES: tuple[str, ...] = (
    "kl", "k3_kl", "k2_kl", "training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
    "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq",
    "chi2_seq_product", "ess", "is_weight_mean", "is_weight_max", "is_weight_min", "clipped_frac", "raw_ratio_mean",
    "raw_ratio_max", "raw_ratio_min", "logp_abs_diff_mean", "logp_abs_diff_max", "masked_frac", "accepted_frac",
    "nonfinite_tokens", "nonfinite_rollout_tokens",
)  # fmt: skip


@dataclass(frozen=True)
class Naming:
    """How one framework names the metrics: a ``prefix`` and the metrics it calls something else (``renames``)."""

    prefix: str
    renames: dict[str, str] = field(default_factory=dict)

    def key(self, name: str, prefix: str | None = None) -> str:
        return f"{self.prefix if prefix is None else prefix}{self.renames.get(name, name)}"


NAMINGS: dict[str, Naming] = {
    "swift": Naming("rollout_correction/"),
    "verl": Naming("rollout_corr/", {
        "chi2_seq_product": "chi2_seq", "chi2_seq": "chi2_seq_geometric", "ess": "rollout_is_eff_sample_size",
        "is_weight_mean": "rollout_is_mean", "is_weight_max": "rollout_is_max", "is_weight_min": "rollout_is_min",
        "masked_frac": "rollout_rs_masked_fraction",
    }),
    "trl": Naming("sampling/", {
        "logp_abs_diff_mean": "sampling_logp_difference/mean", "logp_abs_diff_max": "sampling_logp_difference/max",
        "is_weight_mean": "importance_sampling_ratio/mean", "is_weight_min": "importance_sampling_ratio/min",
        "is_weight_max": "importance_sampling_ratio/max",
    }),
    "openrlhf": Naming("train/", {"kl": "vllm_kl"}),
    "tinker": Naming("optim/", {"kl": "kl_sample_train_v1", "k2_kl": "kl_sample_train_v2"}),
}  # fmt: skip


def metric_names(naming: str = "swift", prefix: str | None = None) -> tuple[str, ...]:
    """The keys :func:`offpolicy_metrics` returns under ``naming`` (and an optional ``prefix`` in place of its own).

    >>> metric_names("verl")[:2], metric_names("trl")[-5]
    (('rollout_corr/kl', 'rollout_corr/k3_kl'), 'sampling/sampling_logp_difference/max')
    """
    return tuple(check_naming(naming).key(name, prefix) for name in METRIC_NAMES)


def check_naming(naming: str) -> Naming:
    if naming not in NAMINGS:
        raise ValueError(f"naming must be one of {tuple(NAMINGS)}, got {naming!r}")
    return NAMINGS[naming]


def offpolicy_metrics(
    train_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    weights: Tensor | CorrectionResult | None = None,
    *,
    naming: str = "swift",
    prefix: str | None = None,
    level: Level | None = None,
) -> dict[str, Tensor]:
    """Mismatch diagnostics between the training engine and the rollout engine (see the module docstring).

    Args:
        train_logp: [B, T] log π of the sampled tokens under the training engine (detached here).
        rollout_logp: [B, T] log μ under the inference engine.
        mask: [B, T] 1 for response tokens that count.
        weights: optional [B, T] correction weights actually applied, or the :class:`CorrectionResult` itself (its
            ``coefficient`` = weights · keep is used, and its ``weight_level``).
        naming: ``swift`` (``rollout_correction/…``), ``verl`` (``rollout_corr/…``), ``trl`` (``sampling/…``),
            ``openrlhf`` (``train/…``) or ``tinker`` (``optim/…``).
        prefix: replaces the naming's prefix (``""`` gives bare names).
        level: level of ``weights`` (``token``/``sequence``/``geometric``): ``clipped_frac`` compares them with the
            raw ratio at this level. Default: the result's own (a chain of several levels compares at ``token``),
            ``token`` for a plain tensor. A result whose weights carry no ratio (only masks: opsm, veto, trm, …) has
            nothing to truncate: its ``clipped_frac`` is the dropped fraction.

    Returns:
        dict of 0-d float32 tensors (:func:`metric_names`).

    >>> lp = torch.tensor([[-1.0, -2.0]]); mu = torch.tensor([[-1.0, -1.0]])
    >>> m = offpolicy_metrics(lp, mu, torch.ones(1, 2), prefix="")
    >>> round(m["kl"].item(), 4)   # mean(log μ − log π) = (0 + 1) / 2
    0.5
    >>> round(m["ess"].item(), 3)  # w = (1, e⁻¹): (mean w)² / mean w² = 0.46778 / 0.56767
    0.824
    >>> sorted(offpolicy_metrics(lp, mu, torch.ones(1, 2), naming="verl"))[:2]
    ['rollout_corr/accepted_frac', 'rollout_corr/chi2_seq']
    """
    names = check_naming(naming)
    check_token_tensor("train_logp", train_logp)
    check_token_tensor("rollout_logp", rollout_logp)
    check_same_shape("rollout_logp", rollout_logp, "train_logp", train_logp)
    check_mask(mask, train_logp, "train_logp")
    if level is not None and level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    ratio_free = False  # the weights are masks only: "clipped" can only mean "masked"
    if isinstance(weights, CorrectionResult):
        check_same_shape("weights.keep", weights.keep, "train_logp", train_logp)
        if level is None:
            ratio_free = weights.weight_level is None
            level = weights.weight_level if weights.weight_level in LEVELS else "token"  # type: ignore[assignment]
        weights = weights.coefficient
    if weights is not None:
        check_token_tensor("weights", weights)
        check_same_shape("weights", weights, "train_logp", train_logp)
    if train_logp.numel() == 0:  # B = 0 or T = 0: the all-masked batch's metrics (see ratios.pad_nonempty)
        train_logp, rollout_logp, mask = pad_nonempty(train_logp), pad_nonempty(rollout_logp), pad_nonempty(mask, 0)
        weights = None if weights is None else pad_nonempty(weights)

    pi, mu = train_logp.detach().float(), rollout_logp.detach().float()
    m = as_mask(mask)
    difference = pi - mu
    valid = m & is_finite(difference)  # finite exactly where both log-probs are
    tokens = _Tokens(zero_outside(difference, valid), valid)
    out = _mismatch(zero_outside(pi, valid), tokens)
    out.update(_weight_stats(weights, tokens, level or "token", ratio_free))
    out["nonfinite_tokens"] = (count(m) - tokens.n_valid).float()
    out["nonfinite_rollout_tokens"] = count(m & ~is_finite(mu)).float()
    return {names.key(name, prefix): out[name] for name in METRIC_NAMES}


class _Tokens:
    """The cleaned log-ratio and what every metric reads of it (computed once per call)."""

    def __init__(self, r: Tensor, valid: Tensor) -> None:
        self.r = r  # log ρ, exactly 0 at invalid positions
        self.r_safe = r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        self.valid = valid
        self.n_valid = count(valid)
        self.n = self.n_valid.clamp(min=1)
        self.any_valid = self.n_valid > 0
        self.length = count(valid, dim=-1)  # valid tokens per sequence
        self.row_sum = per_sequence(r, valid, "sum")  # Σ_t log ρ_t per sequence
        # added to a value, it puts the invalid positions beyond any min; subtracted, below any max
        self.out_of_reach = FLOAT32_MAX * as_factor(~valid)
        self.rho = torch.exp(self.r_safe)  # ρ, 1 at invalid positions

    def max_min(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Max and min of a finite ``x`` over the valid tokens (meaningless when there is none)."""
        return (x - self.out_of_reach).amax(), (x + self.out_of_reach).amin()


def _mismatch(pi: Tensor, t: _Tokens) -> dict[str, Tensor]:
    """The divergence, perplexity and χ² metrics from log π (0 at invalid positions) and the log-ratio."""
    expm1 = torch.expm1(t.r_safe)  # ρ − 1, accurate for the tiny log-ratios of a well-matched engine; 0 at invalid
    nonempty = t.length > 0
    mean_pi = per_sequence(pi, t.valid, "mean")
    mean_r = per_sequence(t.r, t.valid, "mean")  # the geometric log-ratio, unclamped
    mean_mu = mean_pi - mean_r
    d = mean_mu - mean_pi  # log PPL_π − log PPL_μ per sequence
    geometric = mean_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    product = t.row_sum.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    r_max, r_min = t.max_min(t.r_safe)
    abs_r = t.r.abs()

    def seq_mean(x: Tensor) -> Tensor:
        return mean_over_sequences(x, nonempty)

    def or_one(x: Tensor) -> Tensor:  # the on-policy value when no token is valid
        return torch.where(t.any_valid, x, 1.0)

    return {
        "kl": -t.r.sum() / t.n,
        "k3_kl": (expm1 - t.r_safe).sum() / t.n,  # Σ (ρ − 1 − log ρ)
        "k2_kl": 0.5 * (t.r * t.r).sum() / t.n,  # Σ ½ (log ρ)², unclamped (Tinker's v2 squares the raw difference)
        "training_ppl": or_one(seq_mean(torch.exp(-mean_pi))),
        "training_log_ppl": seq_mean(-mean_pi),
        "rollout_ppl": or_one(seq_mean(torch.exp(-mean_mu))),
        "rollout_log_ppl": seq_mean(-mean_mu),
        "log_ppl_diff": seq_mean(d),
        "log_ppl_abs_diff": seq_mean(d.abs()),
        "log_ppl_diff_max": max_where(d, nonempty),
        "log_ppl_diff_min": min_where(d, nonempty),
        "ppl_ratio": or_one(seq_mean(torch.exp(d.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)))),
        "chi2_token": (expm1 * (expm1 + 2.0)).sum() / t.n,  # Σ (ρ² − 1)
        "chi2_seq": seq_mean(torch.expm1(2.0 * geometric)),
        "chi2_seq_product": seq_mean(torch.expm1(2.0 * product)),
        "raw_ratio_mean": or_one(1.0 + expm1.sum() / t.n),
        "raw_ratio_max": or_one(torch.exp(r_max)),
        "raw_ratio_min": or_one(torch.exp(r_min)),
        "logp_abs_diff_mean": abs_r.sum() / t.n,
        "logp_abs_diff_max": abs_r.amax(),
    }


def _weight_stats(weights: Tensor | None, t: _Tokens, level: Level, ratio_free: bool) -> dict[str, Tensor]:
    """ESS, the weight statistics and the clipped / masked fractions of the applied weights (ρ_t when None)."""
    if weights is None:
        w = keep_only(t.rho, t.valid)
        clipped = masked = torch.zeros((), device=t.r.device)
    else:
        w = zero_outside(weights.detach().float(), t.valid)  # a non-finite weight counts as 0
        masked = count(t.valid & (w == 0)) / t.n
        if ratio_free:
            clipped = masked
        else:
            if level == "token":
                raw = t.rho
            else:
                raw = torch.exp(sequence_log_ratio(t.r, t.valid, level)).unsqueeze(-1)
            # relative tolerance: a weight that is the ratio itself must not count as changed through rounding
            clipped = count(t.valid & ((w - raw).abs() > raw * 1e-6)) / t.n
    w_mean = w.sum() / t.n
    w_sq_mean = (w * w).sum() / t.n
    w_max, w_min = t.max_min(w)
    # ESS = (E w)² / E[w²] — the same as 1/E[(w/E w)²] but finite when every weight is 0 (then ESS = 0)
    ess = (w_mean * w_mean / w_sq_mean.clamp(min=torch.finfo(torch.float32).tiny)).clamp(max=1.0)
    return {
        "ess": torch.where(t.any_valid, ess, 1.0),
        "is_weight_mean": torch.where(t.any_valid, w_mean, 1.0),
        "is_weight_max": torch.where(t.any_valid, w_max, 1.0),
        "is_weight_min": torch.where(t.any_valid, w_min, 1.0),
        "clipped_frac": clipped.float(),
        "masked_frac": masked.float(),
        "accepted_frac": 1.0 - masked.float(),
    }


def metrics_by_staleness(staleness: Tensor, train_logp: Tensor, rollout_logp: Tensor, mask: Tensor,
                      result: CorrectionResult | None = None, corrected_logp: Tensor | None = None) -> dict[str, Tensor]:
    """``staleness/mean``, ``staleness/max`` and, per staleness d present, ``staleness/d<d>/k3_kl`` (π_θ =
    ``train_logp`` against μ = ``rollout_logp``), ``/clipped_frac``, ``/masked_frac`` (of ``result``, the correction
    applied, against the ratio it was computed from: ``corrected_logp``/μ, ``corrected_logp`` defaulting to
    ``train_logp``; π_prox under the log-linear proximal policy) and ``/tokens``. All inputs ``[S, T]``,
    ``staleness`` −1 off the mask.

    >>> st = torch.tensor([[0, 0], [2, -1]]); m = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    >>> out = metrics_by_staleness(st, torch.zeros(2, 2), torch.tensor([[0.0, 0.0], [-1.0, 0.0]]), m)
    >>> round(out["staleness/mean"].item(), 6), out["staleness/max"].item(), out["staleness/d0/k3_kl"].item()
    (0.666667, 2.0, 0.0)
    >>> round(out["staleness/d2/k3_kl"].item(), 4)   # ρ = e: e − 1 − 1
    0.7183
    """
    valid = mask.bool() & (staleness >= 0)
    values = staleness[valid].float()
    out: dict[str, Tensor] = {
        "staleness/mean": values.mean() if values.numel() else torch.zeros(()),
        "staleness/max": values.max() if values.numel() else torch.zeros(()),
    }
    for d in torch.unique(staleness[valid]).tolist():
        bucket = (valid & (staleness == d)).float()
        out[f"staleness/d{d}/k3_kl"] = offpolicy_metrics(train_logp, rollout_logp, bucket, prefix="")["k3_kl"]
        m = offpolicy_metrics(train_logp if corrected_logp is None else corrected_logp, rollout_logp, bucket, result,
                              prefix="")
        for name in ("clipped_frac", "masked_frac"):
            out[f"staleness/d{d}/{name}"] = m[name]
        out[f"staleness/d{d}/tokens"] = bucket.sum()
    return out

"""Training–inference mismatch diagnostics with ms-swift's names (seed 002) plus verl's product χ² and raw ratio stats.

Notation: π = ``train_logp`` (the training engine: π_old or π_θ, whatever you want to compare), μ = ``rollout_logp``
(the inference engine that sampled), valid tokens V = mask=1 *and* both log-probs finite, per-token log-ratio
r_t = log π_t − log μ_t, ρ_t = exp(clamp(r_t, ±20)), sequences S = those with ≥ 1 valid token, |y_i| = valid tokens
of sequence i. ``E_V`` is the mean over valid tokens, ``E_S`` the mean over non-empty sequences.

=========================  ================================================================================================
name (prefix + …)          definition
=========================  ================================================================================================
``kl``                     E_V[log μ − log π]            direct estimator of KL(μ‖π) under μ-samples (can be < 0)
``k3_kl``                  E_V[ρ − log ρ − 1]            Schulman's k3, ≥ 0 (log ρ clamped ±20)
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
``ess``                    1 / E_V[(w/E_V w)²] = (E_V w)² / E_V[w²] ∈ [0, 1]  (normalised effective sample size;
                           0 when every weight is 0)
``is_weight_mean``         E_V[w]
``clipped_frac``           fraction of valid tokens whose weight differs from the raw ratio at ``level``,
                           |w − ρ_level| > 1e-6·ρ_level (truncated or masked; 0 when ``weights`` is None)
``raw_ratio_mean/max/min`` mean / max / min over V of the raw token ratio ρ_t, before any truncation (trl 5231)
``masked_frac``            fraction of valid tokens with w = 0;  ``accepted_frac`` = 1 − masked_frac
``nonfinite_tokens``       number of mask=1 positions where log π or log μ is NaN/±inf (excluded from everything)
=========================  ================================================================================================

w is ``weights`` (the correction weights actually applied) or, when None, the raw token ratio ρ_t. Empty input
(no valid token) gives the on-policy values: kl = k3 = χ² = 0, PPLs and ppl_ratio = 1, log-PPLs = 0, ess = 1,
is_weight_mean = raw ratio stats = 1, fractions 0 (accepted_frac 1) — finite, never NaN. Sequences without a valid
token are left out of E_S (verl averages them in as PPL 1).

Differences from ms-swift worth knowing: ms-swift's ``ess`` uses the weights clamped to the threshold band *before*
masking, ours uses the weights you pass (pass the truncated-only weights to reproduce it); its ``clipped_frac`` counts
ratios above the threshold, which for a truncation is the same set of tokens as "weight ≠ raw ratio".

Nothing here calls ``.item()``: the caller decides when to sync and log.
"""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.batch import check_mask, check_same_shape, check_token_tensor
from offpolicy.corrections.base import CorrectionResult
from offpolicy.corrections.importance import find_shared_log_ratio
from offpolicy.ratios import LEVELS, LOG_RATIO_BOUND, Level, as_mask, float_mask, nan_to_num, pad_nonempty, sequence_means

METRIC_NAMES: tuple[str, ...] = (
    "kl", "k3_kl", "training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
    "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq",
    "chi2_seq_product", "ess", "is_weight_mean", "clipped_frac", "raw_ratio_mean", "raw_ratio_max", "raw_ratio_min",
    "masked_frac", "accepted_frac", "nonfinite_tokens",
)  # fmt: skip


def offpolicy_metrics(
    train_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    weights: Tensor | CorrectionResult | None = None,
    *,
    prefix: str = "rollout_correction/",
    level: Level | None = None,
) -> dict[str, Tensor]:
    """Mismatch diagnostics between the training engine and the rollout engine (names: seed 002 / ms-swift).

    Args:
        train_logp: [B, T] log π of the sampled tokens under the training engine (detached here).
        rollout_logp: [B, T] log μ under the inference engine.
        mask: [B, T] 1 for response tokens that count.
        weights: optional [B, T] correction weights actually applied, or the :class:`CorrectionResult` itself (its
            ``coefficient`` = weights · keep is used). Passing the result also lets the metrics reuse the cleaned
            log-ratio its corrections computed from these very tensors (``CorrectionResult.shared``): same numbers,
            about a third fewer passes over [B, T].
        prefix: prepended to every name (ms-swift logs ``rollout_correction/…``).
        level: level of ``weights`` (``token``/``sequence``/``geometric``): ``clipped_frac`` compares them with the
            raw ratio at this level. Default: the result's own (:attr:`CorrectionResult.weight_level`; a chain of
            several levels compares at ``token``), ``token`` for a plain tensor. A result whose weights carry no ratio
            (only masks: opsm, veto, trm, …) has nothing to truncate: its ``clipped_frac`` is the dropped fraction.

    Returns:
        dict of 0-d float32 tensors, names in the module docstring (:data:`METRIC_NAMES`).

    >>> lp = torch.tensor([[-1.0, -2.0]]); mu = torch.tensor([[-1.0, -1.0]])
    >>> m = offpolicy_metrics(lp, mu, torch.ones(1, 2), prefix="")
    >>> round(m["kl"].item(), 4)   # mean(log μ − log π) = (0 + 1) / 2
    0.5
    >>> round(m["ess"].item(), 3)  # w = (1, e⁻¹): (mean w)² / mean w² = 0.46778 / 0.56767
    0.824
    """
    check_token_tensor("train_logp", train_logp)
    check_token_tensor("rollout_logp", rollout_logp)
    check_same_shape("rollout_logp", rollout_logp, "train_logp", train_logp)
    check_mask(mask, train_logp, "train_logp")
    result = weights if isinstance(weights, CorrectionResult) else None
    keep = None
    if result is not None:
        weights = result.weights
        check_same_shape("weights.keep", result.keep, "train_logp", train_logp)
        keep = result.keep_multiplicand()
    if weights is not None:
        check_token_tensor("weights", weights)
        check_same_shape("weights", weights, "train_logp", train_logp)
    if level is not None and level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    ratio_free = level is None and result is not None and result.weight_level is None  # pure masks: no ratio in w
    if level is None:
        from_result = result.weight_level if result is not None else None
        level = from_result if from_result in LEVELS else "token"

    if train_logp.numel() == 0:  # B = 0 or T = 0: the all-masked batch's metrics (see ratios.pad_nonempty)
        train_logp, rollout_logp, mask = pad_nonempty(train_logp), pad_nonempty(rollout_logp), pad_nonempty(mask, 0)
        if weights is not None:
            weights = pad_nonempty(weights)
        keep, result = (None if keep is None else pad_nonempty(keep)), None
    pi = train_logp.detach().float()
    mu = rollout_logp.detach().float()
    m = as_mask(mask)
    n_all = pi.numel()

    # This runs every step on [B, T]: every metric below is built from a handful of full passes (one log-ratio, one
    # expm1, a few row sums), the rest is arithmetic on [B] rows or scalars. Float masks + nan_to_num instead of
    # torch.where / isfinite: a bool-mask where is ~15× slower than a float multiply on CPU.
    shared = None if result is None else find_shared_log_ratio(result.shared, train_logp, rollout_logp, mask)
    if shared is not None:  # the correction's terms of the same log π − log μ: the same numbers, already computed
        vf, r, seq_len, sum_r = shared.terms.ok, shared.terms.clean, shared.terms.ok_row, shared.terms.sum_row
        r_safe = shared.clamped if shared.clamped is not None else r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        rho_token = shared.rho
    else:
        diff = pi - mu
        # x·0 is 0 for finite x and NaN otherwise: NaN/±inf in either log-prob makes the difference non-finite
        # (every fresh [B, T] temporary costs about as much as the arithmetic on CPU, so the work is done in place)
        mf = float_mask(m)  # = m.float(), via the fast uint8 path (a bool→float cast is ~8× slower on CPU)
        bad = diff * 0.0
        bad = nan_to_num(bad, 1.0, 1.0, 1.0, out=bad)
        vf = torch.addcmul(mf, mf, bad, value=-1.0, out=bad)  # mf·(1 − bad): 1.0 on valid finite tokens
        r = nan_to_num(diff, 0.0, 0.0, 0.0, out=diff).mul_(vf)  # log ρ, exactly 0 at invalid positions
        seq_len = vf.sum(dim=-1)  # [B], exact integers (≤ T)
        sum_r = r.sum(dim=-1)
        r_safe = r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        rho_token = None
    pi_v = nan_to_num(pi, 0.0, 0.0, 0.0).mul_(vf)

    seq_len_i = seq_len.long()
    n_tok_i = seq_len_i.sum()
    n_tok = n_tok_i.float()
    has_tok = n_tok > 0
    n_tok_c = n_tok.clamp(min=1.0)
    seq_ok = seq_len > 0
    seq_len_c = seq_len.clamp(min=1.0)

    one = torch.ones((), dtype=torch.float32, device=pi.device)
    zero0 = torch.zeros((), dtype=torch.float32, device=pi.device)

    # Per-sequence sums, reused by the PPLs, the log-PPL diffs, kl and both χ²_seq.
    sum_pi = pi_v.sum(dim=-1)
    sum_mu = sum_pi - sum_r
    mean_pi = sum_pi / seq_len_c
    mean_mu = sum_mu / seq_len_c
    d = mean_mu - mean_pi  # log PPL_π − log PPL_μ per sequence

    # Token sums from expm1 (accurate for the tiny log-ratios of a well-matched engine, and 0 at invalid positions):
    # Σ_V ρ = Σ em1 + n, Σ_V (ρ² − 1) = Σ em1² + 2 Σ em1, Σ_V k3 = Σ (em1 − r).
    em1 = torch.expm1(r_safe)  # 0 at invalid positions
    flat = em1.reshape(-1)
    sum_em1 = flat.sum()
    sum_em1_sq = torch.dot(flat, flat)
    sum_rho = sum_em1 + n_tok
    sum_rho_sq = sum_em1_sq + 2.0 * sum_em1 + n_tok

    out: dict[str, Tensor] = {}
    out["kl"] = -sum_r.sum() / n_tok_c
    out["k3_kl"] = (em1 - r_safe).sum() / n_tok_c  # Σ (ρ − 1 − log ρ), expm1 keeps small log ρ accurate
    geo = (sum_r / seq_len_c).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    prod = sum_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    train_ppl, train_log_ppl, roll_ppl, roll_log_ppl, diff_mean, abs_diff_mean, ppl_ratio, chi2_seq, chi2_prod = (
        sequence_means(  # E_S of each, in one stacked reduction
            seq_ok, torch.exp(-mean_pi), -mean_pi, torch.exp(-mean_mu), -mean_mu, d, d.abs(),
            torch.exp(d.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)), torch.expm1(2.0 * geo), torch.expm1(2.0 * prod),
        )
    )  # fmt: skip
    out["training_ppl"] = torch.where(has_tok, train_ppl, one)
    out["training_log_ppl"] = train_log_ppl
    out["rollout_ppl"] = torch.where(has_tok, roll_ppl, one)
    out["rollout_log_ppl"] = roll_log_ppl
    out["log_ppl_diff"] = diff_mean
    out["log_ppl_abs_diff"] = abs_diff_mean
    inf = torch.full_like(d, float("inf"))
    out["log_ppl_diff_max"] = torch.where(has_tok, torch.where(seq_ok, d, -inf).amax(), zero0)
    out["log_ppl_diff_min"] = torch.where(has_tok, torch.where(seq_ok, d, inf).amin(), zero0)
    out["ppl_ratio"] = torch.where(has_tok, ppl_ratio, one)
    out["chi2_token"] = (sum_em1_sq + 2.0 * sum_em1) / n_tok_c
    out["chi2_seq"] = chi2_seq
    out["chi2_seq_product"] = chi2_prod

    if weights is None:
        w_sum, w_sq_sum = sum_rho, sum_rho_sq
        clipped = zero0
        masked = zero0
    else:
        w = nan_to_num(weights.detach().float(), 0.0, 0.0, 0.0).mul_(vf)
        if keep is not None:  # = nan_to_num(result.coefficient): dropped tokens weigh 0
            w = w.mul_(keep)
        w_flat = w.reshape(-1)
        w_sum = w_flat.sum()
        w_sq_sum = torch.dot(w_flat, w_flat)
        n_invalid = n_all - n_tok_i  # integer arithmetic: exact at any batch size
        masked = (n_all - torch.count_nonzero(w) - n_invalid).float() / n_tok_c  # w = 0 at invalid positions
        if ratio_free:  # mask-only weights: "truncated or masked" is just masked
            clipped = masked
        else:
            if level == "token":
                # exp, not em1 + 1: em1's absolute rounding (~6e-8) exceeds the 1e-6 relative tolerance below
                # ρ ≈ 0.06, and would count untouched small weights as clipped
                raw = rho_token if rho_token is not None else torch.exp(r_safe)
            else:
                raw_log = sum_r if level == "sequence" else sum_r / seq_len_c
                raw = torch.exp(raw_log.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)).unsqueeze(-1)
            # raw > 0 everywhere and w = 0 at invalid positions, so each invalid position counts as "changed"
            # exactly once: subtract them instead of spending a pass on a mask.
            changed = torch.count_nonzero((w - raw).abs_() > raw * 1e-6) - n_invalid
            clipped = changed.float() / n_tok_c
    w_mean = w_sum / n_tok_c
    # ESS = (E w)² / E[w²] — the same as 1/E[(w/E w)²] but finite when every weight is 0 (then ESS = 0).
    ess = (w_mean * w_mean) / (w_sq_sum / n_tok_c).clamp(min=torch.finfo(torch.float32).tiny)
    out["ess"] = torch.where(has_tok, ess.clamp(max=1.0), one)
    out["is_weight_mean"] = torch.where(has_tok, w_mean, one)
    out["clipped_frac"] = clipped
    out["raw_ratio_mean"] = torch.where(has_tok, sum_rho / n_tok_c, one)
    push = (vf - 1.0).mul_(1.0e4)  # moves invalid positions (log ρ = 0) out of reach of max/min: |log ρ| ≤ 20
    r_max = (r_safe + push).amax()
    r_min = push.neg_().add_(r_safe).amin()
    out["raw_ratio_max"] = torch.where(has_tok, torch.exp(r_max), one)
    out["raw_ratio_min"] = torch.where(has_tok, torch.exp(r_min), one)
    out["masked_frac"] = masked
    out["accepted_frac"] = 1.0 - masked
    out["nonfinite_tokens"] = (torch.count_nonzero(m) - n_tok_i).float()
    return {f"{prefix}{k}": v for k, v in out.items()}

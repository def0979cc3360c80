"""M2PO, second-moment trust policy optimisation (arXiv 2510.01161, Algorithm 1): a batch-level mask that bounds the
second moment of the log importance ratio instead of clipping each token.

With log r_t = log π_θ(y_t) − log μ(y_t) (μ the *rollout* engine that sampled, however stale) and
M2 = Σ_valid (log r_t)² / N over the N valid tokens of the optimiser batch:

1. candidates: tokens in PPO's active trust-region quadrants, A > 0 with r > 1 or A < 0 with r < 1 (the updates that
   push r further from 1); ``quadrants=False`` makes every valid token a candidate (AReaL's code);
2. drop candidates in descending order of (log r)² — the fewest tokens — until the second moment of the tokens left,
   Σ_kept (log r)² / N_kept, is ≤ τ (paper default τ = 0.04); if dropping every candidate is not enough, all are
   dropped;
3. the loss keeps the original valid-token denominator (a correction's dropped token stays in it here anyway).

The selection is made once per call over the whole batch it is given: the reference trainer calls its correction once
per optimiser step on that step's minibatch, so the mask is chosen once per optimiser batch, as in the paper.

Sources and versions: AReaL (``inclusionAI/AReaL``; ``get_m2po_loss_mask`` merged Oct 2025, now
``areal/trainer/ppo/actor.py`` ``_apply_m2po_masking`` / ``_get_m2po_loss_mask`` at commit 4aef98d, 2026-05-21, config
``actor.m2_threshold``) applies the mask per optimiser minibatch before its PPO loss, sorting *all* valid tokens by
(log π_prox − log μ)² — π_prox is the trainer's log-prob at the start of the step, π_old here — and stopping at the
first suffix mean strictly below τ, keeping at least one token.
That version is ``m2po(quadrants=False, source="mismatch")`` (up to ≤ vs < at exact equality and its keep-one rule).
The default follows the paper and the issue text: r from π_θ (detached) over μ, quadrant candidates, M2 ≤ τ.

Metrics: ``m2po/m2_before`` (M2 of the valid tokens), ``m2po/m2_after`` (of the kept ones), ``m2po/candidate_frac``
(candidates / valid), and every correction's ``m2po/masked_frac`` (dropped / valid) … (:func:`~offpolicy.corrections.base.drop_metrics`).

>>> b = LogProbBatch(logp=torch.tensor([[0.0, 0.0, 0.0]]), rollout_logp=torch.tensor([[-1.0, -0.1, 0.1]]),
...                  mask=torch.ones(1, 3), advantages=torch.tensor([1.0]))
>>> r = m2po(threshold=0.04)(b)   # (log r)² = 1, 0.01, 0.01; candidates (A > 0, r > 1): the first two
>>> r.keep, round(r.metrics["m2po/m2_after"].item(), 4)   # dropping the 1 leaves (0.01 + 0.01) / 2
(tensor([[False,  True,  True]]), 0.01)
"""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import Correction, CorrectionResult
from offpolicy.corrections.importance import behaviour_log_ratio, check_threshold
from offpolicy.ratios import count, float_mask, is_finite, zero_outside
from offpolicy.registry import register_correction

DEFAULT_THRESHOLD = 0.04  # τ_M2, the paper's default


def m2po_keep(log_ratio: Tensor, mask: Tensor, candidates: Tensor, threshold: float) -> tuple[Tensor, Tensor, Tensor]:
    """The M2PO selection over one batch: ``(keep, m2_before, m2_after)``.

    Args:
        log_ratio: ``[B, T]`` log r per token (finite where ``mask`` holds).
        mask: ``[B, T]`` bool, the valid tokens (the denominator N of the second moment).
        candidates: ``[B, T]`` bool ⊆ mask, the tokens that may be dropped.
        threshold: τ ≥ 0.

    Returns ``keep`` ``[B, T]`` bool (mask without the dropped tokens) and the 0-d second moments before/after (0 for
    an empty set). Ties in (log r)² are dropped in flat (row-major) order. No host sync: one sort of B·T values.

    >>> lr = torch.tensor([[0.3, -0.2, 0.1]]); m = torch.ones(1, 3, dtype=torch.bool)
    >>> keep, before, after = m2po_keep(lr, m, m, 0.02)   # 0.09, 0.04, 0.01: M2 0.0467 → drop 0.09 → 0.025 → drop 0.04
    >>> keep, round(before.item(), 4), round(after.item(), 4)
    (tensor([[False, False,  True]]), 0.0467, 0.01)
    """
    m2 = zero_outside(log_ratio.detach().float(), mask) ** 2
    n_valid = count(mask).float()
    total = m2.sum()
    flat_m2, flat_cand = m2.reshape(-1), candidates.reshape(-1) & mask.reshape(-1)
    # candidates first, largest (log r)² first; a stable sort keeps flat order among ties
    key = torch.where(flat_cand, flat_m2, torch.full_like(flat_m2, -1.0))
    order = torch.sort(key, descending=True, stable=True).indices
    dropped_m2 = torch.cumsum(torch.where(flat_cand[order], flat_m2[order], 0.0), 0)
    # after dropping j candidates (j = 0 … K): M2_j = (total − Σ_{i ≤ j} c_i) / (N − j)
    j = torch.arange(flat_m2.numel() + 1, device=m2.device, dtype=torch.float32)
    removed = torch.cat([dropped_m2.new_zeros(1), dropped_m2])
    m2_j = (total - removed).clamp(min=0.0) / (n_valid - j).clamp(min=1.0)
    n_candidates = count(flat_cand).float()
    possible = j <= n_candidates
    stop = possible & ((m2_j <= threshold) | (j == n_candidates))
    n_drop = torch.argmax(stop.to(torch.int8))  # the first j that satisfies the bound (or K, all candidates)
    drop_sorted = torch.arange(flat_m2.numel(), device=m2.device) < n_drop
    drop = torch.zeros_like(flat_cand).scatter(0, order, drop_sorted).reshape(mask.shape)
    keep = mask & ~drop
    before = total / n_valid.clamp(min=1.0)
    after = zero_outside(m2, keep).sum() / count(keep).float().clamp(min=1.0)
    return keep, before, after


@register_correction("m2po")
def m2po(threshold: float = DEFAULT_THRESHOLD, quadrants: bool = True, source: str = "total") -> Correction:
    """M2PO's batch-level second-moment mask (see the module docstring): ``threshold`` τ, ``quadrants`` (only tokens in
    PPO's active quadrants may be dropped; False: any valid token, as AReaL), ``source`` ``"total"`` (log π_θ − log μ,
    the paper) or ``"mismatch"`` (log π_old − log μ, AReaL's proximal policy). Needs ``rollout_logp``; tokens with a
    non-finite log-ratio are dropped. A pure mask: weights are the padding mask."""
    tau = check_threshold("threshold", threshold, allow_zero=True)
    if not isinstance(quadrants, bool):
        raise ValueError(f"quadrants must be a bool, got {quadrants!r}")
    behaviour_log_ratio(LogProbBatch(logp=torch.zeros(1, 1), mask=torch.ones(1, 1),
                                     rollout_logp=torch.zeros(1, 1)), source, "m2po")  # validates source

    def apply(batch: LogProbBatch) -> CorrectionResult:
        log_r = behaviour_log_ratio(batch, source, "m2po")
        valid = batch.bool_mask
        defined = valid & is_finite(log_r)
        if quadrants:
            if batch.advantages is None:
                raise ValueError("m2po(quadrants=True) needs batch.advantages (the quadrants use the sign of A)")
            a = batch.token_advantages()
            candidates = defined & (((a > 0) & (log_r > 0)) | ((a < 0) & (log_r < 0)))
        else:
            candidates = defined
        keep, before, after = m2po_keep(zero_outside(log_r, defined), defined, candidates, tau)  # type: ignore[arg-type]
        per_valid = count(valid).float().clamp(min=1.0)
        metrics = {
            "m2po/m2_before": before,
            "m2po/m2_after": after,
            "m2po/candidate_frac": count(candidates).float() / per_valid,
        }
        return CorrectionResult(float_mask(valid), keep, metrics, weight_level=None)

    return Correction("m2po", apply, {"threshold": tau, "quadrants": quadrants, "source": source})

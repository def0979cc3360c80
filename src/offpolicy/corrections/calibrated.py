"""Calibrated importance sampling (arXiv 2609.32444): truncated IS whose cap is tighter for confident tokens.

    w_t = min(ρ_t, c_t),    c_t = 1 + λ · max(1 − p_t, κ)

A token the trainer is sure of (p_t → 1) cannot be corrected much: a large ρ_t there is numerical noise in μ rather than
information, so its cap falls to 1 + λκ; an uncertain token (p_t → 0) keeps the full cap 1 + λ. κ = 5e-3 (the paper's
value) keeps the cap strictly above 1, so a ratio of 1 is never moved.

Choices the paper leaves open, and the ones made here:

* ρ_t is TIS's rollout correction (``source="mismatch"``: ρ_t = π_old(y_t)/μ(y_t), the decoupled-PPO behaviour weight
  that multiplies the PPO term while PPO's own clip handles π_θ/π_old), exactly as :func:`~offpolicy.tis` reads it;
  ``source="total"`` uses π_θ (detached)/μ, verl's bypass mode, as ``tis`` does.
* p_t is the trainer's π_old(y_t) (π_θ detached when the batch has no π_old): the trainer's own confidence, not the
  engine's, since the engine's μ is the number whose noise the cap guards against; detached like every weight.
* λ = 1 by default: the loosest cap, at p_t → 0, is then 2 — TIS's default cap — so ``calibrated_is()`` is ``tis()``
  on uncertain tokens and tighter everywhere else.

A non-finite ρ_t or p_t drops the token (keep False, weight 0), as in TIS. On policy (μ = π_old) every weight is 1.
"""

from __future__ import annotations

import torch

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import Correction, CorrectionResult
from offpolicy.corrections.importance import behaviour_log_ratio, check_source, check_threshold
from offpolicy.ratios import LOG_RATIO_BOUND, count, is_finite, keep_only, min_where, zero_outside
from offpolicy.registry import register_correction

KAPPA = 5e-3  # κ, the paper's floor on 1 − p_t
LAM = 1.0  # λ: the cap at p_t → 0 is 1 + λ = 2, TIS's default


def calibrated_cap(p: torch.Tensor, lam: float = LAM, kappa: float = KAPPA) -> torch.Tensor:
    """The per-token cap c_t = 1 + λ · max(1 − p_t, κ) for probabilities ``p`` ``[B, T]`` (any shape).

    >>> calibrated_cap(torch.tensor([0.0, 0.5, 0.999, 1.0]))
    tensor([2.0000, 1.5000, 1.0050, 1.0050])
    """
    return 1.0 + lam * (1.0 - p).clamp(min=kappa)


@register_correction("calibrated_is")
def calibrated_is(lam: float = LAM, kappa: float = KAPPA, source: str = "mismatch") -> Correction:
    """Calibrated importance sampling, w_t = min(ρ_t, 1 + λ·max(1 − p_t, κ)) (arXiv 2609.32444; module docstring).

    ``lam`` λ > 0, ``kappa`` κ in (0, 1], ``source`` as :func:`~offpolicy.tis`. Needs ``rollout_logp`` μ.

    Metrics (prefix ``calibrated_is/``, over valid tokens): ``raw_ratio_mean`` / ``raw_ratio_max`` (ρ before the cap,
    where defined), ``cap_mean`` (mean c_t), ``weight_mean`` (0 where dropped) and ``nonfinite_frac`` (dropped for a
    non-finite ρ_t or p_t), beside every correction's ``kept_frac`` / ``masked_frac`` / ``capped_frac`` (the tokens
    whose ratio the cap lowered) / ``masked_seq_frac`` (:func:`~offpolicy.corrections.base.drop_metrics`).

    >>> b = LogProbBatch(logp=torch.log(torch.tensor([[0.5, 0.999]])), rollout_logp=torch.log(torch.tensor([[0.2, 0.9]])),
    ...                  mask=torch.ones(1, 2))
    >>> calibrated_is()(b).weights   # ρ = (2.5, 1.11), caps (1.5, 1.005)
    tensor([[1.5000, 1.0050]])
    """
    lam_ = check_threshold("lam", lam)
    kappa_ = check_threshold("kappa", kappa)
    assert lam_ is not None and kappa_ is not None
    if kappa_ > 1.0:
        raise ValueError(f"kappa must be in (0, 1] (a floor on 1 − p), got {kappa!r}")
    check_source(source)

    def apply(batch: LogProbBatch) -> CorrectionResult:
        valid = batch.bool_mask
        log_rho = behaviour_log_ratio(batch, source, "calibrated_is")
        log_p = batch.anchor_logp.detach().float()
        defined = valid & is_finite(log_rho) & is_finite(log_p)
        rho = torch.exp(zero_outside(log_rho, defined).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        p = torch.exp(zero_outside(log_p, defined)).clamp(max=1.0)  # a log-prob > 0 (rounding) is p = 1
        cap = calibrated_cap(p, lam_, kappa_)
        weights = keep_only(torch.minimum(rho, cap), defined)
        n_valid = count(valid)
        n = n_valid.clamp(min=1)
        n_defined = count(defined)
        moved = defined & (rho > cap)
        metrics = {
            "calibrated_is/raw_ratio_mean": keep_only(rho, defined).sum() / n_defined.clamp(min=1),
            "calibrated_is/raw_ratio_max": keep_only(rho, defined).amax(),
            "calibrated_is/raw_ratio_min": min_where(rho, defined),
            "calibrated_is/cap_mean": keep_only(cap, defined).sum() / n_defined.clamp(min=1),
            "calibrated_is/weight_mean": weights.sum() / n,
            "calibrated_is/nonfinite_frac": (n_valid - n_defined) / n,
        }
        return CorrectionResult(weights, defined, metrics, weight_level="token", capped=moved)

    return Correction("calibrated_is", apply, {"lam": lam_, "kappa": kappa_, "source": source})

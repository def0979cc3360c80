"""Calibrated clipping for low-precision rollouts (arXiv 2609.22870): PPO's clip range widened, per batch, to the
spread of the rollout ratio, so that the engine's numerical noise alone does not push a token past a clip bound.

With a low-precision engine (fp8, or W4A4) the sampler's μ differs from the trainer's π_old by noise, and the clipped
ratio sees that noise: with r_t = π_θ/μ, a negative-advantage token whose μ came out a little high sits below
1 − ε before any update and is held by the lower bound — it gets no gradient for reasons that are numerics, not
policy change. Calibrated clipping sets the bounds from the batch's rollout ratio ρ_t = π_old(y_t)/μ(y_t) over the
valid tokens:

    ε_low  = max(ε_low⁰,  1 − Q_q(ρ)),      ε_high = max(ε_high⁰, Q_{1−q}(ρ) − 1)
    L_t    = −min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t),      r_t = π_θ(y_t) / μ(y_t)

(PPO's surrogate, arXiv 1707.06347 eq. 7, with the bounds calibrated), ε⁰ the usual fixed ε (the floor: a well-matched
engine gets plain PPO's range, never a tighter one).

Choices the paper leaves open, and the ones made here:

* the objective, not a correction: the bounds are the PPO clip's, which a correction's weight cannot move;
* the clipped ratio is π_θ/μ (the bypass ratio, where the engine's noise lives); π_θ/π_old carries no rollout noise,
  so widening its range would only loosen PPO. Where the batch has no μ (a host without engine log-probs: TRL with HF
  generate sets μ = π_old) ρ ≡ 1, the bounds are the floor and the loss is ``ppo``'s exactly. A token whose μ is not
  finite falls back to π_old for its own ratio and is left out of the quantiles;
* the quantile levels q = 0.01 / 0.99: at most 1 % of the tokens sit beyond each bound on noise alone before the first
  update. A far tail (q = 0.001) is set by a handful of tokens in a batch of a few thousand and jumps from batch to
  batch; q = 0.05 would leave a twentieth of the batch clipped by noise. The quantiles ignore padding (and
  non-finite ratios), are detached, and take no host sync (a sort; :func:`masked_quantile`);
* one pair of bounds per call of the loss — the optimiser minibatch, the batch the clip acts on;
* no ceiling: on an engine that *lags* the trainer, π_old/μ measures staleness, not rounding noise, and the range
  widens with it (to no clip at all below 1 − ε_low ≤ 0). The method is made for low-precision rollouts of the
  current weights; ``loss/calibrated_widened_*`` shows when it widened.

``loss/clipfrac_low`` / ``loss/clipfrac_high`` are PPO's (the tokens each calibrated bound holds);
``loss/calibrated_widened_low`` / ``_high`` flag every valid token when the batch's bound was widened past the floor,
so they are 1 or 0 per minibatch (their mean over a step's minibatches is the share of minibatches widened).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from offpolicy.objectives.base import TokenInputs, TokenLoss, check_clip_range, check_dual_clip
from offpolicy.ratios import LOG_RATIO_BOUND, count
from offpolicy.registry import register_objective

QUANTILE = 0.01  # q: the lower bound at the q-quantile of ρ, the upper at the (1 − q)-quantile


def masked_quantile(values: Tensor, mask: Tensor, q: float) -> Tensor:
    """The ``q``-quantile (linear interpolation, as :func:`torch.quantile`) of ``values`` where ``mask`` holds; 0-d,
    detached; NaN when nothing is selected (the caller substitutes). No boolean indexing, so no host sync.

    >>> v = torch.tensor([[1.0, 9.0, 2.0], [3.0, 4.0, 5.0]]); m = torch.tensor([[True, False, True], [True, True, False]])
    >>> masked_quantile(v, m, 0.5), masked_quantile(v, m, 0.0), masked_quantile(v, m, 1.0)   # of (1, 2, 3, 4)
    (tensor(2.5000), tensor(1.), tensor(4.))
    """
    flat = torch.where(mask, values.detach().float(), math.inf).reshape(-1)
    ordered = torch.sort(flat).values  # the selected values first, ascending
    n = count(mask).float()
    position = q * (n - 1).clamp(min=0)
    below = position.floor()
    above = position.ceil()
    last = max(flat.numel() - 1, 0)
    lo = ordered.gather(0, below.long().clamp(0, last).reshape(1)).squeeze(0)
    hi = ordered.gather(0, above.long().clamp(0, last).reshape(1)).squeeze(0)
    # lo + (hi − lo)·frac, written so that hi = lo gives lo exactly (no inf − inf)
    value = torch.where(hi > lo, lo + (hi - lo) * (position - below), lo)
    return torch.where(n > 0, value, math.nan)


def calibrated_bounds(rollout_log_ratio: Tensor, mask: Tensor, clip_low: float, clip_high: float,
                      quantile: float = QUANTILE) -> tuple[Tensor, Tensor]:
    """(ε_low, ε_high), 0-d tensors: the floors ``clip_low`` / ``clip_high`` widened to 1 − Q_q(ρ) and Q_{1−q}(ρ) − 1,
    ρ = exp(``rollout_log_ratio``) over ``mask`` (the floors when ``mask`` selects nothing).

    >>> lr = torch.log(torch.tensor([[0.5, 1.0, 1.0, 1.1, 1.4]])); m = torch.ones(1, 5, dtype=torch.bool)
    >>> calibrated_bounds(lr, m, 0.2, 0.2, quantile=0.0)   # the extremes 0.5 and 1.4: ε = (0.5, 0.4)
    (tensor(0.5000), tensor(0.4000))
    """
    log_rho = rollout_log_ratio.detach().float().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    low_q = torch.exp(masked_quantile(log_rho, mask, quantile))  # exp is monotone: the quantile of ρ
    high_q = torch.exp(masked_quantile(log_rho, mask, 1.0 - quantile))
    eps_low = torch.where(torch.isnan(low_q), clip_low, torch.clamp(1.0 - low_q, min=clip_low))
    eps_high = torch.where(torch.isnan(high_q), clip_high, torch.clamp(high_q - 1.0, min=clip_high))
    return eps_low, eps_high


def _check_quantile(quantile: object) -> float:
    if isinstance(quantile, bool) or not isinstance(quantile, (int, float)) or not 0.0 <= quantile < 0.5:
        raise ValueError(f"quantile must be a number in [0, 0.5) (the lower tail level q), got {quantile!r}")
    return float(quantile)


@register_objective("calibrated_clip", reads=("old_logp",))
def calibrated_clip(x: TokenInputs, *, clip_low: float = 0.2, clip_high: float | None = None,
                    dual_clip: float | None = None, quantile: float = QUANTILE) -> TokenLoss:
    """PPO-clip on r = π_θ/μ with ε_low, ε_high calibrated from the batch's π_old/μ quantiles (module docstring).

    ``clip_low`` / ``clip_high`` are the floors ε⁰ (``clip_high`` None: ``clip_low``), ``quantile`` q ∈ [0, 0.5),
    ``dual_clip`` as ``ppo``'s. μ is optional: without it (or where it is not finite) the ratio is π_θ/π_old.
    """
    floor_low, floor_high = check_clip_range(clip_low, clip_high)
    c = check_dual_clip(dual_clip)
    q = _check_quantile(quantile)
    mu = x.rollout_logp if x.rollout_logp is not None else x.old_logp
    has_mu = x.valid & (x.rollout_finite if x.rollout_finite is not None else True)
    denominator = torch.where(has_mu, mu, x.old_logp)  # 0 wherever a token does not count (the inputs are clean)
    rollout_log_ratio = torch.where(has_mu, x.old_logp - denominator, 0.0)
    eps_low, eps_high = calibrated_bounds(rollout_log_ratio, has_mu, floor_low, floor_high, q)

    log_ratio = x.logp - denominator
    a = x.advantages
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    loss = -torch.minimum(ratio * a, torch.clamp(ratio, min=1.0 - eps_low, max=1.0 + eps_high) * a)
    if c is not None:
        loss = torch.where(a < 0, torch.minimum(loss, c * a.abs()), loss)

    log_r = log_ratio.detach()
    r = ratio.detach()
    held_low = (log_r < -LOG_RATIO_BOUND) | ((a < 0) & (r < 1.0 - eps_low))
    held_dual = (a < 0) & (log_r > min(math.log(c), LOG_RATIO_BOUND)) if c is not None else torch.zeros_like(held_low)
    held_high = ((log_r > LOG_RATIO_BOUND) | ((a > 0) & (r > 1.0 + eps_high))) & ~held_dual
    widened_low = x.valid & (eps_low > floor_low)
    widened_high = x.valid & (eps_high > floor_high)
    clipped = {"clipfrac_low": held_low, "clipfrac_high": held_high, "dual_clip_frac": held_dual,
               "calibrated_widened_low": widened_low, "calibrated_widened_high": widened_high}
    return TokenLoss(loss, log_ratio, clipped)

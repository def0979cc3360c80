"""The PPO family: one clipped surrogate on four ratios (PPO, decoupled PPO, bypass, GSPO).

    L_t = −min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t)                   (arXiv 1707.06347, eq. 7)

with ε_high > ε_low being DAPO's clip-higher (arXiv 2503.14476, eq. 10) and the dual clip c > 1 bounding the loss of a
negative-advantage token, L_t = min(L_t, c·|A_t|) (arXiv 1912.09729, eq. 5). The log-ratio is clamped to ±20 before
``exp`` (verl's bound), so a ratio beyond e^±20 is held there like a clipped one: no gradient, counted as clipped.

* ``ppo``        r = π_θ/π_old.
* ``decoupled``  PPO with the behaviour weight π_old/μ in front (arXiv 2110.00641, eq. 5): with a correction, the
                 correction *is* that weight (use ``tis``/``mis``/``icepop``: the raw weight has unbounded variance), so
                 this equals ``ppo`` + the correction; without one, the raw detached exp(log π_old − log μ) applies.
                 ``proximal="loglinear"``: π_old from AReaL's version interpolation instead of a forward
                 (:mod:`offpolicy.objectives.proximal`).
* ``bypass``     r = π_θ/μ directly, no π_old forward (ALP's unified ratio, arXiv 2603.19470, eq. 2).
* ``gspo``       the geometric sequence ratio with a per-token gradient, GSPO-token (arXiv 2507.18071); the paper clips
                 at ε ≈ 3e-4 / 4e-4 (pass them as ``clip_low`` / ``clip_high``).

``level`` (``token`` | ``sequence`` | ``geometric``) generalises the ratio of ``ppo`` / ``decoupled`` / ``bypass`` the way
GSPO does (:meth:`TokenInputs.log_ratio`): ``gspo`` is ``ppo`` at ``level="geometric"``, ALP's sequence objective
(arXiv 2603.19470, eq. 3) is ``bypass`` at ``level="sequence"``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from offpolicy.objectives.base import TokenInputs, TokenLoss, check_clip_range, check_dual_clip, check_level
from offpolicy.objectives.proximal import check_proximal
from offpolicy.ratios import LOG_RATIO_BOUND
from offpolicy.registry import register_objective


def clipped_surrogate(
    x: TokenInputs, log_ratio: Tensor, clip_low: float, clip_high: float | None, dual_clip: float | None
) -> TokenLoss:
    """PPO's per-token loss on ``log_ratio`` [B, T] (see the module docstring) and the tokens each bound holds.

    ``clipfrac_low``: held from below — A < 0 and r < 1 − ε_low, or r < e^−20; ``clipfrac_high``: held from above other
    than by the dual clip — A > 0 and r > 1 + ε_high, or r > e^20; ``dual_clip_frac``: A < 0 and r > c. Each held
    token has no gradient.

    >>> x = TokenInputs(logp=torch.zeros(1, 2), old_logp=torch.zeros(1, 2), rollout_logp=None,
    ...                 advantages=torch.tensor([[1.0, -1.0]]), valid=torch.ones(1, 2, dtype=torch.bool))
    >>> out = clipped_surrogate(x, torch.log(torch.tensor([[1.5, 0.5]])), 0.2, None, None)
    >>> out.loss   # −min(1.5, 1.2) = −1.2;  −min(−0.5, −0.8) = 0.8
    tensor([[-1.2000,  0.8000]])
    """
    eps_low, eps_high = check_clip_range(clip_low, clip_high)
    c = check_dual_clip(dual_clip)
    a = x.advantages
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    loss = -torch.minimum(ratio * a, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * a)
    if c is not None:
        loss = torch.where(a < 0, torch.minimum(loss, c * a.abs()), loss)

    log_r = log_ratio.detach()
    held_low = log_r < -LOG_RATIO_BOUND
    if eps_low < 1.0:  # ε_low ≥ 1 puts the lower bound at r ≤ 0: nothing to hold
        held_low = held_low | ((a < 0) & (log_r < math.log(1.0 - eps_low)))
    if c is not None:
        held_dual = (a < 0) & (log_r > min(math.log(c), LOG_RATIO_BOUND))
    else:
        held_dual = torch.zeros_like(held_low)
    held_high = ((log_r > LOG_RATIO_BOUND) | ((a > 0) & (log_r > math.log1p(eps_high)))) & ~held_dual
    return TokenLoss(loss, log_ratio, {"clipfrac_low": held_low, "clipfrac_high": held_high, "dual_clip_frac": held_dual})


@register_objective("ppo", reads=("old_logp",))
def ppo(x: TokenInputs, *, clip_low: float = 0.2, clip_high: float | None = None, dual_clip: float | None = None,
        level: str = "token") -> TokenLoss:
    """PPO-clip on r = π_θ/π_old at ``level``."""
    return clipped_surrogate(x, x.log_ratio(x.old_logp, check_level(level)), clip_low, clip_high, dual_clip)


def _decoupled_reads(corrected: bool) -> tuple[str, ...]:
    return ("old_logp",) if corrected else ("old_logp", "rollout_logp")


@register_objective("decoupled", reads=_decoupled_reads)
def decoupled(x: TokenInputs, *, clip_low: float = 0.2, clip_high: float | None = None,
              dual_clip: float | None = None, level: str = "token", proximal: str = "recompute") -> TokenLoss:
    """Decoupled PPO: (π_old/μ) · PPO term; the correction supplies π_old/μ when there is one.

    ``proximal``: ``"recompute"`` — π_old is the batch's ``old_logp`` (the trainer's forward); ``"loglinear"`` —
    AReaL's approximation from the batch's policy versions, no forward (:mod:`offpolicy.objectives.proximal`):
    :func:`offpolicy.policy_loss` puts it in ``old_logp`` before the correction reads it.
    """
    check_proximal(proximal)
    out = clipped_surrogate(x, x.log_ratio(x.old_logp, check_level(level)), clip_low, clip_high, dual_clip)
    if x.corrected:
        return out
    behaviour_weight = torch.exp((x.old_logp - x.rollout_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))  # type: ignore[operator]
    return TokenLoss(out.loss * behaviour_weight, out.log_ratio, out.clipped)


@register_objective("bypass", reads=("rollout_logp",))
def bypass(x: TokenInputs, *, clip_low: float = 0.2, clip_high: float | None = None, dual_clip: float | None = None,
           level: str = "token") -> TokenLoss:
    """PPO-clip on r = π_θ/μ at ``level`` (no π_old)."""
    return clipped_surrogate(x, x.log_ratio(x.rollout_logp, check_level(level)), clip_low, clip_high, dual_clip)  # type: ignore[arg-type]


@register_objective("gspo", reads=("old_logp",))
def gspo(x: TokenInputs, *, clip_low: float = 0.2, clip_high: float | None = None, dual_clip: float | None = None,
         level: str = "geometric") -> TokenLoss:
    """GSPO-token: PPO-clip on the geometric sequence ratio (``level`` is always ``geometric``)."""
    if level != "geometric":
        raise ValueError(f"level={level!r} contradicts objective='gspo' (GSPO is the geometric ratio); use objective='ppo'")
    return clipped_surrogate(x, x.log_ratio(x.old_logp, "geometric"), clip_low, clip_high, dual_clip)

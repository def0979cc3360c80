"""SAPO, soft adaptive policy optimisation (arXiv 2511.20347): a smooth gate on the ratio instead of a hard clip.

    L_t = −f_τ(r_t) · A_t,    f_τ(r) = (4/τ) · σ(τ (r − 1)),    τ = τ_pos if A_t > 0 else τ_neg,    r_t = π_θ/π_old

At r = 1 the gate has value 2/τ and slope 1, so the gradient there is PPO's −A·∇r; away from 1 it decays smoothly
instead of dropping to 0 at a clip boundary. τ_neg > τ_pos makes the gate on negative-advantage tokens decay faster.
The same loss as verl's ``sapo`` (``tau_pos`` / ``tau_neg``) and TRL's ``loss_type="sapo"``
(``sapo_temperature_pos`` / ``_neg``); both default to τ_pos = 1.0, τ_neg = 1.05.
"""

from __future__ import annotations

import torch

from offpolicy.objectives.base import TokenInputs, TokenLoss, check_positive
from offpolicy.ratios import LOG_RATIO_BOUND
from offpolicy.registry import register_objective


@register_objective("sapo", reads=("old_logp",))
def sapo(x: TokenInputs, *, tau_pos: float = 1.0, tau_neg: float = 1.05) -> TokenLoss:
    """SAPO's gated loss (no token is clipped: the gate only shrinks its gradient)."""
    tau_pos, tau_neg = check_positive("tau_pos", tau_pos), check_positive("tau_neg", tau_neg)
    log_ratio = x.log_ratio(x.old_logp)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    tau = torch.where(x.advantages > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return TokenLoss(-gate * x.advantages, log_ratio)

"""CISPO, clipped importance-sampling-weight policy optimisation (MiniMax-M1, arXiv 2506.13585, §3.1).

    L_t = −sg[clip(r_t, 1 − ε_low, 1 + ε_high)] · A_t · log π_θ(y_t),    r_t = π_θ/π_old

PPO clips the token's *update* (a clipped token has no gradient); CISPO clips only the importance *weight*, so every
token keeps its score-function gradient, scaled by at most 1 + ε_high. MiniMax set no lower bound in practice: pass
``clip_low=1.0`` (r ≥ 0, so 1 − ε_low ≤ 0 never binds). The same loss as verl's ``cispo`` (clip_ratio_low / high) and
TRL's ``loss_type="cispo"`` (``epsilon_high`` is TRL's absolute cap: ``clip_high = epsilon_high − 1``, ``clip_low = 1``).
"""

from __future__ import annotations

import torch

from offpolicy.objectives.base import TokenInputs, TokenLoss, check_clip_range, check_level
from offpolicy.ratios import LOG_RATIO_BOUND
from offpolicy.registry import register_objective


@register_objective("cispo", reads=("old_logp",))
def cispo(x: TokenInputs, *, clip_low: float = 0.2, clip_high: float | None = None, level: str = "token") -> TokenLoss:
    """CISPO's loss; ``level`` as in :meth:`TokenInputs.log_ratio` (TRL's sequence level is ``geometric``).

    ``clipfrac_low`` / ``clipfrac_high``: tokens whose weight the clip moved up / down (they keep their gradient).
    """
    eps_low, eps_high = check_clip_range(clip_low, clip_high)
    log_ratio = x.log_ratio(x.old_logp, check_level(level)).detach()
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    weight = ratio.clamp(min=1.0 - eps_low, max=1.0 + eps_high)
    clipped = {"clipfrac_low": ratio < 1.0 - eps_low, "clipfrac_high": ratio > 1.0 + eps_high}
    return TokenLoss(-weight * x.advantages * x.logp, log_ratio, clipped)

"""REINFORCE: L_t = −A_t · log π_θ(y_t) (Williams 1992; the correction's weight multiplies it, as for every objective).

There is no ratio in the loss; the ``loss/ratio_*`` metrics report π_θ/π_old.
"""

from __future__ import annotations

from offpolicy.objectives.base import TokenInputs, TokenLoss
from offpolicy.registry import register_objective


@register_objective("reinforce", reads=())
def reinforce(x: TokenInputs) -> TokenLoss:
    """The score-function loss −A · log π_θ."""
    return TokenLoss(-x.advantages * x.logp, x.log_ratio(x.old_logp).detach())

"""IPO, prime-rl's ``ipo`` loss type: a trust region on the probability difference of the sampled token whose mask does
not depend on the advantage's sign, plus the Kimi-K2.5 squared log-ratio penalty (arXiv 2602.02276).

With r = π_θ(y_t)/μ(y_t) (μ the *rollout* engine: prime-rl has no separate π_old forward) and p = π_θ(y_t),
p_μ = μ(y_t):

    L_t = −A_t · r_t · 1[|p − p_μ| ≤ δ] + τ_kl · (log r_t)²

The policy-gradient term's gradient is −A·r·∇log π_θ (the ratio is not detached and not clipped: a masked token has
none); the penalty applies to every valid token, masked or not, and pulls π_θ back toward μ. Unlike DPPO-Binary-TV
(``dppo_tv``), a token outside the band is masked whichever way the advantage pushes it.

Version implemented: ``ipo_loss_fn`` in prime-rl's ``src/prime_rl/trainer/rl/loss.py`` at commit
``559b44772e471d1538537b8805cc77f3824a5e64`` (2026-08-21), with ``IPOLossConfig`` defaults ``ipo_threshold`` 0.1,
``kl_tau`` 1e-3, ``adv_tau`` 1 (packages/prime-rl-configs). The issue text reports later defaults (δ = 0.3, τ_kl = 0,
prime-rl PRs #3418 / #3586) that are not in the stored code; pass ``threshold=0.3, kl_tau=0.0`` for those.
prime-rl sums the per-token loss and divides by the batch's token count: ``aggregation="token_mean"`` here.

=============  ==========================  =====================
offpolicy      prime-rl ``[trainer.loss]``  default
=============  ==========================  =====================
``threshold``  ``ipo_threshold``           0.1
``kl_tau``     ``kl_tau``                  1e-3
``adv_tau``    ``adv_tau``                 1.0
=============  ==========================  =====================
"""

from __future__ import annotations

import torch

from offpolicy.objectives.base import TokenInputs, TokenLoss, check_nonnegative
from offpolicy.ratios import LOG_RATIO_BOUND
from offpolicy.registry import register_objective


@register_objective("ipo", reads=("rollout_logp",))
def ipo(x: TokenInputs, *, threshold: float = 0.1, kl_tau: float = 1e-3, adv_tau: float = 1.0) -> TokenLoss:
    """prime-rl's IPO per-token loss (see the module docstring); ``loss/ipo_masked``: tokens with |p − p_μ| > δ.

    >>> x = TokenInputs(logp=torch.log(torch.tensor([[0.5, 0.9]])), old_logp=torch.zeros(1, 2),
    ...                 rollout_logp=torch.log(torch.tensor([[0.45, 0.5]])), advantages=torch.tensor([[1.0, -1.0]]),
    ...                 valid=torch.ones(1, 2, dtype=torch.bool))
    >>> out = ipo(x, kl_tau=0.0)   # |0.5 − 0.45| ≤ 0.1: −1 · 0.5/0.45;  |0.9 − 0.5| = 0.4 > 0.1: masked
    >>> out.loss, out.clipped["ipo_masked"]
    (tensor([[-1.1111,  0.0000]]), tensor([[False,  True]]))
    """
    delta = check_nonnegative("threshold", threshold)
    tau = check_nonnegative("kl_tau", kl_tau)
    scale = check_nonnegative("adv_tau", adv_tau)
    log_ratio = x.log_ratio(x.rollout_logp)  # type: ignore[arg-type]
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    outside = (torch.exp(x.logp.detach()) - torch.exp(x.rollout_logp)).abs() > delta  # type: ignore[arg-type]
    loss = -(scale * x.advantages) * ratio * (~outside) + tau * log_ratio**2
    return TokenLoss(loss, log_ratio, {"ipo_masked": outside})

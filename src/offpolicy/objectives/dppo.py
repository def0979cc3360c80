"""DPPO, divergence proximal policy optimisation (arXiv 2602.04879): a trust region on an estimate of the policy
divergence per token instead of PPO's ratio clip, with the binary approximation of the divergence (its §4).

    L_t = −A_t · sg[min(r_t, C)] · log π_θ(y_t) · 1[token inside the trust region],    r_t = π_θ/π_old

The binary approximation compares the two-outcome distributions (y_t, not y_t) of π_θ and π_old: with p = π_θ(y_t),
p_old = π_old(y_t),

* ``dppo_tv``: D = p − p_old (signed TV); a token with A > 0 is inside iff D ≤ δ_high, with A ≤ 0 iff D ≥ −δ_low;
* ``dppo_kl``: D = p_old log(p_old/p) + (1 − p_old) log((1 − p_old)/(1 − p)); with A > 0 inside iff D ≤ δ_high or
  p ≤ p_old (the update moves away from the bound), with A ≤ 0 iff D ≤ δ_low or p ≥ p_old.

An outside token is masked — no gradient — only when the update pushes it further out, as PPO's clip does. C
(``ratio_cap``) truncates the importance weight (the paper's §5.4 recommends a large one; None = no cap beyond the
library's e^20). Defaults are the authors' run script: δ = 0.15 (TV), δ = 0.05 (KL), no cap. The same losses as verl's
``dppo_tv`` / ``dppo_kl`` (``clip_ratio_low`` / ``high`` = δ, ``clip_ratio_c`` = C).

The binary KL is :func:`offpolicy.binary.bernoulli_kl`: exact to float32's relative accuracy and ≥ 0 for nearby
policies, where verl's textbook form cancels to ±6e-8 (negative on 13 of 65 pairs with |Δ log p| ≤ 1e-6 in
``benchmarks/binary_kl_roundoff.py``). Where verl adds 1e-8 inside its second log against log 0 at p = 1, the
probabilities are clamped at 1 − 1e-8 here (a clamp keeps it a KL, ≥ 0; the additive guard does not); the two agree
to float32 precision wherever 1 − p ≫ 1e-8.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from offpolicy.binary import bernoulli_kl, bernoulli_tv
from offpolicy.objectives.base import TokenInputs, TokenLoss, check_nonnegative, check_positive
from offpolicy.ratios import LOG_RATIO_BOUND
from offpolicy.registry import register_objective

BINARY_KL_EPS = 1e-8  # probabilities are clamped at 1 − 1e-8 (verl guards log(0) at p = 1 with +1e-8 instead)


def binary_tv(logp: Tensor, old_logp: Tensor) -> Tensor:
    """p − p_old, the signed total variation between the binary distributions (p, 1 − p) and (p_old, 1 − p_old), from
    the log-probs of the sampled token (float32, as p_old·expm1(log p − log p_old): no cancellation).

    >>> binary_tv(torch.tensor(0.6).log(), torch.tensor(0.5).log())
    tensor(0.1000)
    """
    return bernoulli_tv(old_logp, logp)


def binary_kl(logp: Tensor, old_logp: Tensor) -> Tensor:
    """KL((p_old, 1 − p_old) ‖ (p, 1 − p)) from the log-probs of the sampled token, float32, ≥ 0
    (:func:`offpolicy.binary.bernoulli_kl` with both probabilities at most 1 − 1e-8).

    >>> round(binary_kl(torch.tensor(0.5).log(), torch.tensor(0.25).log()).item(), 6)  # 0.25 log 0.5 + 0.75 log 1.5
    0.130812
    """
    return bernoulli_kl(old_logp, logp, max_prob=1.0 - BINARY_KL_EPS)


def _dppo(x: TokenInputs, inside: Callable[[Tensor, Tensor, Tensor], Tensor], ratio_cap: float | None) -> TokenLoss:
    log_ratio = x.log_ratio(x.old_logp).detach()
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    weight = ratio if ratio_cap is None else ratio.clamp(max=ratio_cap)
    positive = x.advantages > 0
    kept = inside(x.logp.detach(), x.old_logp, positive)
    loss = -x.advantages * weight * x.logp * kept
    clipped = {"clipfrac_high": positive & ~kept, "clipfrac_low": ~positive & ~kept}
    if ratio_cap is not None:
        clipped["ratio_capped_frac"] = kept & (ratio > ratio_cap)
    return TokenLoss(loss, log_ratio, clipped)


def _thresholds(delta_low: float, delta_high: float | None, ratio_cap: float | None) -> tuple[float, float, float | None]:
    low = check_nonnegative("delta_low", delta_low)
    high = low if delta_high is None else check_nonnegative("delta_high", delta_high)
    return low, high, None if ratio_cap is None else check_positive("ratio_cap", ratio_cap)


@register_objective("dppo_tv", reads=("old_logp",))
def dppo_tv(x: TokenInputs, *, delta_low: float = 0.15, delta_high: float | None = None,
            ratio_cap: float | None = None) -> TokenLoss:
    """DPPO-Binary-TV (see the module docstring); ``clipfrac_high`` / ``_low``: A > 0 / A ≤ 0 tokens masked."""
    low, high, cap = _thresholds(delta_low, delta_high, ratio_cap)

    def inside(logp: Tensor, old_logp: Tensor, positive: Tensor) -> Tensor:
        tv = binary_tv(logp, old_logp)
        return torch.where(positive, tv <= high, tv >= -low)

    return _dppo(x, inside, cap)


@register_objective("dppo_kl", reads=("old_logp",))
def dppo_kl(x: TokenInputs, *, delta_low: float = 0.05, delta_high: float | None = None,
            ratio_cap: float | None = None) -> TokenLoss:
    """DPPO-Binary-KL (see the module docstring)."""
    low, high, cap = _thresholds(delta_low, delta_high, ratio_cap)

    def inside(logp: Tensor, old_logp: Tensor, positive: Tensor) -> Tensor:
        kl = binary_kl(logp, old_logp)
        return torch.where(positive, (kl <= high) | (logp <= old_logp), (kl <= low) | (logp >= old_logp))

    return _dppo(x, inside, cap)

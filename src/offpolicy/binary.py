"""Binary divergences of the sampled token: KL and TV between the two-outcome distributions (y, not y).

Given only the log-probabilities a = log q(y) and b = log p(y) that two policies give the sampled token y, the
divergence of the binary distributions (q, 1 − q) and (p, 1 − p) is a per-token trust-region statistic that needs no
logits: DPPO's binary KL / TV (arXiv 2602.04879 §4) and the divergence gates of OpenRLHF's importance-sampling
correction (``is_correction_gating=binary_kl|tv``, openrlhf 0.11.2) both use it.

**Round-off.** The textbook form ``q·log(q/p) + (1 − q)·log((1 − q)/(1 − p))`` is a difference of two O(|a − b|)
terms whose result is O((a − b)²): in float32 nearby policies (|a − b| ≈ 1e-6) give values of ±1e-7 where the exact
KL is ~1e-13, negative half the time (OpenRLHF's PR #1354 found ≈ −4.5e-8, which their ``[0, δ]`` gate rejected).
:func:`bernoulli_kl` writes the same number as a sum of two terms that are each ≥ 0 and computed without
cancellation. With d = a − b = log(q/p), u = (q − p)/(1 − q) = −q·expm1(−d)/(1 − q):

    KL(q ‖ p) = q·h(−d) + (1 − q)·g(u),    h(x) = eˣ − 1 − x ≥ 0,    g(u) = u − log(1 + u) ≥ 0

(expand: q·h(−d) = p − q + q·d and (1 − q)·g(u) = q − p + (1 − q)·log((1 − q)/(1 − p)); 1 − q and 1 − p are
−expm1 of each log-prob, and log(1 + u) is log1p(u), or log((1 − p)/(1 − q)) where u is near −1). Near 0, h and g come from their Taylor series, so the result has
float32's *relative* accuracy even at 1e-13, and it is ≥ 0 by construction — not by a clamp.

Probabilities can be clamped into [``min_prob``, ``max_prob``] first (OpenRLHF clamps both policies into [1e-6,
1 − 1e-6]; DPPO here clamps at 1 − 1e-8, where verl adds 1e-8 inside its second log instead). A clamp keeps the
result the exact KL of two clamped Bernoulli distributions, hence ≥ 0; an additive guard does not (verl's
``(1 − q + ε)/(1 − p + ε)`` is negative in exact arithmetic for p > q near 1: −4.5e-10 at q = 1 − 1e-9, p = 1 − 5e-10).

Inputs are any float dtype (bf16 included) and are computed in float32; outputs are float32 of the broadcast shape.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from offpolicy.ratios import LOG_RATIO_BOUND

# |x| below which h(x) = eˣ − 1 − x and g(u) = u − log(1 + u) come from their series (the float32 difference would
# lose ~ 2 / |x| ulps); the truncated terms are below 1e-8 relative at the edges.
_H_SERIES = 0.25
_G_SERIES = 0.05


def _check_prob(name: str, value: object, *, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= float(value) <= high:
        raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def expm1_minus_x(x: Tensor) -> Tensor:
    """h(x) = eˣ − 1 − x ≥ 0 (float32), from its Taylor series for |x| < 0.25, so that small x keeps its relative
    accuracy (x²/2 at 1e-6 is 5e-13; ``expm1(x) − x`` gives it to ±1e-13).

    >>> expm1_minus_x(torch.tensor([0.0, 1e-6, 1.0]))   # 0; x²/2 = 5e-13; e − 2 = 0.7183
    tensor([0.0000e+00, 5.0000e-13, 7.1828e-01])
    """
    x = x.float()
    series = x * x * (0.5 + x * (1 / 6 + x * (1 / 24 + x * (1 / 120 + x * (1 / 720 + x / 5040)))))
    return torch.where(x.abs() < _H_SERIES, series, torch.expm1(x) - x)


def _u_minus_log1p_u(u: Tensor, log1p_u: Tensor) -> Tensor:
    """g(u) = u − log(1 + u) ≥ 0, with log(1 + u) given (computed without forming 1 + u); series for |u| < 0.05."""
    series = u * u * (0.5 + u * (-1 / 3 + u * (0.25 + u * (-0.2 + u * (1 / 6 + u * (-1 / 7 + u / 8))))))
    return torch.where(u.abs() < _G_SERIES, series, u - log1p_u)  # the caller uses the series branch only


def bernoulli_kl(log_q: Tensor, log_p: Tensor, *, min_prob: float = 0.0, max_prob: float = 1.0) -> Tensor:
    """KL((q, 1 − q) ‖ (p, 1 − p)) from a = ``log_q``, b = ``log_p`` (the sampled token's log-probabilities), any
    matching shapes; float32, ≥ 0 everywhere (module docstring for the form and its accuracy).

    ``min_prob`` / ``max_prob`` clamp both probabilities first (in log space: log q ∈ [log min_prob, log max_prob]).
    Without a clamp, p = 1 with q < 1 gives +inf (the exact value); q = 0 gives −log(1 − p).

    >>> kl = bernoulli_kl(torch.tensor(0.25).log(), torch.tensor(0.5).log())
    >>> round(kl.item(), 6)   # 0.25·log(0.25/0.5) + 0.75·log(0.75/0.5) = −0.173287 + 0.304099
    0.130812
    >>> bernoulli_kl(torch.tensor(-1e-6), torch.tensor(-2e-6)).item() >= 0   # nearby, near p = 1
    True
    """
    lo = _check_prob("min_prob", min_prob, low=0.0, high=0.5)
    hi = _check_prob("max_prob", max_prob, low=0.5, high=1.0)
    a, b = log_q.float(), log_p.float()
    if lo > 0.0 or hi < 1.0:  # log bounds in float64, then one float32 clamp (log1p keeps 1 − 1e-8 exact)
        lower = math.log(lo) if lo > 0.0 else -math.inf
        upper = math.log1p(-(1.0 - hi)) if hi < 1.0 else 0.0
        a, b = a.clamp(lower, upper), b.clamp(lower, upper)
    d = a - b  # log(q/p)
    q, p = torch.exp(a), torch.exp(b)
    one_minus_q, one_minus_p = -torch.expm1(a), -torch.expm1(b)
    # q·h(−d) = q·(p/q − 1 + log(q/p)) = p − q + q·log(q/p); written out once p/q > e^20 (h would overflow, and p − q
    # then dominates: nothing cancels)
    term_q = torch.where(d > -LOG_RATIO_BOUND, q * expm1_minus_x(-d), (p - q) + q * d)
    q_minus_p = torch.where(d.abs() < 1.0, -q * torch.expm1(-d), q - p)  # q·(1 − e^−d), exact for nearby policies
    u = q_minus_p / one_minus_q  # (q − p)/(1 − q); overflows to ±inf only when 1 − q is denormal
    # log(1 + u) = log((1 − p)/(1 − q)): log1p of the accurate u for |u| < 1, else the difference of the two accurate
    # complements' logs (near u = −1 the rounding of u could cross −1; for a large u, 1 + u may overflow)
    log1p_u = torch.where((u > -0.5) & (u < 1.0), torch.log1p(u), torch.log(one_minus_p) - torch.log(one_minus_q))
    # (1 − q)·g(u) = (q − p) − (1 − q)·log(1 + u): from the series near u = 0, else written out (finite for any u)
    term_rest = torch.where(u.abs() < _G_SERIES, one_minus_q * _u_minus_log1p_u(u, log1p_u),
                            q_minus_p - one_minus_q * log1p_u)
    # q = 1 (a = 0, no clamp): the second term's limit is q − p = 1 − p; q = 0 (a = −inf): KL = −log(1 − p)
    term_rest = torch.where(one_minus_q > 0, term_rest, one_minus_p)
    kl = torch.where(q > 0, term_q + term_rest, -torch.log(one_minus_p))
    return kl


def bernoulli_tv(log_q: Tensor, log_p: Tensor, *, min_prob: float = 0.0, max_prob: float = 1.0) -> Tensor:
    """p − q, the signed total variation between (q, 1 − q) and (p, 1 − p), float32, computed as q·expm1(b − a) so
    that nearby policies keep their relative accuracy (|p − q| = q·|b − a| to first order). Probabilities clamped as in
    :func:`bernoulli_kl`; take ``.abs()`` for the distance.

    >>> bernoulli_tv(torch.tensor(0.5).log(), torch.tensor(0.6).log())   # 0.6 − 0.5
    tensor(0.1000)
    """
    lo = _check_prob("min_prob", min_prob, low=0.0, high=0.5)
    hi = _check_prob("max_prob", max_prob, low=0.5, high=1.0)
    a, b = log_q.float(), log_p.float()
    if lo > 0.0 or hi < 1.0:
        lower = math.log(lo) if lo > 0.0 else -math.inf
        upper = math.log1p(-(1.0 - hi)) if hi < 1.0 else 0.0
        a, b = a.clamp(lower, upper), b.clamp(lower, upper)
    q, p = torch.exp(a), torch.exp(b)
    return torch.where((b - a).abs() < 1.0, q * torch.expm1(b - a), p - q)  # q·(e^(b−a) − 1): no cancellation

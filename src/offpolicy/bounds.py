"""Closed-form bounds: TRM surrogate-error bounds, the DVP bias bound and the DVP mismatch envelope.

These are scalar formulas for reports and threshold choice, not hot-path code: they take Python numbers (or, for
the adaptive bound and the envelope, tensors) and return Python floats / tensors.

Trust Region Masking (arXiv 2512.23075). Bounds on |J(π_θ) − J(π_roll) − L(π_θ)| for rewards in [0, 1],
with T the horizon, δ = max token KL, ε = max token TV, sums over t = 1..T:

==========================  ====================================================================
key                         formula
==========================  ====================================================================
``classical_kl``            T (T − 1) δ
``classical_tv``            2 T (T − 1) ε²
``pinsker_marginal_kl``     4 min(1, √(δ/2)) Σ_t min(1, √((t − 1) δ / 2))
``pinsker_marginal_tv``     4 min(1, ε) Σ_t min(1, √((t − 1) δ / 2))
``mixed_kl``                4 T min(1, √(δ/2)) min(1, √(D_KL^seq / 2))        (needs ``kl_seq``)
``mixed_tv``                4 T min(1, ε) min(1, D_TV^seq)                     (needs ``tv_seq``)
``coupling``                4 min(1, ε) Σ_t min(1, (t − 1) ε)
``adaptive``                4 Σ_t D̄_t min(1, (T − t) ε, √((T − t) δ / 2))     (needs ``dbar`` [T])
``unified``                 B* = min of the above that could be computed
==========================  ====================================================================

When ``eps`` is not given, ε = min(1, √(δ/2)) is used (Pinsker: max token TV ≤ √(max token KL / 2)), so the ε
forms are still valid, only looser.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def _check_nonneg(name: str, x: float | None) -> None:
    if x is not None and not (isinstance(x, (int, float)) and math.isfinite(x) and x >= 0):
        raise ValueError(f"{name} must be a finite number ≥ 0, got {x!r}")


def trm_bounds(T: int, *, delta: float, eps: float | None = None, kl_seq: float | None = None,
               tv_seq: float | None = None, dbar: Tensor | Sequence[float] | None = None) -> dict[str, float]:
    """All TRM bounds computable from what is given, plus ``unified`` = B* (their minimum); see the module table.

    ``T`` horizon (≥ 1), ``delta`` max token KL D_tok,max, ``eps`` max token TV, ``kl_seq`` / ``tv_seq`` the
    sequence-level divergences, ``dbar`` [T] mean token TV at each position t = 1..T. Arithmetic in float64.

    >>> b = trm_bounds(4096, delta=1e-4, eps=5e-3, kl_seq=0.01, tv_seq=0.05)   # the paper's worked example
    >>> round(b["mixed_tv"], 3), round(b["unified"], 3), round(b["classical_kl"], 1)
    (4.096, 4.096, 1677.3)
    """
    if not isinstance(T, int) or isinstance(T, bool) or T < 1:
        raise ValueError(f"T must be an integer ≥ 1, got {T!r}")
    for name, v in (("delta", delta), ("eps", eps), ("kl_seq", kl_seq), ("tv_seq", tv_seq)):
        _check_nonneg(name, v)
    if delta is None:
        raise ValueError("delta is required")
    e = min(1.0, math.sqrt(delta / 2)) if eps is None else eps
    e1 = min(1.0, e)
    k1 = min(1.0, math.sqrt(delta / 2))
    j = torch.arange(T, dtype=torch.float64)  # j = t − 1 for t = 1..T
    pm_sum = float(torch.clamp(torch.sqrt(j * delta / 2), max=1.0).sum())
    out = {
        "classical_kl": T * (T - 1) * delta,
        "classical_tv": 2 * T * (T - 1) * e ** 2,
        "pinsker_marginal_kl": 4 * k1 * pm_sum,
        "pinsker_marginal_tv": 4 * e1 * pm_sum,
        "coupling": 4 * e1 * float(torch.clamp(j * e, max=1.0).sum()),
    }
    if kl_seq is not None:
        out["mixed_kl"] = 4 * T * k1 * min(1.0, math.sqrt(kl_seq / 2))
    if tv_seq is not None:
        out["mixed_tv"] = 4 * T * e1 * min(1.0, tv_seq)
    if dbar is not None:
        d = torch.as_tensor(dbar, dtype=torch.float64)
        if d.shape != (T,):
            raise ValueError(f"dbar must have shape ({T},), got {tuple(d.shape)}")
        if not bool(torch.isfinite(d).all()) or bool((d < 0).any()):
            raise ValueError("dbar must be finite and ≥ 0")
        rem = T - torch.arange(1, T + 1, dtype=torch.float64)  # T − t
        w = torch.minimum(torch.clamp(rem * e, max=1.0), torch.sqrt(rem * delta / 2))
        out["adaptive"] = float(4 * (d * w).sum())
    out["unified"] = min(out.values())
    return out


def dvp_bias_bound(r_max: float | Tensor, T: int | Tensor, z_min: float | Tensor) -> float | Tensor:
    """|J_mp − J| ≤ R_max · T · (1 − Z_min): bias of optimising the min-p constrained policy (DVP Prop 5.5).

    ``z_min`` is the minimum retained mass over visited states (``minp_mass`` of :mod:`offpolicy.kernels`).

    >>> dvp_bias_bound(1.0, 100, 0.999)     # 1 · 100 · 0.001
    0.10000000000000009
    """
    if isinstance(z_min, (int, float)) and not 0 <= z_min <= 1:
        raise ValueError(f"z_min must be in [0, 1], got {z_min!r}")
    return r_max * T * (1 - z_min)


def mismatch_envelope(p: float | Tensor, eps_max: float | Tensor, *, rigorous: bool = False) -> float | Tensor:
    """|Δ_a| = |log π_train(a) − log π_infer(a)| ≤ 2 ε_max (1 − p_a) under logit noise |ε_k| ≤ ε_max (DVP Prop 4.2).

    The paper's bound is first order: its proof evaluates p at an intermediate point z_c and then substitutes
    p_a = π_train(a). Exactly, it can fail: ε = (−ε_max on a, +ε_max elsewhere) gives
    Δ = log(p + (1 − p) e^{2ε_max}) > 2 ε_max (1 − p) (e.g. p = ½, ε_max = 0.01: 0.010050 > 0.01).
    ``rigorous=True`` multiplies by e^{2 ε_max}, which always holds: the odds (1 − p)/p move by at most that factor
    between z and z_c. (Also exact: 2 ε_max (1 − min(p_a, p'_a)), p' the perturbed probability, because log p_a is
    concave along the segment.)

    >>> mismatch_envelope(torch.tensor([0.0, 0.5, 1.0]), 0.1)
    tensor([0.2000, 0.1000, 0.0000])
    """
    bound = 2 * eps_max * (1 - p)
    if rigorous:
        bound = bound * (torch.exp(2 * torch.as_tensor(eps_max)) if isinstance(eps_max, Tensor) else math.exp(2 * eps_max))
    return bound

"""Float tolerances from the dtype's resolution and the size of the reduction — never a fixed number of nats.

Two computations of the same float quantity agree only to the rounding both make, and that rounding grows with the
magnitude of the values and the length of the sums involved. A fixed tolerance (say 1e-5 nats) is therefore too tight
on one machine (another SIMD width or thread count sums in another order) and far too loose on another. Every check in
offpolicy that judges an engine's or a kernel's float output takes its tolerance from here.

Notation: ε = ``torch.finfo(dtype).eps`` (2⁻²³ ≈ 1.19e-7 for float32, 2⁻⁷ for bfloat16), u = ε/2 the unit
roundoff, K the number of terms of a sum, c = :data:`SAFETY`.

* **A K-term sum** of values of magnitude ≤ M: recursive summation errs by at most (K − 1)·u·Σ|x| in the worst case,
  but rounding errors are independent and centred, so the error grows like √K·u·M with overwhelming probability
  (Higham & Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 2019, Thm 3.1;
  pairwise and blocked sums, as torch's CPU and CUDA reductions are, do better still): :func:`rounding_tolerance`
  = c·ε·M·√K.
* **A log-softmax** over V logits z with |z| ≤ A (finite entries), log p_y = z_y − m − log Σ_i exp(z_i − m),
  m = max z: the shifts z_i − m err by u·|z_i − m| ≤ 2uA each, which perturbs the sum by the same relative amount;
  exp adds u, the V-term sum √V·u, the log u·log V, the two subtractions u·(|m| + log V) and u·|log p_y| ≤ u·(2A +
  log V). In all |error| ≤ u·(5A + 3 log V + √V + 1) ≤ ε·(3A + 2 log V + √V/2 + 1), and two independent
  computations of it (an engine's and its replay) differ by twice that: :func:`log_softmax_tolerance`.

c = 4 covers the constants the bound drops (fused multiply-adds, exp/log accurate to 1–2 ulp rather than ½) and the
tail of the √K law; the tests check the bound both holds (1 and 2 threads) and is not vacuous (a real change of the
logits by a few times the tolerance is caught).
"""

from __future__ import annotations

import math

import torch

SAFETY = 4.0  # c: the constants the first-order bounds drop (see the module docstring)


def eps(dtype: torch.dtype) -> float:
    """The machine epsilon of a floating dtype (the gap between 1 and the next representable number).

    >>> eps(torch.float32), eps(torch.bfloat16)
    (1.1920928955078125e-07, 0.0078125)
    """
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    return float(torch.finfo(dtype).eps)


def rounding_tolerance(dtype: torch.dtype, magnitude: float, *, terms: int = 1) -> float:
    """c·ε(dtype)·magnitude·√terms: how far two computations of a ``terms``-long reduction of values of size
    ``magnitude`` in ``dtype`` can differ through rounding (module docstring).

    >>> round(rounding_tolerance(torch.float32, 1.0, terms=256), 10)   # 4 · 1.19e-7 · 16
    7.6294e-06
    """
    if not (math.isfinite(magnitude) and magnitude >= 0):
        raise ValueError(f"magnitude must be a finite number ≥ 0, got {magnitude!r}")
    if isinstance(terms, bool) or not isinstance(terms, int) or terms < 1:
        raise ValueError(f"terms must be an int ≥ 1, got {terms!r}")
    return SAFETY * eps(dtype) * magnitude * math.sqrt(terms)


def log_softmax_tolerance(dtype: torch.dtype, max_abs_logit: float | torch.Tensor, vocab: int) -> float | torch.Tensor:
    """How far two independent log-softmaxes over ``vocab`` logits of magnitude ≤ ``max_abs_logit`` (finite entries)
    in ``dtype`` can differ at one token: 2·c·ε·(3A + 2 log V + √V/2 + 1) nats (module docstring). A tensor of A (one
    per row) gives a tensor of tolerances.

    >>> round(log_softmax_tolerance(torch.float32, 20.0, 4099), 7)   # 8 · 1.19e-7 · (60 + 16.6 + 32 + 1)
    0.0001046
    """
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"vocab must be an int ≥ 1, got {vocab!r}")
    rest = 2 * math.log(vocab) + math.sqrt(vocab) / 2 + 1
    if isinstance(max_abs_logit, torch.Tensor):
        return 2 * SAFETY * eps(dtype) * (3 * max_abs_logit.double() + rest)
    if not (math.isfinite(max_abs_logit) and max_abs_logit >= 0):
        raise ValueError(f"max_abs_logit must be a finite number ≥ 0, got {max_abs_logit!r}")
    return 2 * SAFETY * eps(dtype) * (3 * max_abs_logit + rest)


def max_abs_finite(x: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` → ``[...]``: the largest |x| over each row's finite entries (0 for a row with none) — A above.

    >>> max_abs_finite(torch.tensor([[1.0, -3.0, -float("inf")], [float("nan"), 0.5, 2.0]]))
    tensor([3., 2.])
    """
    return torch.where(torch.isfinite(x), x.abs(), torch.zeros((), dtype=x.dtype, device=x.device)).amax(dim=-1)

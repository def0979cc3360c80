"""Masked reductions, log-ratios and their aggregation levels.

Everything here works on per-token tensors of shape ``[B, T]`` (batch × response tokens) and a mask of the same
shape (1 for tokens that count). Three rules are enforced in one place so no caller has to remember them:

* compute in float32 whatever comes in (bf16 log-prob differences are themselves a source of mismatch);
* a masked position never contributes, even if it holds NaN/±inf (:func:`zero_outside` before any arithmetic, never
  multiply-after-exp);
* a log-ratio is clamped to ``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]`` before ``exp`` (verl's SAFETY_BOUND).

Levels — one name, one meaning (the frameworks disagree, see README's name table):

* ``token``      ρ_t = exp(log ρ_t)
* ``sequence``   ρ = exp(Σ_t m_t log ρ_t), the true product ratio, broadcast to tokens
* ``geometric``  ρ_geo = exp(Σ_t m_t log ρ_t / Σ_t m_t), length-invariant, broadcast to tokens
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

LOG_RATIO_BOUND = 20.0
Level = Literal["token", "sequence", "geometric"]
LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def as_mask(mask: Tensor) -> Tensor:
    """Return ``mask`` as a bool tensor (accepts bool, int or float 0/1 masks)."""
    return mask if mask.dtype == torch.bool else mask != 0


# ---------------------------------------------------------------------------------------------------------------------
# The masked elementwise primitives everything else is written with. They run on every [B, T] tensor of every step, so
# they take the cheap form for each mode, here and nowhere else: in eager mode on CPU, torch.isfinite is four passes
# over the data, a bool-condition torch.where about thirty times a multiply, and a bool → float cast six times a
# uint8 → float one; under torch.compile, where fuses into a vectorised loop, nan_to_num does not, and a bool buffer
# is stored element by element.
# ---------------------------------------------------------------------------------------------------------------------


def is_finite(x: Tensor) -> Tensor:
    """``torch.isfinite(x)`` as |x| < ∞ (NaN compares false): bool, x's shape.

    >>> is_finite(torch.tensor([1.0, float("nan"), float("inf"), -float("inf")]))
    tensor([ True, False, False, False])
    """
    return x.abs() < float("inf")


def zero_outside(x: Tensor, keep: Tensor) -> Tensor:
    """``x`` where ``keep`` (bool) holds and 0 elsewhere, whatever ``x`` holds there (NaN and ±inf included); x must be
    finite where ``keep`` holds. Gradient flows to ``x`` where ``keep`` holds and is exactly 0 elsewhere.

    >>> zero_outside(torch.tensor([1.0, float("nan"), -float("inf"), 4.0]), torch.tensor([True, False, False, True]))
    tensor([1., 0., 0., 4.])
    """
    return finite_or_zero(x) * as_factor(keep)  # a NaN would survive a bare product (NaN · 0 = NaN)


def keep_only(x: Tensor, keep: Tensor) -> Tensor:
    """``x`` where ``keep`` holds, 0 elsewhere, for an ``x`` finite everywhere (a ratio, a weight): the product alone.

    >>> keep_only(torch.tensor([2.0, 3.0]), torch.tensor([True, False]))
    tensor([2., 0.])
    """
    return x * as_factor(keep)


def finite_or_zero(x: Tensor) -> Tensor:
    """``x`` with NaN and ±inf replaced by 0 (gradient 1 where ``x`` is finite, 0 elsewhere).

    Written as nan_to_num in eager mode and as a ``where`` on x's own finiteness under torch.compile, where
    nan_to_num is a scalar loop; either way the backward needs no mask but x itself.

    >>> finite_or_zero(torch.tensor([1.0, float("nan"), float("inf")]))
    tensor([1., 0., 0.])
    """
    if torch.compiler.is_compiling():
        return torch.where(is_finite(x), x, 0.0)
    return torch.nan_to_num(x, 0.0, 0.0, 0.0)


def as_factor(keep: Tensor) -> Tensor:
    """A bool mask as a 0/1 multiplicand: its bytes read as uint8 in eager mode (a uint8 → float promotion is six
    times faster than a bool → float one on CPU), float32 under torch.compile (inductor stores a bool buffer — one
    saved for the backward, or read by several loops — with a scalar loop; a float one it vectorises).

    >>> torch.ones(2) * as_factor(torch.tensor([True, False]))
    tensor([1., 0.])
    """
    return keep.to(torch.float32) if torch.compiler.is_compiling() else keep.view(torch.uint8)


def float_mask(keep: Tensor) -> Tensor:
    """A bool mask as float32 0/1 (the identity correction's weights)."""
    return as_factor(keep).to(torch.float32)


def count(keep: Tensor, dim: int | None = None) -> Tensor:
    """Number of True entries of a bool mask (int32), over ``dim`` or in total.

    >>> count(torch.tensor([[True, False], [True, True]]), dim=-1)
    tensor([1, 2], dtype=torch.int32)
    """
    factor = as_factor(keep)
    return factor.sum(dtype=torch.int32) if dim is None else factor.sum(dim=dim, dtype=torch.int32)


def broadcast_rows(mask: Tensor, row: Tensor) -> Tensor:
    """``mask & row`` ``[B, T]`` bool: a per-sequence decision ``row`` ([B] or [B, 1]) applied to every valid token
    (in eager mode expanded to [B, T] first: a broadcasting bool ``&`` is not vectorised on CPU).

    >>> broadcast_rows(torch.tensor([[True, False], [True, True]]), torch.tensor([False, True]))
    tensor([[False, False],
            [ True,  True]])
    """
    m = as_mask(mask)
    row = row if row.dim() == m.dim() else row.unsqueeze(-1)
    if torch.compiler.is_compiling():  # inductor fuses the broadcast; a contiguous copy would be one more pass
        return row & m
    return row.expand_as(m).contiguous() & m


def pad_nonempty(x: Tensor, value: float | bool = 0) -> Tensor:
    """``x`` ``[B, T]`` (or ``[B]``) padded to at least one row and one column with ``value`` (differentiable; a
    non-empty ``x`` is returned as is).

    Why: a batch that filtering emptied out (B = 0 or T = 0) must behave like an all-masked one — loss 0, every
    metric present and finite — but max/min reductions have no identity on an empty tensor. Padding with a masked
    position gives exactly the all-masked result; callers slice their [B, T] outputs back.

    >>> pad_nonempty(torch.zeros(0, 3)).shape, pad_nonempty(torch.ones(2, 0), 0).tolist()
    (torch.Size([1, 3]), [[0.0], [0.0]])
    """
    if x.numel() > 0:
        return x
    shape = (1,) if x.dim() == 1 else (max(x.shape[0], 1), max(x.shape[-1], 1))
    out = torch.full(shape, value, dtype=x.dtype, device=x.device)
    # + x.sum() (= 0) links the result to x, so a gradient flows back to x with x's (empty) shape
    return out + x.sum() if x.dtype.is_floating_point and x.requires_grad else out


def masked_fill_invalid(x: Tensor, mask: Tensor, value: float = 0.0) -> Tensor:
    """float32 copy of ``x`` with masked positions *and* non-finite values replaced by ``value``.

    Non-finite values in valid positions are the caller's to report (see :func:`count_nonfinite`); they never
    propagate into a sum.

    >>> masked_fill_invalid(torch.tensor([[1.0, float("nan"), 3.0]]), torch.tensor([[1, 1, 0]]))
    tensor([[1., 0., 0.]])
    """
    x = x.float()
    keep = as_mask(mask) & is_finite(x)
    filled = zero_outside(x, keep)
    return filled if value == 0.0 else filled + value * as_factor(~keep)


def count_nonfinite(x: Tensor, mask: Tensor) -> Tensor:
    """Number of valid (mask=1) positions of ``x`` that are NaN or ±inf, as a float32 0-d tensor."""
    return (as_mask(mask) & ~is_finite(x)).sum().float()


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ m·x over ``dim`` (all dims if None) in float32; masked and non-finite entries count as 0.

    >>> masked_sum(torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[1, 1, 0]]), dim=-1)
    tensor([3.])
    """
    x = masked_fill_invalid(x, mask)
    return x.sum() if dim is None else x.sum(dim=dim)


def masked_count(mask: Tensor, dim: int | None = None) -> Tensor:
    """Number of valid tokens (float32), over ``dim`` or in total."""
    return count(as_mask(mask), dim).float()


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ m·x / Σ m in float32; 0 (not NaN) where no token is valid.

    >>> masked_mean(torch.tensor([[1.0, 3.0, 100.0], [5.0, 0.0, 0.0]]), torch.tensor([[1, 1, 0], [0, 0, 0]]), dim=-1)
    tensor([2., 0.])
    """
    return masked_sum(x, mask, dim) / masked_count(mask, dim).clamp(min=1.0)


def mean_over_sequences(value: Tensor, nonempty: Tensor) -> Tensor:
    """Mean of a per-sequence ``value`` [B] over the sequences where ``nonempty`` [B] (bool) holds, as a 0-d float32
    tensor; 0 when no sequence is non-empty. A bool ``value`` gives the fraction of non-empty sequences where it holds.
    Values at other sequences never contribute, even NaN/±inf.

    >>> nonempty = torch.tensor([True, True, False])
    >>> mean_over_sequences(torch.tensor([1.0, 3.0, float("nan")]), nonempty)
    tensor(2.)
    >>> mean_over_sequences(torch.tensor([True, False, True]), nonempty)
    tensor(0.5000)
    """
    return zero_outside(value.float(), nonempty).sum() / count(nonempty).clamp(min=1)


def masked_max(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Max over valid finite entries; 0 where there are none (so an empty row never reads as -inf).

    >>> masked_max(torch.tensor([[-3.0, -1.0, float("nan")], [5.0, 0.0, 0.0]]), torch.tensor([[1, 1, 1], [0, 0, 0]]), dim=-1)
    tensor([-1.,  0.])
    """
    valid = as_mask(mask) & is_finite(x)
    return max_where(zero_outside(x.float(), valid), valid, dim)


def max_where(x: Tensor, keep: Tensor, dim: int | None = None) -> Tensor:
    """Max of a finite ``x`` over the positions where ``keep`` holds; 0 where there are none.

    >>> max_where(torch.tensor([[-3.0, -1.0, 7.0]]), torch.tensor([[True, True, False]]), dim=-1)
    tensor([-1.])
    """
    below_everything = x - FLOAT32_MAX * (1 - as_factor(keep))  # the positions outside keep never win the max
    out = below_everything.amax() if dim is None else below_everything.amax(dim=dim)
    return torch.where(count(keep, dim) > 0, out, 0.0)


def masked_min(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Min over valid finite entries; 0 where there are none."""
    return -masked_max(-x.float(), mask, dim)


def min_where(x: Tensor, keep: Tensor, dim: int | None = None) -> Tensor:
    """Min of a finite ``x`` over the positions where ``keep`` holds; 0 where there are none."""
    return -max_where(-x, keep, dim)


# ---------------------------------------------------------------------------------------------------------------------
# Per sequence: one value per row of a [B, T] tensor over its valid tokens, and whether a row holds a non-finite one.
# Every correction, metric and host adapter that reduces a row says it with these two.
# ---------------------------------------------------------------------------------------------------------------------

Reduce = Literal["sum", "mean", "max"]
REDUCES: tuple[str, ...] = ("sum", "mean", "max")
LEVEL_REDUCE: dict[str, Reduce] = {"sequence": "sum", "geometric": "mean"}  # a sequence-level log-ratio per row


def per_sequence(x: Tensor, mask: Tensor, reduce: Reduce, *, keepdim: bool = False) -> Tensor:
    """``x`` ``[B, T]`` reduced over each row's valid tokens (``mask`` ``[B, T]``): ``[B]`` (``[B, 1]`` with
    ``keepdim``) in float32, or float64 for a float64 ``x`` (a half-precision sum would round per token).

    * ``sum``  Σ_t m_t x_t
    * ``mean`` Σ_t m_t x_t / max(1, Σ_t m_t): the length is the row's number of valid tokens; 0 for an empty row
    * ``max``  max_t of x_t over the valid tokens; 0 for an empty row

    A masked position never contributes, whatever it holds; a NaN/±inf at a valid position counts as 0 in ``sum`` and
    ``mean`` (and 1 in the length) and is left out of ``max`` — whether its row is kept is the caller's decision
    (:func:`nonfinite_rows`). The gradient flows to x where it is valid and finite.

    >>> x = torch.tensor([[0.1, 0.3, 9.0], [float("nan"), -0.4, 0.0]]); m = torch.tensor([[1, 1, 0], [1, 1, 0]])
    >>> per_sequence(x, m, "sum"), per_sequence(x, m, "mean"), per_sequence(x, m, "max")
    (tensor([ 0.4000, -0.4000]), tensor([ 0.2000, -0.2000]), tensor([ 0.3000, -0.4000]))
    >>> per_sequence(x, torch.zeros(2, 3), "mean", keepdim=True)
    tensor([[0.],
            [0.]])
    """
    m = as_mask(mask)
    wide = x if x.dtype == torch.float64 else x.float()
    if reduce == "max":
        valid = m & is_finite(x)
        out = max_where(zero_outside(wide, valid), valid, dim=-1)
    elif reduce in ("sum", "mean"):
        out = zero_outside(wide, m).sum(dim=-1)  # zero_outside also zeroes a non-finite valid value
        if reduce == "mean":
            out = out / count(m, dim=-1).clamp(min=1)
    else:
        raise ValueError(f"reduce must be one of {REDUCES}, got {reduce!r}")
    return out.unsqueeze(-1) if keepdim else out


def nonfinite_rows(x: Tensor, mask: Tensor) -> Tensor:
    """``[B]`` bool: True where a valid position of the row (``mask`` ``[B, T]``) holds NaN/±inf in ``x`` ``[B, T]``
    — a sequence whose statistic is unknown, which a mask drops rather than keeps silently.

    >>> nonfinite_rows(torch.tensor([[0.0, float("nan")], [1.0, float("inf")]]), torch.tensor([[1, 1], [1, 0]]))
    tensor([ True, False])
    """
    return count(as_mask(mask) & ~is_finite(x), dim=-1) > 0


def log_ratio(numerator_logp: Tensor, denominator_logp: Tensor, mask: Tensor) -> Tensor:
    """Per-token log(numerator/denominator), float32, 0 at masked or non-finite positions, clamped to ±20.

    Gradient flows through ``numerator_logp`` (and ``denominator_logp``) unless the caller detaches them.

    >>> log_ratio(torch.tensor([[-1.0, -50.0]]), torch.tensor([[-2.0, -1.0]]), torch.tensor([[1, 1]]))
    tensor([[  1., -20.]])
    """
    diff = numerator_logp.float() - denominator_logp.float()
    return masked_fill_invalid(diff, mask).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def check_level(level: str) -> None:
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")


def aggregate_log_ratio(log_ratio_: Tensor, mask: Tensor, level: Level) -> Tensor:
    """Log-ratio at ``level``, broadcast back to ``[B, T]`` (0 at masked positions).

    ``sequence`` is Σ_t m_t log ρ_t (then clamped to ±20, so exp never overflows); ``geometric`` divides that sum by
    the number of valid tokens, which makes it invariant to repeating a sequence.

    >>> r = torch.tensor([[0.1, 0.3, 0.0]]); m = torch.tensor([[1, 1, 0]])
    >>> aggregate_log_ratio(r, m, "sequence")
    tensor([[0.4000, 0.4000, 0.0000]])
    >>> aggregate_log_ratio(r, m, "geometric")
    tensor([[0.2000, 0.2000, 0.0000]])
    """
    check_level(level)
    m = as_mask(mask)
    if level == "token":
        return masked_fill_invalid(log_ratio_, m).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND) * m
    return sequence_log_ratio(log_ratio_, m, level).unsqueeze(-1) * m  # broadcast back to [B, T]


def sequence_log_ratio(log_ratio_: Tensor, mask: Tensor, level: Level) -> Tensor:
    """Per-sequence log-ratio ``[B]`` at ``sequence`` or ``geometric`` level (``token`` is not a sequence quantity)."""
    if level == "token":
        raise ValueError("level='token' has no per-sequence value; use 'sequence' or 'geometric'")
    check_level(level)
    return per_sequence(log_ratio_, mask, LEVEL_REDUCE[level]).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def decompose_log_ratio(logp: Tensor, old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Three-policy decomposition (decoupled PPO, arXiv 2110.00641 eq. 5): log(π/μ) = log(π_old/μ) + log(π/π_old),
    per token ``[B, T]``.

    Returns ``{"total", "mismatch", "staleness"}``: ``mismatch`` = log(π_old/μ) is fixed per rollout (training–inference
    mismatch), ``staleness`` = log(π/π_old) changes every optimiser step. Before clamping, total == mismatch + staleness.

    >>> d = decompose_log_ratio(torch.tensor([[-1.0]]), torch.tensor([[-1.5]]), torch.tensor([[-2.0]]), torch.tensor([[1]]))
    >>> [round(d[k].item(), 3) for k in ("total", "mismatch", "staleness")]
    [1.0, 0.5, 0.5]
    """
    return {
        "total": log_ratio(logp, rollout_logp, mask),
        "mismatch": log_ratio(old_logp, rollout_logp, mask),
        "staleness": log_ratio(logp, old_logp, mask),
    }

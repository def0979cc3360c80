"""What a token-level objective reads (:class:`TokenInputs`) and returns (:class:`TokenLoss`).

:func:`offpolicy.policy_loss` cleans the batch once and hands every objective the same float32 ``[B, T]`` tensors:
at a position that does not count — padding, or a non-finite value in anything the objective reads — every tensor
holds 0 and ``valid`` is False, *before* any arithmetic, so neither the loss nor its autograd gradient can see a NaN.
The objective returns its per-token loss (to minimise) and the log-ratio it used; ``policy_loss`` multiplies in the
correction's coefficient, zeroes the positions that do not count and aggregates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import Tensor

from offpolicy.ratios import LEVEL_REDUCE, LEVELS, keep_only, per_sequence


@dataclass(frozen=True)
class TokenInputs:
    """The cleaned per-token inputs of an objective, all ``[B, T]`` float32 (``valid`` bool).

    ``logp`` log π_θ (carries the gradient); ``old_logp`` log π_old (detached; log π_θ detached when the batch has
    none: a single update on fresh rollouts); ``rollout_logp`` log μ (detached; None when the batch has none);
    ``advantages`` A per token; ``corrected``: a correction's coefficient will multiply the loss; ``rollout_finite``
    where μ was finite among the valid tokens (None: wherever it is given) — for an objective that uses μ where it has
    it without reading it (a non-finite μ it does not read is 0 in ``rollout_logp``, as every cleaned value).
    """

    logp: Tensor
    old_logp: Tensor
    rollout_logp: Tensor | None
    advantages: Tensor
    valid: Tensor
    corrected: bool = False
    rollout_finite: Tensor | None = None

    def log_ratio(self, denominator: Tensor, level: str = "token") -> Tensor:
        """log(π_θ / denominator) per token, the gradient flowing through π_θ; 0 where not valid.

        At ``sequence`` / ``geometric`` level it is GSPO-token's form (arXiv 2507.18071, eq. for s_{i,t}):
        log s_{i,t} = sg[log s_i] + log π_t − sg[log π_t], the sequence value on every token of sequence i with the
        per-token gradient, s_i the product (``sequence``) or its length-normalised geometric mean.
        """
        token = self.logp - denominator
        if level == "token":
            return token
        sequence = per_sequence(token.detach(), self.valid, LEVEL_REDUCE[level], keepdim=True)
        return keep_only(sequence + (self.logp - self.logp.detach()), self.valid)


@dataclass(frozen=True)
class TokenLoss:
    """An objective's output: ``loss`` [B, T] per token, to minimise; ``log_ratio`` [B, T] the log r it used (for the
    ``loss/ratio_*`` metrics); ``clipped``: metric name → [B, T] bool of the tokens it clipped (reported as the
    fraction of valid tokens, ``loss/<name>``)."""

    loss: Tensor
    log_ratio: Tensor
    clipped: dict[str, Tensor] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------------
# Argument checks shared by the objectives (a bad value is a ValueError naming the argument)
# ---------------------------------------------------------------------------------------------------------------------


def check_nonnegative(name: str, value: object) -> float:
    """A finite number ≥ 0, as a float.

    >>> check_nonnegative("clip_low", -0.1)
    Traceback (most recent call last):
    ...
    ValueError: clip_low must be a finite number >= 0, got -0.1
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def check_positive(name: str, value: object) -> float:
    """A finite number > 0, as a float."""
    if check_nonnegative(name, value) == 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def check_clip_range(clip_low: object, clip_high: object) -> tuple[float, float]:
    """(ε_low, ε_high) of the range [1 − ε_low, 1 + ε_high]; ``clip_high`` None is ``clip_low`` (symmetric)."""
    low = check_nonnegative("clip_low", clip_low)
    return low, low if clip_high is None else check_nonnegative("clip_high", clip_high)


def check_dual_clip(dual_clip: object) -> float | None:
    """None, or a finite c > 1 (the dual clip bounds a negative-advantage token's loss at c·|A|)."""
    if dual_clip is None:
        return None
    if isinstance(dual_clip, bool) or not isinstance(dual_clip, (int, float)) or not math.isfinite(dual_clip):
        raise ValueError(f"dual_clip must be a finite number > 1 or None, got {dual_clip!r}")
    if dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (it bounds the loss of negative-advantage tokens at c·|A|), got {dual_clip}")
    return float(dual_clip)


def check_level(level: object) -> str:
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    return level

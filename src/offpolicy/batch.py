"""``LogProbBatch``: the per-token tensors every correction, loss and metric consumes, validated once.

Shapes (B = sequences, T = response tokens, K = top-k width):

=====================  ===========  =================================================================
field                  shape        meaning
=====================  ===========  =================================================================
``logp``               [B, T]       log π_θ of the sampled token (may carry grad)
``old_logp``           [B, T]|None  log π_old, training engine at rollout time (PPO anchor)
``rollout_logp``       [B, T]|None  log μ, inference engine that actually sampled
``mask``               [B, T]       1 for response tokens that count, 0 for padding / prompt / tool output
``advantages``         [B]|[B, T]   per-sequence or per-token advantage
``token_divergence``   [B, T]|None  exact (or top-k bound) per-token KL(μ‖π), e.g. from ``offpolicy.divergence``
``token_divergence_kind``   str     what ``token_divergence`` is: ``"exact"`` (full logits) or ``"topk"`` (lower bound)
``versions``           [B, T]|None  integer policy version that generated each token (< 0: none), for decoupled PPO's
                                    log-linear proximal approximation (:mod:`offpolicy.objectives.proximal`)
``policy_version``     int|None     the version of the weights being trained (v_θ), with ``versions``
``max_nonfinite_rollout``  float|None  the largest share of valid tokens whose ``rollout_logp`` may be NaN / ±inf
                                    (default :data:`NONFINITE_ROLLOUT_LIMIT`; None: no limit)
``nonfinite_setting``  str|None     the setting a refusal names (a host's own key; None: ``LogProbBatch``'s and the
                                    environment's)
=====================  ===========  =================================================================

Non-finite μ: a NaN or −inf rollout log-prob at a valid position is an engine that failed on that token (an overflow,
raw log-probs of a token the recipe truncated). Every correction and loss leaves such tokens out (their sequence,
where the method works per sequence), and the metrics count them (``nonfinite_rollout_tokens``,
:func:`offpolicy.offpolicy_metrics`); past ``max_nonfinite_rollout`` of the valid tokens the batch is refused, naming
how many, where, and the setting. Checking costs one device sync per batch built with ``rollout_logp``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from offpolicy.ratios import as_mask

NONFINITE_ROLLOUT_LIMIT = 1e-3  # share of valid tokens whose μ may be NaN / ±inf before a batch is refused
NONFINITE_ROLLOUT_ENV = "OFFPOLICY_MAX_NONFINITE_ROLLOUT"  # the same limit for a run (trainer, TRL, verl workers)


def default_nonfinite_rollout_limit() -> float | None:
    """:data:`NONFINITE_ROLLOUT_LIMIT`, or the environment's ``OFFPOLICY_MAX_NONFINITE_ROLLOUT`` (a share in [0, 1],
    or ``none`` for no limit) — one setting that reaches every host's batches, verl's remote workers included."""
    text = os.environ.get(NONFINITE_ROLLOUT_ENV)
    if text is None or not text.strip():
        return NONFINITE_ROLLOUT_LIMIT
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{NONFINITE_ROLLOUT_ENV} must be a share in [0, 1] or 'none', got {text!r}")
    return value


def nonfinite_rollout_limit(value: Any, *, setting: str) -> float | None:
    """A host's ``max_nonfinite_rollout`` setting as the batch's limit: a share in [0, 1] (1: no limit), or None
    for the default (:func:`default_nonfinite_rollout_limit`); anything else is a ``ValueError`` naming ``setting``.

    >>> nonfinite_rollout_limit(0.01, setting="rollout.max_nonfinite_rollout")
    0.01
    >>> nonfinite_rollout_limit(2, setting="rollout.max_nonfinite_rollout")
    Traceback (most recent call last):
    ...
    ValueError: rollout.max_nonfinite_rollout must be a share in [0, 1] (1: no limit) or unset, got 2
    """
    if value is None:
        return default_nonfinite_rollout_limit()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{setting} must be a share in [0, 1] (1: no limit) or unset, got {value!r}")
    return float(value)


def nonfinite_fields(value: Any, *, setting: str) -> dict[str, Any]:
    """The :class:`LogProbBatch` fields of a host's ``max_nonfinite_rollout`` setting named ``setting``: the limit
    (:func:`nonfinite_rollout_limit`) and what a refusal names (the environment's variable too while the setting
    is unset, since that is then where the limit comes from).

    >>> nonfinite_fields(None, setting="rollout.max_nonfinite_rollout")["nonfinite_setting"]
    'rollout.max_nonfinite_rollout / OFFPOLICY_MAX_NONFINITE_ROLLOUT'
    """
    limit = nonfinite_rollout_limit(value, setting=setting)
    return {"max_nonfinite_rollout": limit,
            "nonfinite_setting": setting if value is not None else f"{setting} / {NONFINITE_ROLLOUT_ENV}"}


def check_nonfinite_rollout(rollout_logp: Tensor, mask: Tensor, limit: float | None, *,
                            setting: str | None = None) -> None:
    """Raise ``ValueError`` when more than ``limit`` of the valid tokens have a NaN / ±inf ``rollout_logp``
    [B, T], saying how many, in which rows (first position), and which setting raises the limit (``setting``: a
    host's key; None: ``LogProbBatch(max_nonfinite_rollout=...)`` and the environment's).

    >>> mu = torch.tensor([[-0.5, float("nan")], [-0.1, -0.2]])
    >>> check_nonfinite_rollout(mu, torch.ones(2, 2), 0.5)       # 1 of 4: within
    >>> check_nonfinite_rollout(mu, torch.ones(2, 2), 0.1)
    Traceback (most recent call last):
    ...
    ValueError: rollout_logp: 1 of 4 valid tokens (25 %) are NaN / ±inf, in rows [0] (first at row 0, position 1), above max_nonfinite_rollout = 0.1: the rollout engine returned no usable log-prob there (an overflow, or raw log-probs of a token its recipe truncated); fix the engine, or raise the limit with LogProbBatch(max_nonfinite_rollout=...) / OFFPOLICY_MAX_NONFINITE_ROLLOUT
    """
    if limit is None or rollout_logp.numel() == 0:
        return
    valid = as_mask(mask)
    bad = valid & ~torch.isfinite(rollout_logp)
    n_bad = int(bad.sum())
    if n_bad == 0:
        return
    n = int(valid.sum())
    if n_bad <= limit * n:
        return
    rows = bad.any(dim=-1).nonzero().flatten().tolist()
    row, pos = (int(v) for v in bad.nonzero()[0])
    shown = str(rows) if len(rows) <= 8 else f"{str(rows[:8])[:-1]}, …] ({len(rows)} rows)"
    setting = setting or f"LogProbBatch(max_nonfinite_rollout=...) / {NONFINITE_ROLLOUT_ENV}"
    raise ValueError(
        f"rollout_logp: {n_bad} of {n} valid tokens ({100 * n_bad / n:.3g} %) are NaN / ±inf, in rows {shown} (first "
        f"at row {row}, position {pos}), above max_nonfinite_rollout = {limit:g}: the rollout engine returned no "
        f"usable log-prob there (an overflow, or raw log-probs of a token its recipe truncated); fix the engine, or "
        f"raise the limit with {setting}")


def _check_tensor(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_same_shape(name: str, x: Tensor, like_name: str, like: Tensor) -> None:
    """Raise ``ValueError`` naming ``name`` if ``x`` does not have ``like``'s shape."""
    _check_tensor(name, x)
    if x.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)} but {like_name} has shape {tuple(like.shape)}; they must match")


def check_token_tensor(name: str, x: Tensor) -> None:
    """Raise ``ValueError`` unless ``x`` is a floating [B, T] tensor."""
    _check_tensor(name, x)
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [B, T], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def check_mask(mask: Tensor, like: Tensor, like_name: str = "logp", *, require_valid: bool = False) -> None:
    """Validate a [B, T] mask of 0/1 (bool, int or float). ``require_valid`` also demands ≥ 1 valid token."""
    check_same_shape("mask", mask, like_name, like)
    if mask.dtype != torch.bool and not torch.jit.is_tracing():
        if mask.is_floating_point() or mask.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
            pass
        else:
            raise ValueError(f"mask must be bool, integer or float, got dtype {mask.dtype}")
    if require_valid and not bool(as_mask(mask).any()):
        raise ValueError("mask has no valid token (all zeros); at least one response token is required")


def check_advantages(advantages: Tensor, like: Tensor) -> None:
    """Advantages are [B] (per sequence) or [B, T] (per token)."""
    _check_tensor("advantages", advantages)
    if advantages.dim() == 1:
        if advantages.shape[0] != like.shape[0]:
            raise ValueError(f"advantages has shape {tuple(advantages.shape)} but the batch has {like.shape[0]} sequences")
    elif advantages.dim() == 2:
        check_same_shape("advantages", advantages, "logp", like)
    else:
        raise ValueError(f"advantages must be [B] or [B, T], got shape {tuple(advantages.shape)}")


def token_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    """Broadcast [B] advantages to [B, T] float32 (per-token advantages pass through, cast to float32)."""
    a = advantages.float()
    return a.unsqueeze(-1).expand_as(like) if a.dim() == 1 else a


@dataclass(frozen=True)
class LogProbBatch:
    """Validated per-token log-probs of the three policies. See the module docstring for shapes.

    >>> b = LogProbBatch(logp=torch.zeros(2, 3), mask=torch.ones(2, 3), advantages=torch.tensor([1.0, -1.0]))
    >>> b.batch_size, b.seq_len
    (2, 3)
    >>> LogProbBatch(logp=torch.zeros(2, 3), mask=torch.ones(2, 4))
    Traceback (most recent call last):
    ...
    ValueError: mask has shape (2, 4) but logp has shape (2, 3); they must match
    """

    logp: Tensor
    mask: Tensor
    old_logp: Tensor | None = None
    rollout_logp: Tensor | None = None
    advantages: Tensor | None = None
    token_divergence: Tensor | None = None
    token_divergence_kind: str = "exact"
    extras: dict[str, Tensor] = field(default_factory=dict)
    versions: Tensor | None = None
    policy_version: int | None = None
    max_nonfinite_rollout: float | None = field(default_factory=default_nonfinite_rollout_limit)
    nonfinite_setting: str | None = None

    def __post_init__(self) -> None:
        check_token_tensor("logp", self.logp)
        check_mask(self.mask, self.logp)
        for name in ("old_logp", "rollout_logp", "token_divergence"):
            value = getattr(self, name)
            if value is not None:
                check_token_tensor(name, value)
                check_same_shape(name, value, "logp", self.logp)
        if self.token_divergence_kind not in ("exact", "topk"):
            raise ValueError(f"token_divergence_kind must be 'exact' or 'topk', got {self.token_divergence_kind!r}")
        if self.advantages is not None:
            check_advantages(self.advantages, self.logp)
        if self.versions is not None:
            check_same_shape("versions", self.versions, "logp", self.logp)
            if self.versions.is_floating_point() or self.versions.dtype == torch.bool:
                raise ValueError(f"versions must be an integer tensor, got dtype {self.versions.dtype}")
        if self.policy_version is not None and (isinstance(self.policy_version, bool)
                                                or not isinstance(self.policy_version, int)):
            raise ValueError(f"policy_version must be an int or None, got {self.policy_version!r}")
        limit = self.max_nonfinite_rollout
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                                  or not 0.0 <= limit <= 1.0):
            raise ValueError(f"max_nonfinite_rollout must be a share in [0, 1] or None, got {limit!r}")
        if self.rollout_logp is not None:
            if not torch.compiler.is_compiling():  # a host-side verdict: outside a compiled graph only
                check_nonfinite_rollout(self.rollout_logp.detach(), self.mask, limit, setting=self.nonfinite_setting)

    @property
    def batch_size(self) -> int:
        return self.logp.shape[0]

    @property
    def seq_len(self) -> int:
        return self.logp.shape[1]

    @property
    def bool_mask(self) -> Tensor:
        return as_mask(self.mask)

    @property
    def behaviour_logp(self) -> Tensor:
        """log μ if the rollout engine's log-probs exist, else log π_old, else log π_θ detached (on-policy)."""
        if self.rollout_logp is not None:
            return self.rollout_logp
        if self.old_logp is not None:
            return self.old_logp
        return self.logp.detach()

    @property
    def anchor_logp(self) -> Tensor:
        """log π_old if given, else log π_θ detached (a single update on fresh rollouts has π_old = π_θ)."""
        return self.old_logp if self.old_logp is not None else self.logp.detach()

    def token_advantages(self) -> Tensor:
        if self.advantages is None:
            raise ValueError("advantages is required here but the batch has none")
        return token_advantages(self.advantages, self.logp)

    def nonempty(self) -> LogProbBatch:
        """This batch, or — when it has no row or no column (B = 0 or T = 0, e.g. after filtering) — a ``[max(B, 1),
        max(T, 1)]`` copy whose extra positions are masked, so every function sees an all-masked batch (see
        :func:`offpolicy.ratios.pad_nonempty`). Slice [B, T] results back with ``[:B, :T]``."""
        if self.logp.numel() > 0:
            return self
        from offpolicy.ratios import pad_nonempty  # ratios imports this module

        def pad(x: Tensor) -> Tensor:
            return pad_nonempty(x, False if x.dtype == torch.bool else 0)

        def pad_optional(x: Tensor | None) -> Tensor | None:
            return None if x is None else pad(x)

        extras = {k: pad(v) if isinstance(v, Tensor) and v.shape[:2] == self.logp.shape else v
                  for k, v in self.extras.items()}
        return replace(self, logp=pad(self.logp), old_logp=pad_optional(self.old_logp),
                       rollout_logp=pad_optional(self.rollout_logp), mask=pad(self.mask),
                       advantages=pad_optional(self.advantages), token_divergence=pad_optional(self.token_divergence),
                       extras=extras,
                       versions=None if self.versions is None else pad_nonempty(self.versions, -1))

    def replace(self, **changes: Any) -> LogProbBatch:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

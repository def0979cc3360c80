"""Registries: corrections, objectives and aggregations by name, so that a config, the CLI, the TRL trainer and the verl
adapter can name a method — including one defined in a user's own module — without editing offpolicy.

Three registries, one per kind (in the spirit of verl's ``@register_policy_loss`` and torchtune's config-named
components):

* :data:`CORRECTIONS` — factories ``(**params) -> Correction`` (``tis``, ``icepop``, ``opsm`` …);
  register with :func:`register_correction`, build from data with :func:`build_correction`;
* :data:`OBJECTIVES` — token-level losses ``(inputs, **params) -> TokenLoss`` (``ppo``, ``cispo``, ``sapo`` …);
  register with :func:`register_objective` (see :mod:`offpolicy.objectives`);
* :data:`AGGREGATIONS` — ``(token_loss, mask, max_tokens) -> scalar`` (``token_mean``, ``token_sum`` …);
  register with :func:`register_aggregation` (see :mod:`offpolicy.losses`).

A *spec* names a registered entry and its parameters: ``"icepop"``, ``{"name": "opsm", "delta": 0.5}``, or a list of
them (a chain). An unknown name or parameter is a ``ValueError`` that lists what exists, raised when the spec is
read — before any model is loaded or token generated.

>>> import offpolicy as op
>>> op.build_correction([{"name": "icepop"}, {"name": "opsm", "delta": 0.5}])
chain(icepop(lower=0.5, upper=5.0, source='mismatch'), opsm(delta=0.5))
>>> op.build_correction("tiss")
Traceback (most recent call last):
...
ValueError: unknown correction 'tiss'; registered: calibrated_is, delight, dvp_keep, gated_is, geo_mask, icepop, importance, kl_rejection, ln_trm, m2po, mis, opsm, ser, tis, trm, veto
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar, Union

if TYPE_CHECKING:
    from offpolicy.corrections.base import Correction

T = TypeVar("T")


class Registry(Generic[T]):
    """Name → entry, for one kind of component. ``register(name)`` is a decorator; ``registry[name]`` looks up.

    Registering a second, different entry under a taken name is an error (two plug-ins must not silently replace
    each other); re-registering the same function — a module imported again, a notebook cell run twice — replaces
    it.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        old = self._entries.get(name)
        if old is not None and _identity(old) != _identity(entry):
            raise ValueError(f"{self.kind} {name!r} is already registered (by {_identity(old)[0]}); pick another name")
        self._entries[name] = entry
        return entry

    def __getitem__(self, name: str) -> T:
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}")
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._entries))

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests and notebooks that define a throw-away entry)."""
        self._entries.pop(name, None)


def _identity(entry: object) -> tuple[str, str]:
    fn = getattr(entry, "fn", entry)  # an Objective is identified by its function
    return getattr(fn, "__module__", "?"), getattr(fn, "__qualname__", repr(fn))


# ---------------------------------------------------------------------------------------------------------------------
# Corrections
# ---------------------------------------------------------------------------------------------------------------------

CORRECTIONS: Registry[Callable[..., Correction]] = Registry("correction")

CorrectionSpec = Union[str, Mapping[str, Any], "Correction"]


def register_correction(name: str) -> Callable[[Callable[..., Correction]], Callable[..., Correction]]:
    """Decorator: register a correction factory ``(**params) -> Correction`` under ``name``.

    >>> import torch, offpolicy as op
    >>> @op.register_correction("halve")
    ... def halve(factor: float = 0.5) -> op.Correction:
    ...     def apply(batch):
    ...         kept = op.CorrectionResult.identity(batch)
    ...         return op.CorrectionResult(kept.weights * factor, kept.keep, {"halve/factor": torch.tensor(factor)})
    ...     return op.Correction("halve", apply, {"factor": factor})
    >>> op.build_correction({"name": "halve", "factor": 0.25})
    halve(factor=0.25)
    >>> CORRECTIONS.unregister("halve")
    """

    def decorator(factory: Callable[..., Correction]) -> Callable[..., Correction]:
        return CORRECTIONS.register(name, factory)

    return decorator


def split_spec(spec: object, kind: str) -> tuple[str, dict[str, Any]]:
    """``(name, params)`` of a spec: a name, or a mapping with ``name`` and the parameters.

    >>> split_spec({"name": "opsm", "delta": 0.5}, "correction")
    ('opsm', {'delta': 0.5})
    """
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, Mapping):
        if "name" not in spec:
            raise ValueError(f"a {kind} spec needs a 'name' key, got {dict(spec)!r}")
        params = {k: v for k, v in spec.items() if k != "name"}
        return spec["name"], params
    raise ValueError(f"a {kind} spec is a name or a mapping with 'name', got {type(spec).__name__}")


def check_params(kind: str, name: str, fn: Callable[..., Any], params: Mapping[str, Any], skip: int = 0) -> None:
    """Raise ``ValueError`` naming the first parameter that ``fn`` does not take (``skip`` leading positional ones,
    e.g. an objective's inputs, are not parameters)."""
    signature = inspect.signature(fn)
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return
    accepted = list(signature.parameters)[skip:]
    for key in params:
        if key not in accepted:
            raise ValueError(f"{kind} {name!r} has no parameter {key!r}; it takes: {', '.join(accepted) or 'none'}")


def build_correction(spec: CorrectionSpec | Sequence[CorrectionSpec] | None) -> Correction | None:
    """A :class:`~offpolicy.Correction` from data: a name, ``{"name": …, **params}``, a ``Correction`` (returned as is),
    or a list of those (their :func:`~offpolicy.chain`; one element gives that correction itself, none gives None).

    >>> build_correction({"name": "tis", "upper": 3.0})
    tis(level='token', lower=None, upper=3.0, normalize=False, source='mismatch')
    >>> build_correction([]) is None
    True
    """
    from offpolicy.corrections.base import Correction, chain

    if spec is None:
        return None
    if isinstance(spec, Correction):
        return spec
    if isinstance(spec, (list, tuple)):
        parts = [p for p in (build_correction(s) for s in spec) if p is not None]
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else chain(*parts)
    name, params = split_spec(spec, "correction")
    factory = CORRECTIONS[name]
    check_params("correction", name, factory, params)
    return factory(**params)


# ---------------------------------------------------------------------------------------------------------------------
# Objectives
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Objective:
    """A registered objective: its token-level loss ``fn(inputs, **params) -> TokenLoss`` and the log-probs it reads
    besides π_θ and the advantages (``"old_logp"``, ``"rollout_logp"``) — a token is dropped only for non-finite
    values the objective reads. ``reads`` may depend on whether a correction weights the loss (``decoupled`` reads
    μ only without one)."""

    name: str
    fn: Callable[..., Any]
    reads: tuple[str, ...] | Callable[[bool], tuple[str, ...]] = ("old_logp",)

    def inputs_read(self, corrected: bool) -> tuple[str, ...]:
        return self.reads(corrected) if callable(self.reads) else self.reads

    def parameters(self) -> tuple[str, ...]:
        """The keyword parameters ``fn`` takes (after its inputs)."""
        return tuple(list(inspect.signature(self.fn).parameters)[1:])


OBJECTIVES: Registry[Objective] = Registry("objective")


def register_objective(
    name: str, *, reads: tuple[str, ...] | Callable[[bool], tuple[str, ...]] = ("old_logp",)
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register a token-level objective ``fn(inputs: TokenInputs, **params) -> TokenLoss`` under ``name``.

    ``reads`` names the batch log-probs the loss uses besides π_θ: ``"old_logp"`` (π_old, a missing one is π_θ
    detached) and/or ``"rollout_logp"`` (μ, required). See :mod:`offpolicy.objectives` for the inputs and outputs.
    """

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        OBJECTIVES.register(name, Objective(name, fn, reads))
        return fn

    return decorator


# ---------------------------------------------------------------------------------------------------------------------
# Aggregations
# ---------------------------------------------------------------------------------------------------------------------

AGGREGATIONS: Registry[Callable[..., Any]] = Registry("aggregation")


def register_aggregation(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register ``fn(token_loss [B, T], mask [B, T] bool, max_tokens: int | None) -> 0-d loss``.

    ``token_loss`` is already 0 wherever a token does not count; ``mask`` is the padding mask (a token a correction
    dropped still counts in a denominator).
    """

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        return AGGREGATIONS.register(name, fn)

    return decorator

"""Registries: corrections, objectives and aggregations by name, so that a config, the CLI, the TRL trainer and the verl
adapter can name a method — including one defined in a user's own module — without editing offpolicy.

Four registries, one per kind (in the spirit of verl's ``@register_policy_loss`` and torchtune's config-named
components):

* :data:`CORRECTIONS` — factories ``(**params) -> Correction`` (``tis``, ``icepop``, ``opsm`` …);
  register with :func:`register_correction`, build from data with :func:`build_correction`;
* :data:`OBJECTIVES` — token-level losses ``(inputs, **params) -> TokenLoss`` (``ppo``, ``cispo``, ``sapo`` …);
  register with :func:`register_objective` (see :mod:`offpolicy.objectives`);
* :data:`AGGREGATIONS` — ``(token_loss, mask, max_tokens) -> scalar`` (``token_mean``, ``token_sum`` …);
  register with :func:`register_aggregation` (see :mod:`offpolicy.losses`);
* :data:`TRANSFORMS` — log-prob transforms (``dvp``, ``alp``, ``score_centering`` …, :mod:`offpolicy.transforms`):
  their parameters and what they need (:data:`NEEDS`); register with :func:`register_transform`, build with
  :func:`build_transform`.

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


# ---------------------------------------------------------------------------------------------------------------------
# Log-prob transforms
# ---------------------------------------------------------------------------------------------------------------------

# What a method reads besides π_θ, in one vocabulary for transforms, corrections and objectives: a host declares which
# of these it can supply (offpolicy.recipe.hosts) and refuses a recipe that needs one it cannot.
NEEDS: dict[str, str] = {
    "rollout_logp": "the engine's log-probs μ of the sampled tokens",
    "old_logp": "π_old's log-probs, from the trainer's forward before the update",
    "engine_topk": "the engine's top-K log-probs and ids at each sampled position",
    "engine_logits": "the engine's full logits at each sampled position",
    "sampling_recipe": "the engine's sampling recipe (temperature, min-p, top-k, top-p), applied on both sides",
    "policy_versions": "the policy version that sampled each token, as an asynchronous rollout records it",
    "hidden_states": "hooks on the decoder layers of the trainer's model",
}


@dataclass(frozen=True)
class Transform:
    """A registered log-prob transform: a method that changes the log-probs (or the per-token divergence) the loss
    reads, before any correction sees them.

    ``params``: each parameter's default (``REQUIRED`` for one without); ``needs``: keys of :data:`NEEDS`, a tuple or
    a function of the bound parameters (score centering reads the engine's logits or its top-K, as configured);
    ``provides``: what it changes (``"logp"``, ``"token_divergence"``, ``"old_logp"``); ``corrections``: corrections
    it puts first in the chain (DVP's ``dvp_keep`` drops tokens outside the trainer's support); ``apply``:
    ``(batch: LogProbBatch, **params) -> LogProbBatch`` for a transform a host runs on the batch before the loss
    (a plug-in's), None for the built-in ones; ``on_batch``: a built-in's batch step, the same signature, which
    finishes on the batch what the host's scoring forward computed from the logits (score centering's centre put
    into the log-probs' gradient, top-K TRM's bound chosen) — :func:`offpolicy.transforms.apply_transforms` runs
    ``apply`` or ``on_batch`` of each; ``check``: raises a ``ValueError`` naming a parameter whose value is out of
    range.
    """

    name: str
    params: Mapping[str, Any]
    needs: tuple[str, ...] | Callable[[Mapping[str, Any]], tuple[str, ...]] = ()
    provides: str = "logp"
    description: str = ""
    corrections: tuple[str, ...] = ()
    apply: Callable[..., Any] | None = None
    check: Callable[[Mapping[str, Any]], None] | None = None  # raises ValueError naming a bad parameter value
    on_batch: Callable[..., Any] | None = None  # a built-in's batch step (apply_transforms)

    def needs_for(self, params: Mapping[str, Any]) -> tuple[str, ...]:
        return self.needs(params) if callable(self.needs) else self.needs

    @property
    def fn(self) -> Any:  # the Registry identifies an entry by its function (a re-registration replaces it)
        return self.apply if self.apply is not None else self


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()

TRANSFORMS: Registry[Transform] = Registry("transform")


@dataclass(frozen=True)
class BoundTransform:
    """A transform with its parameters (defaults filled in): what :func:`build_transform` returns."""

    entry: Transform
    params: Mapping[str, Any]

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def needs(self) -> tuple[str, ...]:
        return self.entry.needs_for(self.params)

    @property
    def plugin(self) -> bool:
        """A plug-in's transform (it has ``apply``), not a built-in one."""
        return self.entry.apply is not None

    def __call__(self, batch: Any) -> Any:
        """The transformed batch (a plug-in's ``apply``); a built-in transform is computed by the host."""
        if self.entry.apply is None:
            raise ValueError(f"transform {self.name!r} is computed by the host's scoring, not on a batch")
        return self.entry.apply(batch, **self.params)


def register_transform(
    name: str,
    *,
    needs: tuple[str, ...] | Callable[[Mapping[str, Any]], tuple[str, ...]] = (),
    provides: str = "logp",
    description: str = "",
    corrections: tuple[str, ...] = (),
    params: Mapping[str, Any] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register ``fn(batch: LogProbBatch, **params) -> LogProbBatch`` as transform ``name``; its keyword
    parameters (after the batch) and their defaults are the transform's, unless ``params`` says.

    >>> import offpolicy as op
    >>> @op.register_transform("shift_old", needs=("old_logp",), provides="old_logp")
    ... def shift_old(batch, by: float = 0.0):
    ...     return batch.replace(old_logp=batch.old_logp + by)
    >>> op.build_transform({"name": "shift_old", "by": 0.5}).params
    {'by': 0.5}
    >>> TRANSFORMS.unregister("shift_old")
    """
    _check_needs(name, needs)

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        own = params
        if own is None:
            signature = list(inspect.signature(fn).parameters.values())[1:]
            own = {p.name: REQUIRED if p.default is p.empty else p.default for p in signature
                   if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        TRANSFORMS.register(name, Transform(name, dict(own), needs, provides, description, corrections, fn))
        return fn

    return decorator


def describe_transform(entry: Transform) -> Transform:
    """Register a transform that the hosts compute themselves (no ``apply``): the built-in ones."""
    _check_needs(entry.name, entry.needs)
    return TRANSFORMS.register(entry.name, entry)


def _check_needs(name: str, needs: Any) -> None:
    if not callable(needs):
        unknown = [n for n in needs if n not in NEEDS]
        if unknown:
            raise ValueError(f"transform {name!r}: unknown need {unknown[0]!r}; known: {', '.join(NEEDS)}")


def nearest(key: str, valid: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the valid key closest to ``key``, or ``''``."""
    import difflib

    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def build_transform(spec: str | Mapping[str, Any]) -> BoundTransform:
    """A :class:`BoundTransform` from a name or ``{"name": …, **params}``: every parameter checked (an unknown one
    names the nearest), a missing required one named, the defaults filled in.

    >>> import offpolicy.transforms
    >>> build_transform({"name": "dvp", "rho": 1e-4}).params
    {'rho': 0.0001, 'coverage': None}
    >>> build_transform({"name": "dvp", "rh": 1e-4})
    Traceback (most recent call last):
    ...
    ValueError: transform 'dvp' has no parameter 'rh' (did you mean 'rho'?); it takes: rho, coverage
    """
    name, given = split_spec(spec, "transform")
    entry = TRANSFORMS[name]
    for key in given:
        if key not in entry.params:
            raise ValueError(f"transform {name!r} has no parameter {key!r}{nearest(key, list(entry.params))}; it "
                             f"takes: {', '.join(entry.params) or 'none'}")
    params = {k: given.get(k, default) for k, default in entry.params.items()}
    missing = [k for k, v in params.items() if v is REQUIRED]
    if missing:
        raise ValueError(f"transform {name!r} needs parameter {missing[0]!r}")
    if entry.check is not None:
        entry.check(params)
    return BoundTransform(entry, params)

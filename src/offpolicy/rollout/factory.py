"""One factory for every rollout engine: a registry of backends keyed by name, and :func:`build_engine`.

An engine is described by an :class:`~offpolicy.rollout.spec.EngineSpec` (backend, dtype, quantisation, KV cache,
server URL and protocol, …) and built by the builder its backend registered. The trainer (``rollout.*`` of its
config), ``offpolicy inspect`` (``--rollout`` / ``--trainer``), the lab (through the trainer's config) and the warm
start's evaluation all build their engines here, so a backend added once is reachable from all of them.

Adding an engine = one file plus one registration::

    from offpolicy.rollout import register_engine

    @register_engine("echo", fields=("seed",))     # the EngineSpec fields it honours besides name, backend, dtype
    def build_echo(spec, *, model=None, tokenizer=None, model_path=None):
        return EchoEngine(model, tokenizer, seed=spec.seed)   # anything with the RolloutEngine interface

``fields`` lists the spec fields the backend reads (beyond ``name``, ``backend`` and ``dtype``); a spec that sets any
other field away from its default is refused by :func:`build_engine` with a ``ValueError`` naming the field, so a
setting is never silently ignored. The built-in backends (``hf``, ``vllm``, ``llamacpp``, ``server``) register their
builders next to their engines (rollout/hf.py, vllm.py, llamacpp.py, servers.py).

The spec type is imported here only for type checking: :mod:`offpolicy.rollout.spec` reads this registry to validate
``backend`` when a spec is made, so the registry sits below it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, overload

from offpolicy.registry import Registry

if TYPE_CHECKING:
    from offpolicy.rollout.base import RolloutEngine
    from offpolicy.rollout.spec import EngineSpec

# Read by every backend: which backend, what it is called in reports, and the dtype (llama.cpp and a server ignore it:
# their numerics are set by weights= / the server's own settings).
COMMON_FIELDS = frozenset({"name", "backend", "dtype"})


class EngineBuilder(Protocol):
    """``(spec, *, model, tokenizer, model_path) -> RolloutEngine``: a backend's builder. ``model`` is the trainer's
    module (an in-process engine takes a private copy; llama.cpp exports it; a server reads its vocabulary size),
    ``model_path`` a local model directory an engine may load instead (vLLM)."""

    def __call__(self, spec: EngineSpec, *, model: Any = None, tokenizer: Any = None,
                 model_path: str | None = None) -> RolloutEngine: ...


@dataclass(frozen=True)
class EngineBackend:
    """A registered backend: its builder ``fn`` and the spec fields it honours (besides :data:`COMMON_FIELDS`)."""

    name: str
    fn: EngineBuilder
    fields: frozenset[str]


ENGINE_BUILDERS: Registry[EngineBackend] = Registry("engine backend")


BuilderT = TypeVar("BuilderT", bound=Callable[..., Any])


@overload
def register_engine(name: str, builder: None = None, *, fields: Iterable[str] = ()) -> Callable[[BuilderT], BuilderT]:
    ...


@overload
def register_engine(name: str, builder: BuilderT, *, fields: Iterable[str] = ()) -> BuilderT:
    ...


def register_engine(name: str, builder: Any = None, *, fields: Iterable[str] = ()) -> Any:
    """Register ``builder`` as backend ``name``: ``register_engine("mine", build_mine, fields=("seed",))``, or as a
    decorator ``@register_engine("mine", fields=(...))``. ``fields``: the :class:`EngineSpec` fields the builder
    reads besides ``name``, ``backend`` and ``dtype`` (checked against the spec by :func:`build_engine`).
    Registering another builder under a taken name is an error; re-registering the same function replaces it (a module imported again).

    >>> from offpolicy.rollout import EngineSpec, build_engine
    >>> @register_engine("constant", fields=("seed",))
    ... def build_constant(spec, *, model=None, tokenizer=None, model_path=None):
    ...     return ("an engine", spec.seed)
    >>> build_engine(EngineSpec(backend="constant", seed=3))
    ('an engine', 3)
    >>> build_engine(EngineSpec(backend="constant", weight_bits=4))
    Traceback (most recent call last):
    ...
    ValueError: backend='constant' cannot honour weight_bits=4 (it reads seed besides name, backend, dtype)
    >>> ENGINE_BUILDERS.unregister("constant")
    """
    wanted = frozenset(fields)
    if not all(isinstance(f, str) for f in wanted):
        raise ValueError(f"fields must be EngineSpec field names, got {sorted(map(repr, wanted))}")

    def decorator(fn: BuilderT) -> BuilderT:
        if not callable(fn):
            raise ValueError(f"builder for engine backend {name!r} must be callable, got {fn!r}")
        ENGINE_BUILDERS.register(name, EngineBackend(name, fn, wanted))
        return fn

    return decorator if builder is None else decorator(builder)


def engine_backends() -> tuple[str, ...]:
    """The registered backend names, sorted (``hf``, ``llamacpp``, ``server``, ``vllm`` and any registered since)."""
    return ENGINE_BUILDERS.names()


def refused_fields(spec: EngineSpec, backend: EngineBackend) -> list[str]:
    """``field=value`` of every field ``spec`` sets away from its default that ``backend`` does not read."""
    out = []
    for f in dataclasses.fields(spec):
        if f.name in COMMON_FIELDS or f.name in backend.fields:
            continue
        value = getattr(spec, f.name)
        if value != f.default:
            out.append(f"{f.name}={value!r}")
    return out


def build_engine(spec: EngineSpec, *, model: Any = None, tokenizer: Any = None,
                 model_path: str | None = None) -> RolloutEngine:
    """The rollout engine ``spec`` describes, built by its backend's registered builder.

    ``model``: the model the engine samples with (the in-process engines take a private copy in ``spec.dtype``;
    llama.cpp exports it to GGUF; a server client reads its vocabulary size); ``tokenizer``: decodes completions and,
    for llama.cpp and vLLM, travels with the exported weights; ``model_path``: a local model directory vLLM may load
    instead of a copy of ``model``. An unknown backend, or a field the backend does not read set away from its
    default (``quant`` on vLLM), is a one-line ``ValueError``.

    >>> import torch
    >>> from offpolicy.models.tiny import build_tiny_model
    >>> from offpolicy.rollout import EngineSpec
    >>> model, tok = build_tiny_model(0)
    >>> engine = build_engine(EngineSpec.parse("backend=hf,dtype=float32,quant=w4a4"), model=model, tokenizer=tok)
    >>> type(engine).__name__, engine.dtype, engine.quant
    ('HFRolloutEngine', torch.float32, 'nvfp4')
    """
    backend_name = getattr(spec, "backend", None)
    if not dataclasses.is_dataclass(spec) or not isinstance(backend_name, str):
        raise ValueError(f"spec must be an EngineSpec, got {type(spec).__name__}")
    backend = ENGINE_BUILDERS[backend_name]  # ValueError listing the registered backends
    unknown = sorted(backend.fields - {f.name for f in dataclasses.fields(spec)})
    if unknown:
        raise ValueError(f"engine backend {backend_name!r} was registered with fields={unknown}, which EngineSpec "
                         "does not have")
    refused = refused_fields(spec, backend)
    if refused:
        reads = ", ".join(sorted(backend.fields)) or "nothing"
        raise ValueError(f"backend={backend_name!r} cannot honour {', '.join(refused)} (it reads {reads} besides "
                         "name, backend, dtype)")
    return backend.fn(spec, model=model, tokenizer=tokenizer, model_path=model_path)

"""The one settings block of the verl plug-in, read by the driver, the agent loop and the engine alike.

A verl user writes it once, as the environment variable ``OFFPOLICY_VERL`` of verl's Ray job
(``ray_kwargs.ray_init.runtime_env.env_vars`` in the trainer config, a YAML or JSON mapping in one string): Ray gives a
job's environment to every process of it on every node — the driver's task runner, the agent-loop workers and the
training workers — which is what the three parts need. (verl's free-form ``rollout.custom`` reaches the driver and the
agent loops but not the training engine, and a mapping under ``model.override_config`` breaks verl's HF-config update,
which descends into every dict value.)::

    ray_kwargs:
      ray_init:
        runtime_env:
          env_vars:
            OFFPOLICY_VERL: >-
              {correction: [{name: icepop}, {name: opsm, delta: 0.5}],
               sampling: {min_p: 0.001}, alp: {init_std: 3.0e-2, lr: 5.0e-4}, topk_logprobs: 0}

``correction`` runs in the driver after the advantages (verl's own ``algorithm.rollout_correction`` must then be off:
the trainer refuses both); ``sampling`` is DVP's ρ (``min_p``) or, with ``top_k`` / ``top_p``, sampling replay (agent
loop + engine); ``alp`` perturbs the update forward (σ 3e-2 above: under verl's bf16 ``param_dtype`` the paper's
default 1e-4 mostly rounds away, docs/frameworks/verl.md); ``topk_logprobs`` asks the
server for K log-probs per token and, with ``trm`` in ``correction``, makes TRM's divergence the certified
``topk_bound: upper`` (default) or the coarse-grained ``lower`` bound on KL(μ ‖ π_old) from them;
``score_centering: true`` (needs ``topk_logprobs``) centres the score in the update forward on the engine's top-K
(arXiv 2609.20807, the proportional-tail rule of :func:`offpolicy.score_center_topk`); ``plugin_transforms`` (a list
of plug-in transform specs, ``[{name: my_transform, …}]``, registered by a module every process imports; a recipe's
plug-in ``transforms`` map onto it) run in the workers' policy loss on each micro-batch (:func:`offpolicy.transforms.apply_transforms`); ``sync_check`` (``error``,
the default, ``warn`` or ``off``) runs the sync check after every weight sync of the plug-in's trainer
(:mod:`.sync_check`), each replica answering its probe within ``sync_check_timeout`` seconds (600 by default);
``max_nonfinite_rollout`` (a share in [0, 1]; unset: ``OFFPOLICY_MAX_NONFINITE_ROLLOUT``, else
1e-3) is the largest share of a batch's valid tokens whose μ may be NaN / ±inf, in the driver's correction and the
workers' loss alike.

Numbers are read as YAML 1.2 writes them (``1e-4``, ``2e0``, ``-.5``: :mod:`offpolicy.yaml_numbers`). Every key is
optional; an unknown key or a value of the wrong type or range is a one-line ``ValueError`` naming its path
(``OFFPOLICY_VERL: correction.upper must be a real number or null, got 'abc'``), raised when the block is read (the
engine's construction, the driver's first step), not deep inside a step.

The block may instead be a :class:`~offpolicy.Recipe` (``{corrections: [tis], transforms: {dvp: {rho: 1e-4}}}``)
or hold one as ``recipe: <path or inline>``; it is mapped onto the keys above through
:data:`offpolicy.recipe.hosts.OLD_SPELLINGS`, and a key of the block that says otherwise is refused.

``allow_changed`` (a list of setting names, e.g. ``[correction.upper]``) lets a resumed run (verl's
``trainer.resume_mode``) use values that differ from those stored with its checkpoint; any other difference is
refused (:mod:`.resume`).
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from offpolicy.registry import build_correction
from offpolicy.rollout.sampling import SamplingConfig

KNOWN_KEYS = ("correction", "sampling", "alp", "topk_logprobs", "topk_bound", "score_centering", "plugin_transforms",
              "naming",
              "sync_check", "sync_check_timeout", "max_nonfinite_rollout", "allow_changed")
SYNC_CHECK_MODES = ("error", "warn", "off")
# seconds a rollout replica may take to answer the sync check's probe: a hang, not a slow server (on 2 shared CPU
# cores at a load of 28 one probe took over 120 s)
SYNC_CHECK_TIMEOUT = 600.0
# a batch's flag (verl non-tensor data) asking the plug-in's engine for the model's plain log-probs, log softmax(z / T),
# without the sampling recipe, top-K bounds or centring: the sync check's probe, which the engine side scores as
# vLLM's prompt log-probs (no sampler) — the two sides must compute the same thing
PLAIN_LOG_PROBS = "offpolicy_plain_log_probs"
# the sampling recipe's outputs of the old-log-prob forward (DVP's min-p safe set, replay's support), laid out as its
# log_probs (prompt + response): whether each sampled token is inside π_old's support (1.0 / 0.0) and the support's
# retained mass Z — the driver's ``dvp_keep`` reads them
DVP_KEEP_FIELD = "offpolicy_dvp_keep"
DVP_MASS_FIELD = "offpolicy_dvp_mass"
SAMPLING_KEYS = ("min_p", "top_k", "top_p")
ALP_KEYS = ("init_std", "lr", "layers", "seed")


@dataclass(frozen=True)
class SamplingRecipe:
    """The engine's truncation (temperature comes from verl's own ``rollout.temperature``).

    ``min_p`` alone is DVP's ρ (arXiv 2512.23087 Defs 5.1–5.2, the trainer scores over its own min-p safe set);
    ``top_k`` / ``top_p`` (with or without ``min_p``) is sampling-support replay — the trainer renormalises π_θ on the
    support the engine's filters leave, in vLLM's order (min-p, top-k, top-p).
    """

    min_p: float | None = None
    top_k: int | None = None
    top_p: float | None = None

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.min_p, self.top_k, self.top_p))

    @property
    def dvp_only(self) -> bool:
        """Only min-p: DVP's safe set (a threshold on the max logit, no sort)."""
        return self.min_p is not None and self.top_k is None and self.top_p is None

    @property
    def config(self) -> SamplingConfig:
        """The recipe as the trainer scores it, on logits already divided by verl's temperature (T = 1 here).

        >>> c = SamplingRecipe(top_k=50, top_p=0.95).config
        >>> c.temperature, c.top_k, c.top_p, c.min_p
        (1.0, 50, 0.95, None)
        """
        return SamplingConfig(temperature=1.0, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)

    def sampling_params(self) -> dict[str, Any]:
        """The keys the agent loop adds to verl's ``sampling_params`` (vLLM ``SamplingParams`` names)."""
        out: dict[str, Any] = {}
        if self.min_p is not None:
            out["min_p"] = self.min_p
        if self.top_k is not None:
            out["top_k"] = self.top_k
        if self.top_p is not None:
            out["top_p"] = self.top_p
        return out


@dataclass(frozen=True)
class ALPSettings:
    """ALP (arXiv 2603.19470): σ initial value, the σ group's learning rate, hooked layers, noise seed."""

    init_std: float = 1e-4
    lr: float = 5e-4
    layers: Any = "all"
    seed: int | None = None


@dataclass(frozen=True)
class VerlSettings:
    """The parsed block (see the module docstring). ``correction`` is the raw spec, checked by building it once."""

    correction: Any = None
    sampling: SamplingRecipe = field(default_factory=SamplingRecipe)
    alp: ALPSettings | None = None
    topk_logprobs: int = 0
    topk_bound: str = "upper"
    score_centering: bool = False
    naming: str = "verl"
    sync_check: str = "error"
    sync_check_timeout: float = SYNC_CHECK_TIMEOUT
    max_nonfinite_rollout: float | None = None
    allow_changed: tuple[str, ...] = ()
    plugin_transforms: tuple[Mapping[str, Any], ...] = ()  # plug-in transform specs, applied in the policy loss

    @property
    def any_engine_method(self) -> bool:
        return self.sampling.active or self.alp is not None


ENV_VAR = "OFFPOLICY_VERL"
NONFINITE_SETTING = f"{ENV_VAR}: max_nonfinite_rollout"  # what a batch refused for its non-finite μ names


def _refuse(where: str, text: str) -> ValueError:
    return ValueError(f"{ENV_VAR}: {where} {text}")


def _number(where: str, value: Any, *, low: float, high: float, integer: bool = False) -> Any:
    """``value`` if it is a real number (an int with ``integer``) in [low, high]; else a ``ValueError`` naming
    ``where``. A bool is not a number, and neither is text: ``'1e-4'`` quoted stays a string (unquoted, it is a
    float: :mod:`offpolicy.yaml_numbers`)."""
    kind = "an int" if integer else "a real number"
    ok = isinstance(value, numbers.Integral) if integer else isinstance(value, numbers.Real)
    if isinstance(value, bool) or not ok:
        raise _refuse(where, f"must be {kind}, got {value!r}")
    if not math.isfinite(float(value)) or not low <= value <= high:
        raise _refuse(where, f"must be {kind} in [{low}, {high}], got {value!r}")
    return value


def _mapping(where: str, value: Any, keys: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _refuse(where, f"must be a mapping with keys among {', '.join(keys)}, got {value!r}")
    for key in value:
        if key not in keys:
            raise _refuse(where, f"has no key {key!r}; known: {', '.join(keys)}")
    return value


def _matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` (parsed YAML / JSON) fits a factory parameter's type hint: float / int / bool / str, their
    ``| None`` and ``Literal`` forms; any other hint is left to the factory's own checks."""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint in (bool, str):
        return isinstance(value, hint)
    return True


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(hint))
    return {float: "a real number", int: "an int", bool: "true or false", str: "text",
            type(None): "null"}.get(hint, getattr(hint, "__name__", str(hint)))


def _check_correction(where: str, spec: Any) -> None:
    """Each entry of the correction spec: a registered name or ``{name: …, **params}`` whose parameters the factory
    takes, each of the type its signature declares — the error names the entry's path (``correction.upper``,
    ``correction[1].delta``) and the value, before the factory's own range checks run (their message gets the
    path too)."""
    from offpolicy.registry import CORRECTIONS

    if isinstance(spec, (list, tuple)):
        for i, entry in enumerate(spec):
            _check_correction(f"{where}[{i}]", entry)
        return
    if spec is None or isinstance(spec, str):
        name, params = spec, {}
    elif isinstance(spec, Mapping):
        params = dict(spec)
        name = params.pop("name", None)
        if not isinstance(name, str):
            raise _refuse(f"{where}.name", f"must be a registered correction's name, got {name!r}")
    else:
        raise _refuse(where, f"must be a correction's name, a mapping {{name: …, …}} or a list of them, got {spec!r}")
    if name is not None and name in CORRECTIONS.names():
        factory = CORRECTIONS[name]
        hints = typing.get_type_hints(factory)
        takes = [p for p in inspect.signature(factory).parameters.values() if p.kind is not p.VAR_KEYWORD]
        open_ended = len(takes) < len(inspect.signature(factory).parameters)
        for key in params:
            if not open_ended and key not in {p.name for p in takes}:
                raise _refuse(f"{where}.{key}", f"is not a parameter of {name!r}; it takes: "
                              f"{', '.join(p.name for p in takes) or 'none'}")
        for key, value in params.items():
            hint = hints.get(key, Any)
            if not _matches(value, hint):
                raise _refuse(f"{where}.{key}", f"must be {_describe(hint)}, got {value!r}")
    try:
        build_correction(spec)
    except (ValueError, TypeError) as err:
        message = str(err)
        first = message.split(" ", 1)[0]
        raise ValueError(f"{ENV_VAR}: {where}.{message}" if first in params
                         else f"{ENV_VAR}: {where}: {message}") from None


def _alp(value: Any) -> ALPSettings | None:
    if value is None or value is False:
        return None
    block = _mapping("alp", {} if value is True else value, ALP_KEYS)
    alp = ALPSettings(**block)
    _number("alp.init_std", alp.init_std, low=1e-12, high=10.0)
    _number("alp.lr", alp.lr, low=0.0, high=10.0)
    layers = alp.layers
    if layers != "all" and not (isinstance(layers, (list, tuple)) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in layers)):
        raise _refuse("alp.layers", f"must be 'all' or a list of layer indices, got {layers!r}")
    if alp.seed is not None:
        _number("alp.seed", alp.seed, low=0, high=2**63 - 1, integer=True)
    return alp


def _plain(value: Any) -> Any:
    """OmegaConf DictConfig / ListConfig → dict / list (verl hands either); anything else unchanged."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf comes with verl
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _choice(where: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices or not isinstance(value, str):
        raise _refuse(where, f"must be one of {', '.join(choices)}, got {value!r}")
    return value


def parse_settings(block: Mapping[str, Any] | None) -> VerlSettings:
    """Read the plug-in's block (a dict or an OmegaConf node; ``None`` → everything off).

    Every key is checked for its type and range; an error is one line naming the key's path:

    >>> s = parse_settings({"sampling": {"min_p": 0.01}, "alp": {}})
    >>> s.sampling.dvp_only, s.alp.init_std
    (True, 0.0001)
    >>> parse_settings({"samplng": {}})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: OFFPOLICY_VERL: unknown key 'samplng'; known: correction, sampling, alp, topk_logprobs, ..., allow_changed
    >>> parse_settings({"correction": {"name": "tis", "upper": "abc"}})
    Traceback (most recent call last):
    ...
    ValueError: OFFPOLICY_VERL: correction.upper must be a real number or null, got 'abc'
    """
    block = _plain(block)
    if block is None:
        return VerlSettings()
    if not isinstance(block, Mapping):
        raise ValueError(f"{ENV_VAR} must be a mapping, got {type(block).__name__}")  # noqa: TRY004
    from offpolicy.recipe.hosts import verl_block

    block = verl_block(block)  # a `recipe:` key, or a block that is itself a recipe, mapped onto the keys below
    for key in block:
        if key not in KNOWN_KEYS:
            raise ValueError(f"{ENV_VAR}: unknown key {key!r}; known: {', '.join(KNOWN_KEYS)}")
    correction = block.get("correction")
    _check_correction("correction", correction)  # an unknown correction or parameter fails here, before a step

    sampling = _mapping("sampling", block.get("sampling") or {}, SAMPLING_KEYS)
    min_p, top_k, top_p = (sampling.get(k) for k in SAMPLING_KEYS)
    if min_p is not None:
        _number("sampling.min_p", min_p, low=0.0, high=1.0)
        min_p = float(min_p) if min_p > 0 else None
    if top_k is not None:
        _number("sampling.top_k", top_k, low=-1, high=2**31, integer=True)
        top_k = int(top_k) if top_k > 0 else None
    if top_p is not None:
        _number("sampling.top_p", top_p, low=1e-9, high=1.0)
        top_p = float(top_p) if top_p < 1 else None
    alp = _alp(block.get("alp"))

    k = block.get("topk_logprobs", 0)
    _number("topk_logprobs", 0 if k is None else k, low=0, high=4096, integer=True)
    bound = _choice("topk_bound", block.get("topk_bound", "upper"), ("upper", "lower"))
    centering = block.get("score_centering", False)
    if not isinstance(centering, bool):
        raise _refuse("score_centering", f"must be true or false, got {centering!r}")
    if centering and not k:
        raise _refuse("score_centering", "needs the engine's top-K: set topk_logprobs: K (K >= 1)")
    if centering and any(v is not None for v in (min_p, top_k, top_p)):
        # the centre is Σ q̂ log p of the full tempered p: a recipe's truncated log-probs would need their own centre
        # (not built); ALP composes, its centre taken from the same noisy update forward as π_{θ,σ}
        raise _refuse("score_centering", "cannot be combined with sampling (DVP / replay)")
    naming = _choice("naming", block.get("naming", "verl"), ("verl", "offpolicy", "trl", "swift"))
    sync_check = block.get("sync_check", "error")
    if sync_check is False:  # YAML's bare `off` reads as false
        sync_check = "off"
    sync_check = _choice("sync_check", sync_check, SYNC_CHECK_MODES)
    timeout = block.get("sync_check_timeout")
    timeout = SYNC_CHECK_TIMEOUT if timeout is None else float(
        _number("sync_check_timeout", timeout, low=1e-3, high=86400.0))
    nonfinite = block.get("max_nonfinite_rollout")
    if nonfinite is not None:
        nonfinite = float(_number("max_nonfinite_rollout", nonfinite, low=0.0, high=1.0))
    allowed = block.get("allow_changed") or []
    if isinstance(allowed, str) or not isinstance(allowed, (list, tuple)) or not all(
            isinstance(a, str) and a for a in allowed):
        raise _refuse("allow_changed", f"must be a list of setting names (e.g. [correction.upper]), got {allowed!r}")
    return VerlSettings(correction=correction, sampling=SamplingRecipe(min_p, top_k, top_p), alp=alp,
                        topk_logprobs=int(k or 0), topk_bound=bound, score_centering=centering,
                        naming=naming, sync_check=sync_check, sync_check_timeout=timeout,
                        max_nonfinite_rollout=nonfinite,
                        allow_changed=tuple(allowed), plugin_transforms=_plugin_transforms(block.get("plugin_transforms")))


def _plugin_transforms(specs: Any) -> tuple[dict[str, Any], ...]:
    """The block's plug-in transforms, each checked (its name registered, its parameters) and with its defaults."""
    from offpolicy.registry import build_transform

    if specs is None:
        return ()
    if not isinstance(specs, (list, tuple)):
        raise _refuse("plugin_transforms", f"must be a list of plug-in transform specs, got {specs!r}")
    out = []
    for i, spec in enumerate(specs):
        try:
            t = build_transform(spec)
        except ValueError as err:
            raise _refuse(f"plugin_transforms[{i}]:", str(err)) from None
        if not t.plugin:
            raise _refuse(f"plugin_transforms[{i}]:", f"{t.name!r} is a built-in transform; set it with its own key "
                                               "(sampling, alp, topk_logprobs, score_centering) or in a recipe")
        if "engine_topk" in t.needs:  # the top-K reaches the engine's forward, not the policy loss's batch
            raise _refuse(f"plugin_transforms[{i}]:", f"{t.name!r} needs engine_topk, which verl's policy loss "
                                               "does not receive (the top-K feeds topk_bounds and score_centering "
                                               "in the engine); run it in TRL or the reference trainer")
        out.append({"name": t.name, **t.params})
    return tuple(out)


@functools.lru_cache(maxsize=8)
def _transforms_from_text(text: str | None) -> tuple[Mapping[str, Any], ...]:
    return settings_from_text(text).plugin_transforms


def transforms_from_environment() -> tuple[Mapping[str, Any], ...]:
    """The ``plugin_transforms`` of the ``OFFPOLICY_VERL`` block, read once per block text (the workers' policy
    loss runs them on each micro-batch)."""
    import os

    return _transforms_from_text(os.environ.get(ENV_VAR))


def settings_from_text(text: str | None) -> VerlSettings:
    """Parse the block from its YAML / JSON text (``None`` or blank → everything off).

    >>> settings_from_text("{sampling: {min_p: 0.05}}").sampling.min_p
    0.05
    """
    if text is None or not text.strip():
        return VerlSettings()
    import yaml

    from offpolicy.yaml_numbers import load_yaml, yaml_problem

    try:
        block = load_yaml(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{ENV_VAR} is not YAML / JSON: {yaml_problem(err)}") from None
    return parse_settings(block)


def settings_from_environment() -> VerlSettings:
    """The block from the ``OFFPOLICY_VERL`` environment variable (see the module docstring)."""
    import os

    return settings_from_text(os.environ.get(ENV_VAR))


@functools.lru_cache(maxsize=8)
def _nonfinite_from_text(text: str | None) -> float | None:
    return settings_from_text(text).max_nonfinite_rollout


def nonfinite_limit_from_environment() -> float | None:
    """``max_nonfinite_rollout`` of the ``OFFPOLICY_VERL`` block (None: unset), read once per block text: what the
    workers' policy loss, which verl calls per micro-batch, reads."""
    import os

    return _nonfinite_from_text(os.environ.get(ENV_VAR))

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
(arXiv 2609.20807, the proportional-tail rule of :func:`offpolicy.score_center_topk`); ``sync_check`` (``error``,
the default, ``warn`` or ``off``) runs the sync check after every weight sync of the plug-in's trainer
(:mod:`.sync_check`).

Every key is optional; an unknown key or a bad value is a ``ValueError`` naming it, raised when the block is read
(the engine's construction, the driver's first step), not deep inside a step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from offpolicy.registry import build_correction

KNOWN_KEYS = ("correction", "sampling", "alp", "topk_logprobs", "topk_bound", "score_centering", "naming",
              "sync_check")
SYNC_CHECK_MODES = ("error", "warn", "off")
# a batch's flag (verl non-tensor data) asking the plug-in's engine for the model's plain log-probs, log softmax(z / T),
# without the sampling recipe, top-K bounds or centring: the sync check's probe, which the engine side scores as
# vLLM's prompt log-probs (no sampler) — the two sides must compute the same thing
PLAIN_LOG_PROBS = "offpolicy_plain_log_probs"
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
        """Only min-p: the chunked :func:`~offpolicy.corrections.vocabulary.constrained_logp` path (no [N, V] copy)."""
        return self.min_p is not None and self.top_k is None and self.top_p is None

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

    @property
    def any_engine_method(self) -> bool:
        return self.sampling.active or self.alp is not None


def _number(where: str, value: Any, *, low: float, high: float, integer: bool = False) -> Any:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not math.isfinite(float(value)) or not low <= value <= high:
        kind = "an int" if integer else "a number"
        raise ValueError(f"offpolicy.{where} must be {kind} in [{low}, {high}], got {value!r}")
    return value


def _plain(value: Any) -> Any:
    """OmegaConf DictConfig / ListConfig → dict / list (verl hands either); anything else unchanged."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf comes with verl
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def parse_settings(block: Mapping[str, Any] | None) -> VerlSettings:
    """Read the plug-in's block (a dict or an OmegaConf node; ``None`` → everything off).

    >>> s = parse_settings({"sampling": {"min_p": 0.01}, "alp": {}})
    >>> s.sampling.dvp_only, s.alp.init_std
    (True, 0.0001)
    >>> parse_settings({"samplng": {}})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: offpolicy: unknown key 'samplng'; known: correction, sampling, alp, topk_logprobs, ..., sync_check
    """
    block = _plain(block)
    if block is None:
        return VerlSettings()
    if not isinstance(block, Mapping):
        raise ValueError(f"offpolicy settings must be a mapping, got {type(block).__name__}")  # noqa: TRY004
    for key in block:
        if key not in KNOWN_KEYS:
            raise ValueError(f"offpolicy: unknown key {key!r}; known: {', '.join(KNOWN_KEYS)}")
    correction = block.get("correction")
    build_correction(correction)  # an unknown correction or parameter fails here, before the first step

    sampling = block.get("sampling") or {}
    if not isinstance(sampling, Mapping) or any(k not in SAMPLING_KEYS for k in sampling):
        raise ValueError(f"offpolicy.sampling must be a mapping with keys among {SAMPLING_KEYS}, got {sampling!r}")
    min_p, top_k, top_p = (sampling.get(k) for k in SAMPLING_KEYS)
    if min_p is not None:
        _number("sampling.min_p", min_p, low=0.0, high=1.0)
        min_p = float(min_p) if min_p > 0 else None
    if top_k is not None:
        _number("sampling.top_k", top_k, low=-1, high=2**31, integer=True)
        top_k = top_k if top_k > 0 else None
    if top_p is not None:
        _number("sampling.top_p", top_p, low=1e-9, high=1.0)
        top_p = float(top_p) if top_p < 1 else None

    alp_block = block.get("alp")
    alp = None
    if alp_block is not None and alp_block is not False:
        alp_block = {} if alp_block is True else alp_block
        if not isinstance(alp_block, Mapping) or any(k not in ALP_KEYS for k in alp_block):
            raise ValueError(f"offpolicy.alp must be a mapping with keys among {ALP_KEYS}, got {alp_block!r}")
        alp = ALPSettings(**alp_block)
        _number("alp.init_std", alp.init_std, low=1e-12, high=10.0)
        _number("alp.lr", alp.lr, low=0.0, high=10.0)

    k = block.get("topk_logprobs", 0) or 0
    _number("topk_logprobs", k, low=0, high=4096, integer=True)
    bound = block.get("topk_bound", "upper")
    if bound not in ("upper", "lower"):
        raise ValueError(f"offpolicy.topk_bound must be 'upper' (certified) or 'lower', got {bound!r}")
    centering = block.get("score_centering", False)
    if not isinstance(centering, bool):
        raise ValueError(f"offpolicy.score_centering must be true or false, got {centering!r}")
    if centering and not k:
        raise ValueError("offpolicy.score_centering needs the engine's top-K: set topk_logprobs: K (K >= 1)")
    if centering and (alp is not None or any(v is not None for v in (min_p, top_k, top_p))):
        # the centre is Σ q̂ log p of the full tempered p: a recipe's truncated log-probs or ALP's noisy forward
        # would need their own centre (not built)
        raise ValueError("offpolicy.score_centering cannot be combined with sampling (DVP / replay) or alp")
    naming = block.get("naming", "verl")
    if naming not in ("verl", "offpolicy", "trl", "swift"):
        raise ValueError(f"offpolicy.naming must be one of verl, offpolicy, trl, swift; got {naming!r}")
    sync_check = block.get("sync_check", "error")
    if sync_check is False:  # YAML's bare `off` reads as false
        sync_check = "off"
    if sync_check not in SYNC_CHECK_MODES:
        raise ValueError(f"offpolicy.sync_check must be one of {', '.join(SYNC_CHECK_MODES)}; got {sync_check!r}")
    return VerlSettings(correction=correction, sampling=SamplingRecipe(min_p, top_k, top_p), alp=alp,
                        topk_logprobs=int(k), topk_bound=bound, score_centering=centering,
                        naming=naming, sync_check=sync_check)


ENV_VAR = "OFFPOLICY_VERL"


def settings_from_text(text: str | None) -> VerlSettings:
    """Parse the block from its YAML / JSON text (``None`` or blank → everything off).

    >>> settings_from_text("{sampling: {min_p: 0.05}}").sampling.min_p
    0.05
    """
    if text is None or not text.strip():
        return VerlSettings()
    import yaml

    try:
        block = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{ENV_VAR} is not YAML / JSON: {err}") from err
    return parse_settings(block)


def settings_from_environment() -> VerlSettings:
    """The block from the ``OFFPOLICY_VERL`` environment variable (see the module docstring)."""
    import os

    return settings_from_text(os.environ.get(ENV_VAR))

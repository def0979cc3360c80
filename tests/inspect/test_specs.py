"""Engine specs: parsing, side rules, and the engines they build."""

from __future__ import annotations

import pytest
import torch

from offpolicy.inspect.specs import ROLLOUT_SPECS, TRAINER_SPECS, build_inspect_engine, parse_spec
from offpolicy.rollout.spec import EngineSpec


def test_builtins_and_overrides():
    assert parse_spec("bf16", "rollout") == ROLLOUT_SPECS["bf16"]
    assert parse_spec("fp32", "trainer") == TRAINER_SPECS["fp32"]
    s = parse_spec("bf16, weight_bits=4, quantize_layers=2+3, lm_head_fp32=true", "rollout")
    assert (s.dtype, s.weight_bits, s.quantize_layers, s.lm_head_fp32, s.kv_cache) == ("bfloat16", 4, (2, 3), True, True)
    assert s.name == "bf16,weight_bits=4,quantize_layers=2+3,lm_head_fp32=true"  # a changed built-in: named as written
    s = parse_spec("dtype=fp16,kv_cache=false,noise=0.25", "rollout")
    assert (s.dtype, s.kv_cache, s.logit_noise, s.name) == ("float16", False, 0.25, "dtype=fp16,kv_cache=false,noise=0.25")
    # the framework names of the fp32 head are accepted as aliases
    assert parse_spec("bf16,cast_lm_head_to_fp32=1", "rollout").lm_head_fp32
    assert parse_spec("bf16,enable_fp32_lm_head=yes", "rollout").lm_head_fp32
    t = parse_spec("fp32,autocast=bf16", "trainer")
    assert (t.dtype, t.autocast, t.kv_cache) == ("float32", "bfloat16", False)
    assert TRAINER_SPECS["fp16-autocast"].autocast == "float16"
    assert ROLLOUT_SPECS["fp32-head"].lm_head_fp32 and ROLLOUT_SPECS["fp32-head"].dtype == "bfloat16"


@pytest.mark.parametrize("text, side, needle", [
    ("", "rollout", "empty engine spec"),
    ("bf17", "rollout", "unknown engine 'bf17'"),
    ("bf16,colour=red", "rollout", "unknown key 'colour'"),
    ("bf16,weight_bits=eight", "rollout", "weight_bits='eight' is not a valid value"),
    ("bf16,weight_bits=1", "rollout", "weight_bits must be None or an int in [2, 16]"),
    ("bf16,quantize_layers=2", "rollout", "quantize_layers needs weight_bits or kv_cache_bits"),
    ("bf16,quantize_layers=2+-1,weight_bits=4", "rollout", "quantize_layers must be non-empty layer indices"),
    ("dtype=int8", "rollout", "dtype must be one of fp32, bf16, fp16"),
    ("bf16,kv_cache=maybe", "rollout", "kv_cache='maybe' is not a valid value"),
    ("bf16,noise=-1", "rollout", "logit_noise must be a finite float"),
    ("bf16,autocast=bf16", "rollout", "autocast"),
    ("fp32,kv_cache_bits=8", "trainer", "kv_cache_bits — a trainer scores with one full forward"),
    ("fp32,noise=0.1", "trainer", "logit_noise"),
    ("fp32,kv_cache=true", "trainer", "kv_cache=true"),
    ("fp32,backend=vllm", "trainer", "backend='vllm'"),
    ("bf16,autocast=fp16", "trainer", "autocast='float16' needs dtype=float32 weights"),
    ("fp32,autocast=fp32", "trainer", "needs dtype=float32 weights and a 16-bit compute dtype"),
])
def test_bad_specs_name_the_option_and_key(text, side, needle):
    with pytest.raises(ValueError, match=f"--{side}") as err:
        parse_spec(text, side)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_describe():
    assert ROLLOUT_SPECS["w8kv8"].describe() == "bfloat16 + KV cache + int8 weights + int8 KV cache"
    assert TRAINER_SPECS["bf16-autocast"].describe() == "float32 weights, bfloat16 autocast"
    assert EngineSpec(dtype="fp32", kv_cache_bits=4, quantize_layers=(1,)).describe() == (
        "float32 + KV cache + int4 KV cache (layers 1)")


def test_build_inspect_engine_applies_every_knob(tiny):
    model, tok = tiny
    engine = build_inspect_engine(model, parse_spec("fp16,weight_bits=4,kv_cache_bits=8,quantize_layers=1,lm_head_fp32=1,"
                                            "noise=0.5,kv_cache=false", "rollout"), tok)
    assert engine.dtype == torch.float16 and not engine.kv_cache
    assert (engine.weight_bits, engine.kv_cache_bits, engine.quantize_layers) == (4, 8, frozenset({1}))
    assert engine.lm_head_fp32 and engine.logit_noise == 0.5
    assert engine.model.lm_head.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="backend='vllm'"):
        build_inspect_engine(model, EngineSpec(backend="vllm"))


def test_quant_specs_parse_by_format_name_or_alias_and_build_the_engine(tiny):
    from offpolicy.rollout.quant_formats import QUANT_FORMATS
    from offpolicy.rollout.spec import QUANT_LABELS

    assert set(QUANT_LABELS) == set(QUANT_FORMATS)
    s = parse_spec("backend=hf,quant=w4a4", "rollout")
    assert (s.quant, s.dtype, s.backend) == ("nvfp4", "bfloat16", "hf")  # the alias is stored by the format's name
    assert s.describe() == "bfloat16 + KV cache + NVFP4 W4A4"
    assert parse_spec("w4a4", "rollout") == ROLLOUT_SPECS["w4a4"] and ROLLOUT_SPECS["w4a16"].quant == "nvfp4a16"
    s = parse_spec("fp32,quantization=fp8-dynamic,quantize_layers=1", "rollout")  # vLLM's key name as an alias
    assert s.describe() == "float32 + KV cache + fp8 W8A8 (per-channel weights, per-token activations) (layers 1)"
    for name in ("fp8", "fp8-dynamic", "fp8-block", "mxfp8"):
        assert ROLLOUT_SPECS[name].quant == name
    model, tok = tiny
    engine = build_inspect_engine(model, parse_spec("fp32,quant=mxfp8,quantize_layers=2", "rollout"), tok)
    assert (engine.quant, engine.quantize_layers) == ("mxfp8", frozenset({2}))
    lin = engine.model.model.layers[2].mlp.up_proj
    assert torch.equal(lin.weight, QUANT_FORMATS["mxfp8"].weight(model.model.layers[2].mlp.up_proj.weight))


@pytest.mark.parametrize("text, needle", [
    ("bf16,quant=int3", "quant must be one of"),
    ("bf16,quant=fp8,weight_bits=4", "both quantise the weights"),
    ("backend=vllm,quant=fp8", "simulated knob of the transformers engine"),
    ("backend=llamacpp,quant=nvfp4", "simulated knob of the transformers engine"),
])
def test_bad_quant_specs(text, needle):
    with pytest.raises(ValueError, match="--rollout") as err:
        parse_spec(text, "rollout")
    assert needle in str(err.value) and "\n" not in str(err.value)

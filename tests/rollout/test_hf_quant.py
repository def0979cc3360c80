"""HF engine's ``quant=`` (fp8 W8A8, MXFP8, NVFP4 W4A4 / W4A16): which tensors are quantised, and how."""

from __future__ import annotations

import copy

import pytest
import torch

from offpolicy.rollout.hf import HFRolloutEngine
from offpolicy.rollout.quant_formats import QUANT_FORMATS, fp8_e4m3, nvfp4
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.scoring import sequence_logprobs

CFG = SamplingConfig(max_new_tokens=6)
# scales per token / per block of a token: a row's numerics do not depend on the batch or the step
ROW_LOCAL = ("fp8-dynamic", "fp8-block", "mxfp8", "nvfp4", "nvfp4a16")


def _linears(module):
    return {n: m for n, m in module.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n}


@pytest.mark.parametrize("name", sorted(QUANT_FORMATS))
def test_decoder_weights_are_the_format_of_the_engine_dtype_copy(tiny, name):
    model, _ = tiny
    engine = HFRolloutEngine(model, dtype="bfloat16", quant=name)
    src, dst = _linears(model), _linears(engine.model)
    assert src.keys() == dst.keys() and len(src) == 7 * model.config.num_hidden_layers
    for key, lin in src.items():
        assert torch.equal(dst[key].weight, QUANT_FORMATS[name].weight(lin.weight.bfloat16())), key
    assert torch.equal(engine.model.lm_head.weight, model.lm_head.weight.bfloat16())  # lm_head / embeddings kept
    assert torch.equal(engine.model.model.embed_tokens.weight, model.model.embed_tokens.weight.bfloat16())


@pytest.mark.parametrize("name", ["fp8", "fp8-dynamic", "nvfp4", "nvfp4a16"])
def test_each_linear_multiplies_the_quantised_input(tiny, name):
    """Output of every decoder Linear = its (quantised) weight times the format's activation of its raw input."""
    model, _ = tiny
    engine = HFRolloutEngine(model, dtype="float32", quant=name)
    act = QUANT_FORMATS[name].activation
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, lin in _linears(engine.model).items():
        lin.register_forward_pre_hook(lambda m, a, key=key: seen.__setitem__(key, (a[0].clone(),)), prepend=True)
        lin.register_forward_hook(lambda m, a, out, key=key: seen.__setitem__(key, (*seen[key], out)))
    engine.model(input_ids=torch.tensor([[1, 19, 13, 21], [4, 5, 6, 7]]))
    assert len(seen) == 7 * model.config.num_hidden_layers
    for key, (raw, out) in seen.items():
        lin = _linears(engine.model)[key]
        x = raw if act is None else act(raw)
        assert torch.equal(out, torch.nn.functional.linear(x, lin.weight, lin.bias)), key
    if name == "fp8":  # one scale for the whole [B, T, K] input: not the same as per token
        raw = seen["model.layers.0.mlp.down_proj"][0]
        assert not torch.equal(fp8_e4m3(raw), fp8_e4m3(raw, rows=1))
    if name == "nvfp4":  # activations: the fp32 scale per token, not per tensor
        raw = seen["model.layers.0.mlp.down_proj"][0]
        assert torch.equal(act(raw)[1:], nvfp4(raw[1:], tensor_rows=1))


def test_quantize_layers_restricts_quant(tiny):
    model, _ = tiny
    engine = HFRolloutEngine(model, dtype="float32", quant="w4a4", quantize_layers=[2])
    assert engine.quant == "nvfp4"
    for i, (src, dst) in enumerate(zip(model.model.layers, engine.model.model.layers)):
        for key, lin in _linears(src).items():
            want = nvfp4(lin.weight) if i == 2 else lin.weight
            assert torch.equal(_linears(dst)[key].weight, want), (i, key)
        hooked = [bool(lin._forward_pre_hooks) for lin in _linears(dst).values()]
        assert all(hooked) if i == 2 else not any(hooked)


def test_sync_weights_requantises(tiny):
    model, _ = tiny
    trained = copy.deepcopy(model)
    engine = HFRolloutEngine(model, dtype="bfloat16", quant="mxfp8")
    with torch.no_grad():
        trained.model.layers[1].mlp.up_proj.weight.mul_(1.7)
    engine.sync_weights(trained)
    got = engine.model.model.layers[1].mlp.up_proj.weight
    assert torch.equal(got, QUANT_FORMATS["mxfp8"].weight(trained.model.layers[1].mlp.up_proj.weight.bfloat16()))


@pytest.mark.parametrize("name", ROW_LOCAL)
def test_generated_logp_equals_direct_rescore_for_row_local_formats(tiny, prompts, name):
    """Per-token / per-block scales: decoding with the KV cache and one full forward quantise each row the same
    way, so score() reproduces μ (to fp32 rounding) and inspect's direct computation holds."""
    model, tok = tiny
    engine = HFRolloutEngine(model, tokenizer=tok, dtype="float32", quant=name)
    out = engine.generate(prompts, CFG, seed=0)
    direct, mask = engine.score(out.prompt_ids, out.completion_ids, CFG)
    assert torch.equal(mask, out.mask)
    assert (direct - out.logp).abs()[out.mask].max() < 1e-4


def test_activation_quantisation_adds_mismatch_w4a4_most(sharp, prompts):
    """Mean |log μ − log π| of the sampled tokens against the fp32 model: 0 for an fp32 engine, larger for fp8 W8A8,
    larger still for NVFP4 W4A16 and W4A4 (4-bit values; W4A4 also rounds every Linear's input)."""
    model, tok = sharp
    gaps = {}
    for name in (None, "fp8-dynamic", "nvfp4a16", "nvfp4"):
        engine = HFRolloutEngine(model, tokenizer=tok, dtype="float32", quant=name)
        out = engine.generate(prompts, SamplingConfig(max_new_tokens=12), seed=0)
        pi, _ = sequence_logprobs(model, out.prompt_ids, out.completion_ids)
        gaps[name] = (out.logp - pi).abs()[out.mask].mean().item()
    assert gaps[None] < 1e-5
    assert gaps[None] * 100 < gaps["fp8-dynamic"] < gaps["nvfp4a16"] < gaps["nvfp4"], gaps


def test_bad_quant_options(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="quant must be one of .*got 'int3'"):
        HFRolloutEngine(model, quant="int3")
    with pytest.raises(ValueError, match="both quantise the weights"):
        HFRolloutEngine(model, quant="fp8", weight_bits=8)
    HFRolloutEngine(model, quant="fp8", kv_cache_bits=8, quantize_layers=[0])  # KV cache and layers combine

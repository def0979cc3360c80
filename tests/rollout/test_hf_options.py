"""HF engine options for bisecting a mismatch: quantisation restricted to chosen decoder layers, an fp32 lm_head."""

from __future__ import annotations

import pytest
import torch

from offpolicy.rollout.hf import HFRolloutEngine, fake_quantize
from offpolicy.rollout.sampling import SamplingConfig

CFG = SamplingConfig(max_new_tokens=6)


def _linears(layer):
    return {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}


@pytest.mark.parametrize("bits", [8, 4])
def test_weight_quantisation_only_in_the_chosen_layers(tiny, bits):
    model, _ = tiny
    engine = HFRolloutEngine(model, dtype="float32", weight_bits=bits, quantize_layers=[2])
    for i, (src, dst) in enumerate(zip(model.model.layers, engine.model.model.layers)):
        for name, lin in _linears(src).items():
            got = _linears(dst)[name].weight
            want = fake_quantize(lin.weight, bits, dim=1) if i == 2 else lin.weight
            assert torch.equal(got, want), (i, name)
    # everything outside the decoder layers is untouched
    assert torch.equal(engine.model.lm_head.weight, model.lm_head.weight)
    assert torch.equal(engine.model.model.norm.weight, model.model.norm.weight)


def test_kv_quantisation_only_in_the_chosen_layers(tiny):
    model, _ = tiny
    engine = HFRolloutEngine(model, dtype="float32", kv_cache_bits=4, quantize_layers=[1])
    cache = engine._new_cache()
    ids = torch.tensor([[1, 19, 13, 21]])
    engine.model(input_ids=ids, use_cache=True, **{engine._cache_kw: cache})
    plain = HFRolloutEngine(model, dtype="float32")._new_cache()
    plain_engine = HFRolloutEngine(model, dtype="float32")
    plain_engine.model(input_ids=ids, use_cache=True, **{plain_engine._cache_kw: plain})
    k0, k1 = cache.layers[0].keys, cache.layers[1].keys
    assert torch.equal(k0, plain.layers[0].keys)  # layer 0 stores what an unquantised engine stores
    assert torch.equal(k1, fake_quantize(k1, 4))  # layer 1's keys lie on the int4 grid …
    assert not torch.equal(fake_quantize(k0, 4), k0)  # … which layer 0's do not


@pytest.mark.parametrize("kwargs", [
    {"dtype": "bfloat16", "weight_bits": 4, "quantize_layers": [0, 3]},
    {"dtype": "float32", "kv_cache_bits": 4, "quantize_layers": [2]},
    {"dtype": "bfloat16", "lm_head_fp32": True},
    {"dtype": "float16", "lm_head_fp32": True, "kv_cache_bits": 8},
])
def test_generated_logp_equals_direct_rescore(tiny, prompts, kwargs):
    model, tok = tiny
    engine = HFRolloutEngine(model, tokenizer=tok, **kwargs)
    out = engine.generate(prompts, CFG, seed=0)
    direct, mask = engine.score(out.prompt_ids, out.completion_ids, CFG)
    assert torch.equal(mask, out.mask)
    # fp16: KV-cache decoding and a full forward round in different orders — 1.8e-4 nats on this model measured with
    # a plain fp16 engine already; bf16's coarser grid happens to hide it here, fp32 is exact to 1e-6.
    tol = 1e-3 if kwargs["dtype"] == "float16" else 1e-5
    assert (direct - out.logp).abs()[out.mask].max() < tol


def test_fp32_lm_head_is_trls_cast(tiny):
    """Logits = fp32(h) @ W_fp32ᵀ with the trainer's exact fp32 weights; the tied embedding keeps its bf16 copy."""
    model, tok = tiny
    engine = HFRolloutEngine(model, tokenizer=tok, dtype="bfloat16", lm_head_fp32=True)
    head, emb = engine.model.lm_head, engine.model.model.embed_tokens
    assert head.weight.dtype == torch.float32 and emb.weight.dtype == torch.bfloat16
    assert head.weight is not emb.weight  # untied in the engine's copy only
    assert torch.equal(head.weight, model.lm_head.weight)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the trainer's model is not touched
    hidden = {}
    engine.model.model.norm.register_forward_hook(lambda m, a, o: hidden.setdefault("h", o))
    logits = engine.model(input_ids=torch.tensor([[1, 19, 13]])).logits
    assert hidden["h"].dtype == torch.bfloat16 and logits.dtype == torch.float32
    assert torch.equal(logits, torch.nn.functional.linear(hidden["h"].float(), model.lm_head.weight))
    plain = HFRolloutEngine(model, tokenizer=tok, dtype="bfloat16")
    assert not torch.equal(plain.model(input_ids=torch.tensor([[1, 19, 13]])).logits.float(), logits)


def test_fp32_lm_head_follows_sync_weights(tiny):
    import copy

    model, tok = tiny
    trained = copy.deepcopy(model)
    engine = HFRolloutEngine(model, dtype="bfloat16", lm_head_fp32=True)
    with torch.no_grad():
        trained.model.embed_tokens.weight.add_(0.01)  # tied: moves the trainer's lm_head too
    engine.sync_weights(trained)
    assert torch.equal(engine.model.lm_head.weight, trained.lm_head.weight)
    assert torch.equal(engine.model.model.embed_tokens.weight, trained.model.embed_tokens.weight.bfloat16())


def test_bad_options(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="quantize_layers needs weight_bits or kv_cache_bits"):
        HFRolloutEngine(model, quantize_layers=[1])
    with pytest.raises(ValueError, match=r"indices in \[0, 4\), got \[4\]"):
        HFRolloutEngine(model, weight_bits=8, quantize_layers=[4])
    with pytest.raises(ValueError, match="quantize_layers must be a list"):
        HFRolloutEngine(model, weight_bits=8, quantize_layers=2)
    with pytest.raises(ValueError, match="non-empty list"):
        HFRolloutEngine(model, weight_bits=8, quantize_layers=[])

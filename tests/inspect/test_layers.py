"""Per-layer localisation: an engine that differs from the trainer in one decoder layer is found at that layer."""

from __future__ import annotations

import pytest

from offpolicy.inspect.layers import first_divergent, hook_points, layer_errors, layer_shares
from offpolicy.inspect.measurements import LayerError
from offpolicy.inspect.run import inspect_engines
from offpolicy.inspect.specs import build_inspect_engine
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.spec import EngineSpec

TRAINER = EngineSpec("fp32", dtype="float32", kv_cache=False, attn_implementation=None)


def _errors(model, spec, prompts, completions):
    return layer_errors(build_inspect_engine(model, spec), build_inspect_engine(model, TRAINER), prompts, completions)


@pytest.mark.parametrize("layer", [0, 2, 3])
@pytest.mark.parametrize("knob", ["weight_bits", "kv_cache_bits"])
def test_one_layer_different_is_found_there(random_lm, random_prompts, layer, knob):
    """fp32 engine, int4 weights (or int4 KV cache) in one decoder layer only: every point before it agrees to
    float32 noise, the layer itself jumps above the threshold, and it carries most of the growth."""
    kind, model = random_lm
    completions = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14]]
    errs = _errors(model, EngineSpec(dtype="float32", quantize_layers=(layer,), **{knob: 4}), random_prompts,
                   completions)
    names = [e.name for e in errs]
    assert names == ["embed", "layer.0", "layer.1", "layer.2", "layer.3", "final_norm", "logits"]
    at = names.index(f"layer.{layer}")
    assert all(e.rel_error < 1e-5 for e in errs[:at]), (kind, errs)  # eager vs sdpa: float32 reduction order only
    assert errs[at].rel_error > 1e-2, (kind, errs)
    assert first_divergent(errs) == f"layer.{layer}"
    shares = layer_shares(errs)
    assert max(range(len(shares)), key=shares.__getitem__) == at


def test_embedded_model_and_real_engines(tiny, prompts):
    """On the embedded architecture: int4 weights in layer 2 only (bf16 otherwise off: fp32) → layer.2; a bf16 engine
    rounds its parameters, so the divergence enters at the embeddings."""
    model, _ = tiny
    completions = [[21, 22, 2], [23], [24, 25], [26, 27, 28], [2], [29]]
    errs = _errors(model, EngineSpec(dtype="float32", weight_bits=4, quantize_layers=(2,)), prompts, completions)
    assert first_divergent(errs) == "layer.2"
    bf16 = _errors(model, EngineSpec(dtype="bfloat16"), prompts, completions)
    assert first_divergent(bf16) == "embed"
    assert 1e-3 < bf16[0].rel_error < 4e-3  # one bf16 rounding of the embedding rows: ≈ 2^-9 relative
    same = _errors(model, EngineSpec(dtype="float32", attn_implementation=None), prompts, completions)
    assert first_divergent(same) is None and max(e.rel_error for e in same) == 0.0


def test_inspect_engines_reports_the_layer(random_lm, random_prompts):
    kind, model = random_lm
    m = inspect_engines(model, random_prompts, EngineSpec(dtype="float32", weight_bits=4, quantize_layers=(1,)),
                        TRAINER, SamplingConfig(max_new_tokens=5), dvp_rhos=None)
    assert first_divergent(m.layers, m.layer_threshold) == "layer.1"
    assert "layers_s" in m.meta["timings"]


def test_hook_points_of_llama(random_lm):
    kind, model = random_lm
    names = [name for name, _ in hook_points(model)]
    assert names[0] == "embed" and names[-2:] == ["final_norm", "logits"] and len(names) == 4 + 3


def test_shares_and_first_by_hand():
    # errors 0, 0.01, 0.005, 0.045: increments 0, 0.01, 0 (a decrease counts 0), 0.04 → shares 0, 0.2, 0, 0.8
    errs = [LayerError("embed", 0.0), LayerError("layer.0", 0.01), LayerError("layer.1", 0.005),
            LayerError("layer.2", 0.045)]
    assert layer_shares(errs) == pytest.approx([0.0, 0.2, 0.0, 0.8])
    assert first_divergent(errs, 0.02) == "layer.2" and first_divergent(errs, 0.001) == "layer.0"
    assert first_divergent(errs, 0.1) is None
    assert layer_shares([LayerError("embed", 0.0)]) == [0.0]


def test_layer_errors_refuses_mismatched_inputs(tiny):
    model, _ = tiny
    engine = build_inspect_engine(model, TRAINER)
    with pytest.raises(ValueError, match="same length"):
        layer_errors(engine, engine, [[1, 2]], [])

"""The engine factory: every backend built from one EngineSpec, the registry's one-line errors, a backend registered
from a plug-in file and run by the trainer through its config, and the trainer / inspect / warm start all building engines
through the registry."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from offpolicy_testkit.stub_server import stub_servers

import offpolicy as op
from offpolicy.rollout import ENGINE_BUILDERS, EngineSpec, build_engine, engine_backends, register_engine
from offpolicy.rollout.hf import HFRolloutEngine
from offpolicy.rollout.protocols import VLLMProtocol
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.server_engine import ServerRolloutEngine

DATA = Path(__file__).parent / "data"
HAS_VLLM = importlib.util.find_spec("vllm") is not None
CFG = SamplingConfig(max_new_tokens=4)


def test_the_public_names_are_one_object():
    assert op.EngineSpec is EngineSpec and op.build_engine is build_engine and op.register_engine is register_engine
    assert engine_backends() == ("hf", "llamacpp", "server", "vllm")


# -- each built-in backend from a spec ---------------------------------------------------------------------------------


def test_hf_from_a_spec_is_the_engine_built_by_hand(tiny, prompts):
    model, tok = tiny
    spec = EngineSpec.parse("backend=hf,dtype=fp32,quant=w4a4,kv_cache_bits=8,quantize_layers=1,sampler=inverse_cdf")
    engine = build_engine(spec, model=model, tokenizer=tok)
    assert isinstance(engine, HFRolloutEngine)
    assert (engine.dtype, engine.quant, engine.kv_cache_bits, engine.quantize_layers, engine.sampler) == (
        torch.float32, "nvfp4", 8, frozenset({1}), "inverse_cdf")
    by_hand = HFRolloutEngine(model, dtype="float32", quant="nvfp4", kv_cache_bits=8, quantize_layers=[1],
                              sampler="inverse_cdf", tokenizer=tok)
    a, b = engine.generate(prompts, CFG, seed=3), by_hand.generate(prompts, CFG, seed=3)
    assert a.completion_ids == b.completion_ids and torch.equal(a.logp, b.logp)
    # the format is applied: the same tokens scored by a plain fp32 engine get other log-probs
    plain = build_engine(EngineSpec(dtype="float32"), model=model, tokenizer=tok)
    mask = a.mask
    assert not torch.equal(plain.score(a.prompt_ids, a.completion_ids, CFG)[0][mask], a.logp[mask])


def test_hf_dtype_and_knobs_reach_the_engine(tiny):
    model, tok = tiny
    engine = build_engine(EngineSpec.parse("dtype=bf16,kv_cache=false,noise=0.5,lm_head_fp32=1,weight_bits=4"),
                          model=model, tokenizer=tok)
    assert engine.model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert engine.model.lm_head.weight.dtype == torch.float32
    assert (engine.kv_cache, engine.logit_noise, engine.weight_bits, engine.tokenizer) == (False, 0.5, 4, tok)
    with pytest.raises(ValueError, match="backend=hf builds on a transformers model: pass model="):
        build_engine(EngineSpec())


def test_llamacpp_from_a_spec(tiny, prompts):
    pytest.importorskip("xllamacpp")
    pytest.importorskip("gguf")
    from offpolicy.rollout.llamacpp import LlamaCppRolloutEngine

    model, tok = tiny
    engine = build_engine(EngineSpec.parse("backend=llamacpp,weights=q8_0,kv_cache_bits=8,threads=1"), model=model,
                          tokenizer=tok)
    try:
        assert isinstance(engine, LlamaCppRolloutEngine)
        assert (engine.weights, engine.kv_cache_type, engine.server.threads) == ("q8_0", "q8_0", 1)
        out = engine.generate(prompts[:2], CFG, seed=0)
        assert out.mask.any() and bool(torch.isfinite(out.logp[out.mask]).all())
    finally:
        engine.close()
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        build_engine(EngineSpec(backend="llamacpp"), model=model)


def test_llamacpp_kv_cache_type_by_name_or_bits():
    from offpolicy.rollout.llamacpp import KV_CACHE_TYPES
    from offpolicy.rollout.spec import LLAMACPP_KV_TYPES

    assert LLAMACPP_KV_TYPES == KV_CACHE_TYPES  # the spec's copy of llama.cpp's types
    assert EngineSpec(backend="llamacpp", weights="f16", kv_cache_type="bf16").describe() == (
        "llama.cpp F16 weights + bf16 KV cache")
    with pytest.raises(ValueError, match="without kv_cache_bits"):
        EngineSpec(backend="llamacpp", kv_cache_type="f16", kv_cache_bits=8)
    with pytest.raises(ValueError, match="kv_cache_type must be one of"):
        EngineSpec(backend="llamacpp", kv_cache_type="q5_k")


PROCESSED = {"vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs"}}}  # a dev-mode /server_info


@pytest.fixture
def stub():
    with stub_servers() as start:
        yield start


def test_server_client_from_a_spec_detects_the_protocol_and_reads_the_vocabulary(tiny, stub, tmp_path):
    model, tok = tiny
    completion = json.loads((DATA / "vllm_completions.json").read_text())
    url, log = stub({"/v1/models": {"data": [{"id": "lab", "owned_by": "vllm"}]}, "/v1/completions": completion,
                     "/server_info": PROCESSED})
    engine = build_engine(EngineSpec.parse(f"server={url},timeout=5,weights_dir={tmp_path}"), model=model)
    assert isinstance(engine, ServerRolloutEngine) and isinstance(engine.protocol, VLLMProtocol)
    assert engine.protocol.model == "lab"  # detected: /props and /get_model_info answer 404, /v1/models is vLLM's
    assert (engine.url, engine.timeout, engine.weights_dir) == (url, 5.0, tmp_path)
    assert engine.vocab_size == model.config.vocab_size
    out = engine.generate([[1, 19, 31]], SamplingConfig(max_new_tokens=3, logprobs_topk=2), seed=7)
    assert out.completion_ids == [[20, 223, 2]]
    assert [p for p, _ in log] == ["/props", "/get_model_info", "/v1/models", "/server_info", "/v1/models",
                                   "/v1/completions"]
    # protocol given: no detection requests; the log-prob mode and the served model's name only
    url2, log2 = stub({"/v1/models": {"data": [{"id": "lab", "owned_by": "vllm"}]}, "/server_info": PROCESSED})
    assert isinstance(build_engine(EngineSpec(server=url2, protocol="vllm")).protocol, VLLMProtocol)
    assert [p for p, _ in log2] == ["/server_info", "/v1/models"]


class _RecordedVLLM:
    """Stands in for VLLMRolloutEngine: records how the factory calls it (vLLM itself starts in the GPU test)."""

    calls: list[tuple[str, object, dict]] = []

    def __init__(self, model_path, **kwargs):
        _RecordedVLLM.calls.append(("path", model_path, kwargs))

    @classmethod
    def from_model(cls, model, tokenizer, **kwargs):
        cls.calls.append(("model", model, kwargs))
        return cls.__new__(cls)


def test_vllm_spec_reaches_vllms_settings(tiny, monkeypatch):
    import offpolicy.rollout.vllm as vllm_module

    model, tok = tiny
    monkeypatch.setattr(vllm_module, "VLLMRolloutEngine", _RecordedVLLM)
    monkeypatch.setattr(_RecordedVLLM, "calls", [])
    spec = EngineSpec.parse("backend=vllm,dtype=fp32,kv_cache_dtype=fp8,max_model_len=256,max_logprobs=-1,seed=7")
    build_engine(spec, model=model, tokenizer=tok)
    build_engine(EngineSpec(backend="vllm", record_routes=True), model_path="/models/lab", tokenizer=tok)
    assert _RecordedVLLM.calls == [
        ("model", model, {"dtype": "float32", "max_logprobs": -1, "seed": 7, "kv_cache_dtype": "fp8",
                          "max_model_len": 256}),
        ("path", "/models/lab", {"tokenizer": tok, "dtype": "bfloat16", "max_logprobs": 20, "seed": 0,
                                 "record_routes": True}),
    ]
    with pytest.raises(ValueError, match="needs the model's tokenizer or a local model directory"):
        build_engine(EngineSpec(backend="vllm"), model=model)


@pytest.mark.skipif(not (HAS_VLLM and torch.cuda.is_available()), reason="vLLM in-process needs a CUDA GPU here")
def test_vllm_from_a_spec_samples(tiny, prompts, tmp_path):
    model, tok = tiny
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    engine = build_engine(EngineSpec(backend="vllm", dtype="float32", max_logprobs=4), model_path=str(tmp_path),
                          tokenizer=tok)
    out = engine.generate(prompts[:2], SamplingConfig(max_new_tokens=4, logprobs_topk=4), seed=0)
    assert out.mask.any() and out.topk_ids is not None and out.topk_ids.shape[-1] == 4


# -- errors ------------------------------------------------------------------------------------------------------------


def test_unknown_backend_is_one_line_listing_the_registered_ones():
    with pytest.raises(ValueError, match=r"backend must be one of hf, llamacpp, server, vllm .*got 'tgi'") as err:
        EngineSpec(backend="tgi")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unknown key 'colour'"):
        EngineSpec.parse("backend=hf,colour=red")


@pytest.mark.parametrize("spec, needle", [
    (EngineSpec(backend="vllm", sampler="inverse_cdf"), "backend='vllm' cannot honour sampler='inverse_cdf'"),
    (EngineSpec(backend="vllm", weight_bits=8), "backend='vllm' cannot honour weight_bits=8"),
    (EngineSpec(seed=3, max_model_len=64), "backend='hf' cannot honour max_model_len=64, seed=3"),
    (EngineSpec(backend="llamacpp", timeout=5.0), "backend='llamacpp' cannot honour timeout=5.0"),
    (EngineSpec(server="http://127.0.0.1:1", threads=2), "backend='server' cannot honour threads=2"),
])
def test_a_field_the_backend_cannot_honour_is_named(spec, needle):
    with pytest.raises(ValueError) as err:
        build_engine(spec)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("kwargs, needle", [
    ({"backend": "vllm", "quant": "fp8"}, "quant='fp8' is a simulated knob of the transformers engine"),
    ({"backend": "llamacpp", "weight_bits": 4}, "weight_bits is a simulated knob"),
    ({"sampler": "greedy"}, "sampler must be one of inverse_cdf, multinomial"),
    ({"threads": 0}, "threads must be an int ≥ 1"),
    ({"max_logprobs": -2}, "max_logprobs must be an int ≥ -1"),
    ({"timeout": 0}, "timeout must be a number of seconds > 0"),
    ({"compile": "yes"}, "compile must be true or false"),
])
def test_bad_fields_are_refused_when_the_spec_is_made(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        EngineSpec(**kwargs)


def test_a_taken_name_is_not_silently_replaced():
    def other(spec, *, model=None, tokenizer=None, model_path=None):
        return None

    with pytest.raises(ValueError, match="engine backend 'hf' is already registered"):
        register_engine("hf", other)
    assert ENGINE_BUILDERS["hf"].fn.__name__ == "build_hf_engine"


def test_a_builder_registered_with_a_field_engine_spec_lacks_is_refused_when_used():
    register_engine("typo_fields", lambda spec, **kw: "built", fields=("colour",))
    try:
        with pytest.raises(ValueError, match=r"registered with fields=\['colour'\], which EngineSpec does not have"):
            build_engine(EngineSpec(backend="typo_fields"))
    finally:
        ENGINE_BUILDERS.unregister("typo_fields")


# -- one file + one registration: a plug-in backend run by the trainer ------------------------------------------------

PLUGIN = '''
from offpolicy.rollout import register_engine
from offpolicy.rollout.hf import HFRolloutEngine

SPECS = []


class CountingEngine(HFRolloutEngine):
    """The transformers engine, counting the rollouts it generates."""

    generated = 0

    def generate(self, *args, **kwargs):
        CountingEngine.generated += 1
        return super().generate(*args, **kwargs)


@register_engine("counting")
def build_counting(spec, *, model=None, tokenizer=None, model_path=None):
    SPECS.append(spec)
    return CountingEngine(model, dtype=spec.dtype, tokenizer=tokenizer)
'''

TINY = "{num_hidden_layers: 2, hidden_size: 32, intermediate_size: 64, num_attention_heads: 2, num_key_value_heads: 1}"


def test_a_backend_registered_by_a_plugin_file_is_the_trainers_engine(tmp_path, varying_task):
    from offpolicy.train import load_config, train

    plugin = tmp_path / "counting_engine.py"
    plugin.write_text(PLUGIN)
    overrides = [f"plugins=[{plugin}]", "rollout.engine=counting", "rollout.dtype=float32",
                 "model.path=tiny-random", f"model.tiny_config={TINY}", "run.steps=2",
                 f"run.out_dir={tmp_path / 'run'}",
                 "run.progress=false", "run.tensorboard=false", "task.prompts_per_step=2", "algorithm.group_size=2",
                 "rollout.sampling.max_new_tokens=4"]
    try:
        cfg = load_config(None, overrides)
        assert cfg.rollout.engine == "counting" and cfg.rollout.sync_check_action == "error"
        result = train(cfg, task=varying_task())
        module = sys.modules["counting_engine"]
        assert [(s.backend, s.dtype) for s in module.SPECS] == [("counting", "float32")]
        assert module.CountingEngine.generated == 2 and result.steps_done == 2
        # the config refuses what the backend would not read, before anything is built
        with pytest.raises(ValueError, match=r"rollout.weight_bits=8 only applies to rollout.engine=hf; the counting "
                                             "engine's numerics are set in the counting backend's builder"):
            load_config(None, [*overrides, "rollout.weight_bits=8"])
    finally:
        ENGINE_BUILDERS.unregister("counting")
        sys.modules.pop("counting_engine", None)
    with pytest.raises(ValueError, match="rollout.engine: must be one of hf, llamacpp, server, vllm"):
        load_config(None, ["rollout.engine=counting"])


# -- the trainer, inspect and the warm start all build through the registry -------------------------------------------


@pytest.fixture
def hf_spy():
    """The registered ``hf`` builder wrapped to record every spec it builds (and still build it)."""
    original = ENGINE_BUILDERS["hf"]
    seen: list[EngineSpec] = []

    def spy(spec, **kwargs):
        seen.append(spec)
        return original.fn(spec, **kwargs)

    ENGINE_BUILDERS.unregister("hf")
    register_engine("hf", spy, fields=original.fields)
    try:
        yield seen
    finally:
        ENGINE_BUILDERS.unregister("hf")
        ENGINE_BUILDERS.register("hf", original)


def test_the_trainer_builds_its_engine_through_the_registry(hf_spy, tiny):
    from offpolicy.train.build import build_run_engine as trainer_engine
    from offpolicy.train.config import load_config

    model, tok = tiny
    cfg = load_config(None, ["rollout.dtype=float16", "rollout.kv_cache_bits=8", "rollout.sampler=multinomial",
                             "rollout.routing_replay=none"])
    engine = trainer_engine(cfg, model, tok)
    [spec] = hf_spy
    assert (spec.backend, spec.dtype, spec.kv_cache_bits, spec.sampler, spec.record_routes) == (
        "hf", "float16", 8, "multinomial", False)
    assert engine.dtype == torch.float16 and engine.kv_cache_bits == 8


def test_inspect_builds_both_sides_through_the_registry(hf_spy, tiny, prompts):
    from offpolicy.inspect.compare import compare_engines
    from offpolicy.inspect.specs import ROLLOUT_SPECS, TRAINER_SPECS

    model, tok = tiny
    m = compare_engines(model, prompts[:2], ROLLOUT_SPECS["kv8"], TRAINER_SPECS["fp32"],
                        SamplingConfig(max_new_tokens=2), tokenizer=tok, dvp_rhos=None)
    assert [s.name for s in hf_spy] == ["kv8", "fp32"] and m.meta["rollout"]["kv_cache_bits"] == 8


def test_the_warm_start_evaluation_builds_through_the_registry(hf_spy, tiny):
    from offpolicy.models.warm_start import evaluate_reward

    model, tok = tiny
    stats = evaluate_reward(model, tok, n=2, dtype="float32")
    [spec] = hf_spy
    assert (spec.backend, spec.dtype) == ("hf", "float32") and 0.0 <= stats["reward"] <= 1.0


# -- the trainer's config as a spec -----------------------------------------------------------------------------------


def test_the_trainer_config_of_each_backend_as_a_spec(tmp_path):
    from offpolicy.train.build import engine_spec
    from offpolicy.train.config import load_config

    run = [f"run.out_dir={tmp_path}", "run.seed=5"]
    ll = engine_spec(load_config(None, [*run, "rollout.engine=llamacpp", "rollout.llamacpp.weights=q4_0",
                                        "rollout.llamacpp.kv_cache_type=q8_0", "run.threads=2"]))
    assert (ll.backend, ll.weights, ll.kv_cache_type, ll.threads) == ("llamacpp", "q4_0", "q8_0", 2)
    sv = engine_spec(load_config(None, [*run, "rollout.engine=server", "rollout.server.url=http://h:1",
                                        "rollout.server.protocol=sglang", "rollout.server.timeout=9"]))
    assert (sv.backend, sv.server, sv.protocol, sv.timeout, sv.weights_dir) == (
        "server", "http://h:1", "sglang", 9.0, str(tmp_path / "reload"))
    vl = engine_spec(load_config(None, [*run, "rollout.engine=vllm", "rollout.vllm.kv_cache_dtype=fp8"]))
    assert (vl.backend, vl.dtype, vl.kv_cache_dtype, vl.seed, vl.max_logprobs) == ("vllm", "bfloat16", "fp8", 5, 20)
    hf = engine_spec(load_config(None, [*run, "rollout.quant=w4a16", "rollout.routing_replay=r3",
                                        "rollout.compile=true"]))
    assert (hf.quant, hf.record_routes, hf.compile, hf.sampler) == ("nvfp4a16", True, True, "inverse_cdf")


def test_the_trl_rollout_func_builds_a_spec_through_the_registry(hf_spy, tiny):
    from types import SimpleNamespace

    from offpolicy.integrations.trl.rollout import engine_rollout, sampling_from_trl

    model, tok = tiny
    args = SimpleNamespace(max_completion_length=4, temperature=1.0, top_k=0, top_p=1.0, min_p=None,
                           repetition_penalty=1.0)
    trainer = SimpleNamespace(model=model, processing_class=tok, args=args, state=SimpleNamespace(global_step=0))
    rollout = engine_rollout(EngineSpec.parse("dtype=fp32,kv_cache_bits=8"), seed=5)
    assert hf_spy == []  # built at the first generation, on the trainer's model
    out = rollout(["1+2=", "3+4="], trainer)
    rollout(["1+2="], trainer)
    [spec] = hf_spy  # once
    assert (spec.dtype, spec.kv_cache_bits) == ("float32", 8)
    by_hand = HFRolloutEngine(model, dtype="float32", kv_cache_bits=8, tokenizer=tok)
    again = by_hand.generate(out["prompt_ids"], sampling_from_trl(args), seed=5)
    assert out["completion_ids"] == [list(c) for c in again.completion_ids]
    with pytest.raises(ValueError, match="or an EngineSpec"):
        engine_rollout("hf")

import importlib.util
import math
import sys
from types import SimpleNamespace

import pytest
import torch

from offpolicy.rollout.base import RolloutEngine
from offpolicy.rollout.protocols import check_vllm_filter_order, vllm_sampling
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.vllm import VLLMRolloutEngine, _to_output

HAS_VLLM = importlib.util.find_spec("vllm") is not None
HAS_GPU = torch.cuda.is_available()


def test_clear_import_error_without_vllm(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, installed or not
    with pytest.raises(ImportError, match=r"pip install 'offpolicy\[vllm\]'.*install_vllm_cpu.sh"):
        VLLMRolloutEngine(tmp_path)


def test_follows_the_protocol():
    assert issubclass(VLLMRolloutEngine, RolloutEngine)


def _lp(value):
    return SimpleNamespace(logprob=value)


def test_request_outputs_become_a_padded_rollout():
    """vLLM returns, per step, a dict id -> Logprob with the top-K *plus* the sampled token."""
    results = [
        SimpleNamespace(
            outputs=[
                SimpleNamespace(
                    token_ids=[5, 2],
                    text="x",
                    logprobs=[{5: _lp(-0.1), 7: _lp(-2.5)}, {9: _lp(-0.2), 2: _lp(-1.9)}],
                )
            ]
        ),
        SimpleNamespace(outputs=[SimpleNamespace(token_ids=[8], text="y", logprobs=[{8: _lp(-0.05)}])]),
    ]
    out = _to_output([[1, 3], [1]], results, k=1)
    assert out.completion_ids == [[5, 2], [8]] and out.texts == ["x", "y"]
    assert out.mask.tolist() == [[True, True], [True, False]]
    torch.testing.assert_close(out.logp, torch.tensor([[-0.1, -1.9], [-0.05, 0.0]]))
    # top-1: the most likely entry of each step's dict (token 9 at step 2, not the sampled eos)
    assert out.topk_ids[..., 0].tolist() == [[5, 9], [8, 0]]
    assert out.topk_logp[0, 1, 0].item() == pytest.approx(-0.2)
    out3 = _to_output([[1, 3], [1]], results, k=3)
    assert out3.topk_logp[1, 0, 1].item() == -math.inf  # fewer entries than K


@pytest.mark.skipif(not (HAS_VLLM and HAS_GPU), reason="needs vllm and a CUDA GPU (CPU-only test machine)")
def test_vllm_engine_matches_hf_scoring(tmp_path):
    from offpolicy.models.tiny import build_tiny_model
    from offpolicy.rollout.sampling import SamplingConfig
    from offpolicy.rollout.scoring import sequence_logprobs

    model, tok = build_tiny_model()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    engine = VLLMRolloutEngine(tmp_path, gpu_memory_utilization=0.2)
    engine.sync_weights(model)
    cfg = SamplingConfig(max_new_tokens=8, logprobs_topk=4)
    out = engine.generate([tok("12+34=")["input_ids"]] * 4, cfg, seed=0)
    with torch.no_grad():
        lp, mask = sequence_logprobs(model, out.prompt_ids, out.completion_ids, cfg)
    assert (lp - out.logp).abs()[mask].max() < 0.1


def test_min_p_with_top_p_is_refused_because_vllm_orders_them_differently():
    # vLLM: min-p before top-p; the trainer's scoring (HF order): after. Top-k commutes with min-p, so it is allowed.
    with pytest.raises(ValueError, match="min_p with top_p"):
        check_vllm_filter_order(SamplingConfig(max_new_tokens=4, top_p=0.9, min_p=0.05))
    check_vllm_filter_order(SamplingConfig(max_new_tokens=4, top_k=20, min_p=0.05))
    check_vllm_filter_order(SamplingConfig(max_new_tokens=4, top_p=0.9))


def test_routed_experts_pass_through_cut_to_the_forwarded_positions():
    import numpy as np

    # prompt of 2 + completion of 2 tokens: vLLM may return all 4 positions; the trainer replays P + C − 1 = 3
    routed = np.arange(4 * 3 * 2, dtype=np.int16).reshape(4, 3, 2) % 8
    results = [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5, 2], text="x", routed_experts=routed,
                                                        logprobs=[{5: _lp(-0.1)}, {2: _lp(-1.9)}])])]
    out = _to_output([[1, 3]], results, k=0, routes=True)
    assert out.routed_experts[0].shape == (3, 3, 2) and out.routed_experts[0].dtype == torch.int16
    assert out.routed_experts[0].tolist() == routed[:3].tolist()
    assert _to_output([[1, 3]], results, k=0).routed_experts is None
    results[0].outputs[0].routed_experts = None
    with pytest.raises(ValueError, match="no routed_experts"):
        _to_output([[1, 3]], results, k=0, routes=True)
    results[0].outputs[0].routed_experts = routed[:2]
    with pytest.raises(ValueError, match=r"positions >= 3"):
        _to_output([[1, 3]], results, k=0, routes=True)


def test_recipe_maps_onto_vllm_sampling_params_and_reports_the_temperature_floor():
    cfg = SamplingConfig(max_new_tokens=4, temperature=0.004, top_k=20, repetition_penalty=1.1, presence_penalty=0.5,
                         frequency_penalty=0.25, logit_bias={7: -100.0, 3: 2.0})
    kwargs, applied = vllm_sampling(cfg)
    assert kwargs == {"temperature": 0.01, "top_k": 20, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.1,
                      "presence_penalty": 0.5, "frequency_penalty": 0.25, "logit_bias": {3: 2.0, 7: -100.0}}
    assert applied == SamplingConfig(max_new_tokens=4, temperature=0.01, top_k=20, repetition_penalty=1.1,
                                     presence_penalty=0.5, frequency_penalty=0.25, logit_bias={7: -100.0, 3: 2.0})
    assert vllm_sampling(SamplingConfig(temperature=0.7))[1].temperature == 0.7  # above the floor: unchanged


@pytest.mark.parametrize("cfg, name", [
    (SamplingConfig(bad_words_ids=[[5]]), "bad_words"),
    (SamplingConfig(logit_bias={1: -1e9}), "logit_bias"),
    (SamplingConfig(temperature=1e-6), "temperature"),
    (SamplingConfig(top_p=0.9, min_p=0.1), "min_p with top_p"),
])
def test_a_recipe_vllm_would_apply_differently_is_refused_by_name(cfg, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        vllm_sampling(cfg)


# -- the weight push by vLLM's platform: the GPU branch has no other test here (no GPU, no CUDA vLLM) ------------------
class _Model:
    def __init__(self, log):
        self.log = log

    def load_weights(self, weights):
        self.log.append(("load_weights", [n for n, _ in weights]))


class _Worker:
    def __init__(self, log):
        self.log, self.model_runner = log, SimpleNamespace(model=_Model(log))

    def reload_weights(self, weights_iterator):
        self.log.append(("reload_weights", [n for n, _ in weights_iterator]))


def _llm(log):
    worker = _Worker(log)
    executor = SimpleNamespace(driver_worker=SimpleNamespace(worker=worker))
    return SimpleNamespace(llm_engine=SimpleNamespace(model_executor=executor),
                           reset_prefix_cache=lambda: log.append(("reset_prefix_cache", None)))


def _platform(monkeypatch, cpu: bool):
    platforms = SimpleNamespace(current_platform=SimpleNamespace(is_cpu=lambda: cpu))
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(platforms=platforms))
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)


@pytest.mark.parametrize("cpu, path", [(False, "load_weights"), (True, "reload_weights")])
def test_the_push_takes_the_path_vllms_platform_supports(monkeypatch, cpu, path):
    from offpolicy.rollout.vllm import push_weights, vllm_platform_is_cpu

    _platform(monkeypatch, cpu)
    assert vllm_platform_is_cpu() is cpu
    log: list = []
    named = [("model.embed_tokens.weight", torch.zeros(2)), ("lm_head.weight", torch.zeros(2))]
    assert push_weights(_llm(log), iter(named)) == path
    assert log == [(path, ["model.embed_tokens.weight", "lm_head.weight"]), ("reset_prefix_cache", None)]
    log.clear()
    other = "reload_weights" if path == "load_weights" else "load_weights"
    assert push_weights(_llm(log), iter(named), method=other) == other
    with pytest.raises(ValueError, match="method must be one of"):
        push_weights(_llm(log), iter(named), method="copy")


class CPUUnquantizedExperts:
    """Stands for vLLM 0.32's CPU experts kernel: records the layers it prepacks."""

    def __init__(self, log):
        self.log = log

    def process_weights_after_loading(self, layer):
        self.log.append(layer.name)


class X86CPUUnquantizedExperts(CPUUnquantizedExperts):
    """Stands for the subclass vLLM 0.32 picks on a CPU with AMX tiles (its own ISA, the same prepacking)."""


def _moe_model(log, layers=2):
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for i in range(layers):
        experts, dense = torch.nn.Module(), torch.nn.Module()
        experts.name = f"layers.{i}.mlp.experts"
        kernel = (CPUUnquantizedExperts, X86CPUUnquantizedExperts)[i % 2]
        experts.quant_method = SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=kernel(log)))
        dense.quant_method = SimpleNamespace()  # a linear layer's method: no MoE kernel
        model.layers.append(torch.nn.ModuleList([experts, dense]))
    return model


@pytest.mark.parametrize("version, repacked", [("0.32.0", 2), ("0.33.0", 0)])
def test_the_cpu_reload_prepacks_the_experts_again_on_the_versions_that_need_it(monkeypatch, version, repacked):
    from offpolicy.rollout import vllm as module

    _platform(monkeypatch, cpu=True)
    sys.modules["vllm"].__version__ = version
    log: list = []
    llm = _llm(log)
    llm.llm_engine.model_executor.driver_worker.worker.model_runner.model = _moe_model(log)
    assert module.push_weights(llm, iter([("lm_head.weight", torch.zeros(2))])) == "reload_weights"
    # the reload, then each MoE layer prepacked as at load (vLLM 0.32 leaves them unpacked), whichever ISA's kernel
    # it runs (layer 1: the AMX subclass), then the cache reset
    prepacked = [f"layers.{i}.mlp.experts" for i in range(repacked)]
    assert log == [("reload_weights", ["lm_head.weight"]), *prepacked, ("reset_prefix_cache", None)]
    assert module.repack_cpu_experts(torch.nn.Linear(2, 2)) == 0  # a dense model: nothing to repack


def test_without_vllm_the_platform_is_read_from_the_machine(monkeypatch):
    from offpolicy.rollout.vllm import vllm_platform_is_cpu

    monkeypatch.setitem(sys.modules, "vllm.platforms", None)  # `from vllm.platforms import ...` raises ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert vllm_platform_is_cpu() is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert vllm_platform_is_cpu() is True


@pytest.mark.parametrize("triton", [False, True])
def test_record_routes_is_refused_in_one_line_where_vllm_cannot_return_them(monkeypatch, tmp_path, triton):
    """vLLM's routed experts come only from its Model Runner V2, which needs Triton: without it (vLLM's CPU build)
    the engine refuses record_routes (R3) before vLLM starts; with it, vLLM is asked for them."""
    started: list = []
    fake = SimpleNamespace(LLM=lambda **kw: started.append(kw) or SimpleNamespace(get_tokenizer=lambda: None),
                           triton_utils=SimpleNamespace(HAS_TRITON=triton))
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.triton_utils", fake.triton_utils)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # no CPU environment defaults to set
    if not triton:
        with pytest.raises(ValueError) as err:
            VLLMRolloutEngine(tmp_path, record_routes=True)
        message = str(err.value)
        assert "\n" not in message and message.startswith("record_routes (R3's engine routes) is not available")
        assert "needs Triton" in message and "rollout.engine=hf" in message
        assert started == []  # refused before vLLM starts
        VLLMRolloutEngine(tmp_path)  # without routes the same vLLM starts
        assert "enable_return_routed_experts" not in started[0]
    else:
        VLLMRolloutEngine(tmp_path, record_routes=True)
        assert started[0]["enable_return_routed_experts"] is True


def test_the_trainer_refuses_r3_on_vllm_in_one_line_naming_the_reason():
    from offpolicy.train.config import load_config

    with pytest.raises(ValueError) as err:
        load_config(None, ["rollout.engine=vllm", "rollout.routing_replay=r3"])
    message = str(err.value)
    assert "\n" not in message.split("invalid config: ", 1)[-1]
    assert "rollout.routing_replay=r3" in message and "CPU build returns no routed experts" in message
    assert "needs Triton" in message and "use rollout.engine=hf" in message
    load_config(None, ["rollout.engine=hf", "rollout.routing_replay=r3"])  # the transformers engine records routes

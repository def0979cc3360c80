"""vLLM and SGLang clients by protocol, against answers written from their documented formats and served by a stub on
127.0.0.1. Unverified against a live vLLM or SGLang server (neither runs on this project's CPU machines)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from offpolicy_testkit.stub_server import stub_servers

from offpolicy.rollout.http import ServerError
from offpolicy.rollout.protocols import SGLangProtocol, VLLMProtocol, parse_sglang_generate, parse_vllm_completion
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.server_engine import ServerRolloutEngine

DATA = Path(__file__).parent / "data"


def _load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


@pytest.fixture
def stub():
    """Start a stub server answering ``replies[path]``; returns (url, log of (path, body))."""
    with stub_servers() as start:
        yield start


# -- vLLM -----------------------------------------------------------------------------------------------------------
def test_vllm_answer_parsed_with_top_k_and_minus_9999_as_minus_inf():
    c = parse_vllm_completion(_load("vllm_completions.json"), SamplingConfig(top_k=3, logprobs_topk=2),
                              vocab_size=4099)
    assert c.ids == [20, 223, 2] and c.logp == [-0.105, -1.9, -0.01] and c.text == "1 2"
    # the top 2 of each dict, most likely first; the sampled 223 (−1.9) is the third entry at position 1, not top-2
    assert c.top_ids == [[20, 21], [19, 31], [2, 1]]
    assert c.top_logp[1] == [-0.4, -1.3] and c.top_logp[2] == [-0.01, -math.inf]


def test_vllm_engine_sends_ids_and_processed_recipe(stub):
    url, log = stub({"/v1/completions": _load("vllm_completions.json")})
    engine = ServerRolloutEngine(url, VLLMProtocol("lab"), vocab_size=4099)
    cfg = SamplingConfig(max_new_tokens=3, temperature=0.005, top_k=3, logprobs_topk=2)
    out = engine.generate([[1, 19, 31], [1, 20]], cfg, seed=7)
    assert out.completion_ids == [[20, 223, 2]] * 2 and out.logp[0].tolist() == pytest.approx([-0.105, -1.9, -0.01])
    assert out.sampling.temperature == 0.01  # vLLM's floor, reported so the trainer replays it
    path, body = log[0]
    assert path == "/v1/completions" and body["prompt"] == [1, 19, 31] and body["seed"] == 7
    assert body["logprobs"] == 2 and body["return_tokens_as_token_ids"] is True and body["top_k"] == 3
    assert log[1][1]["seed"] == 8  # row i: seed + i


def test_vllm_refuses_raw_log_probs():
    with pytest.raises(ValueError, match="--logprobs-mode processed_logprobs"):
        VLLMProtocol("lab", logprobs_mode="raw_logprobs")
    raw = _load("vllm_completions.json")  # top_k=1 keeps one token: two finite top entries + the sampled one = raw
    with pytest.raises(ServerError, match=r"top_logprobs\[1\]: 3 tokens have finite log-probs under top_k=1"):
        parse_vllm_completion(raw, SamplingConfig(top_k=1, logprobs_topk=2), where="vllm request 0")


@pytest.mark.parametrize("edit, message", [
    (lambda a: a["choices"][0]["logprobs"]["tokens"].__setitem__(0, "1"), r"tokens\[0\] = '1' is not 'token_id:<id>'"),
    (lambda a: a["choices"][0]["logprobs"]["token_logprobs"].__setitem__(1, None), r"token_logprobs\[1\] must be a"),
    (lambda a: a["choices"][0]["logprobs"]["tokens"].__setitem__(2, "token_id:9999"), "outside the trainer's"),
    (lambda a: a["choices"][0]["logprobs"]["token_logprobs"].__setitem__(0, -9999.0), "has probability 0"),
    (lambda a: a["choices"][0].pop("logprobs"), "has no field 'logprobs'"),
])
def test_vllm_errors_name_the_field(edit, message):
    answer = _load("vllm_completions.json")
    edit(answer)
    with pytest.raises(ServerError, match=message):
        parse_vllm_completion(answer, SamplingConfig(logprobs_topk=2), where="vllm request 0", vocab_size=4099)


def test_vllm_weight_reload_calls_in_order(stub):
    url, log = stub({p: {} for p in ("/pause", "/collective_rpc", "/reset_prefix_cache", "/resume")})
    ServerRolloutEngine(url, VLLMProtocol("lab")).reload_weights("/models/lab")
    assert [p for p, _ in log] == ["/pause", "/collective_rpc", "/collective_rpc", "/reset_prefix_cache", "/resume"]
    # the folder is named: without weights_path vLLM would reload the folder it last loaded, whatever was asked
    assert log[1][1] == {"method": "reload_weights", "kwargs": {"weights_path": "/models/lab"}}
    # then offpolicy's worker extension repacks a MoE model's experts (vLLM's CPU reload leaves them unpacked),
    # before the prefix cache is reset
    assert log[2][1] == {"method": "offpolicy_repack_cpu_experts"}


@pytest.mark.parametrize("moe", [True, False])
def test_a_server_without_the_worker_extension_still_reloads_and_a_moe_model_is_warned_about(monkeypatch, tmp_path,
                                                                                             moe):
    """A vLLM server started without offpolicy's worker extension answers the repack call with vLLM's 500 ("object
    has no attribute"): the reload goes on (prefix cache reset, resumed); a mixture-of-experts model in the folder is
    warned about once per server, naming the flag; a dense model is not (nothing to repack)."""
    import importlib
    import json
    import warnings

    from offpolicy.rollout.http import ServerError
    from offpolicy.rollout.protocols import vllm_reload_weights

    home = importlib.import_module(vllm_reload_weights.__module__)
    calls = []

    def post(url, body, **kw):
        calls.append((url.rsplit("/", 1)[1], (body or {}).get("method")))
        if (body or {}).get("method") == "offpolicy_repack_cpu_experts":
            raise ServerError(f"{kw['what']}: {url} answered HTTP 500: {{\"error\":{{\"message\":\"Call to "
                              "collective_rpc method failed: Worker failed with error ''CPUWorker' object has no "
                              "attribute 'offpolicy_repack_cpu_experts''\"}}}")
        return {}

    monkeypatch.setattr(home, "post_json", post)
    monkeypatch.setattr(home, "_WARNED_NO_EXTENSION", set())
    (tmp_path / "config.json").write_text(json.dumps({"num_experts": 8} if moe else {"hidden_size": 8}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            vllm_reload_weights("http://s:1", str(tmp_path), timeout=5, weights_path=str(tmp_path))
    assert [c[0] for c in calls[:5]] == ["pause", "collective_rpc", "collective_rpc", "reset_prefix_cache", "resume"]
    notes = [str(w.message) for w in caught]
    if moe:
        assert len(notes) == 1 and "--worker-extension-cls offpolicy.rollout.vllm_worker.OffpolicyWorkerExtension" \
            in notes[0]
    else:
        assert notes == []
    # any other failure of the repack call stops the reload with its message
    def broken(url, body, **kw):
        if (body or {}).get("method") == "offpolicy_repack_cpu_experts":
            raise ServerError("boom")
        return {}

    monkeypatch.setattr(home, "post_json", broken)
    with pytest.raises(ServerError, match="boom"):
        vllm_reload_weights("http://s:1", str(tmp_path), timeout=5)


def test_the_worker_extension_repacks_the_workers_model(monkeypatch):
    from types import SimpleNamespace

    from offpolicy.rollout import vllm_worker as vllm_module
    from offpolicy.rollout.vllm_worker import OffpolicyWorkerExtension

    seen: list = []
    worker = OffpolicyWorkerExtension()
    worker.model_runner = SimpleNamespace(model="the model")
    monkeypatch.setattr(vllm_module, "repack_cpu_experts", lambda model: seen.append(model) or 3)
    assert worker.offpolicy_repack_cpu_experts() == 3 and seen == ["the model"]


def test_sync_weights_writes_a_reload_folder_of_its_own_and_names_it(stub, tmp_path):
    from offpolicy.models import load_model

    model, _ = load_model("tiny")
    url, log = stub({p: {} for p in ("/pause", "/collective_rpc", "/reset_prefix_cache", "/resume")})
    engine = ServerRolloutEngine(url, VLLMProtocol("lab"))  # no weights_dir: a temporary folder on this machine
    engine.sync_weights(model)
    folder = engine.weights_dir
    assert folder is not None and (folder / "model.safetensors.index.json").exists()
    assert log[1][1] == {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
    model_dir = tmp_path / "served"
    model.save_pretrained(model_dir)  # a model directory: never written
    with pytest.raises(ValueError, match="holds files this project did not write"):
        ServerRolloutEngine(url, VLLMProtocol("lab"), weights_dir=model_dir).sync_weights(model)


def test_a_folder_the_engine_cannot_take_whole_is_refused_before_the_reload(stub, tmp_path):
    from offpolicy.models import load_model

    model, _ = load_model("tiny")
    assert model.config.tie_word_embeddings
    url, log = stub({p: {} for p in ("/pause", "/collective_rpc", "/reset_prefix_cache", "/resume")})
    model.save_pretrained(tmp_path)  # the tied head stored once
    with pytest.raises(ValueError, match="head is stored once"):
        ServerRolloutEngine(url, VLLMProtocol("lab")).reload_weights(str(tmp_path))
    assert log == []


# -- SGLang -----------------------------------------------------------------------------------------------------------
def test_sglang_answer_parsed():
    c = parse_sglang_generate(_load("sglang_generate.json"), SamplingConfig(logprobs_topk=2), vocab_size=4099)
    assert c.ids == [20, 223, 2] and c.logp == [-0.105, -1.9, -0.01]
    assert c.top_ids == [[20, 21], [19, 31], [2, 1]] and c.top_logp[2] == [-0.01, -6.2]


def test_sglang_engine_and_reload(stub):
    url, log = stub({"/generate": _load("sglang_generate.json"),
                     "/update_weights_from_disk": {"success": True, "message": "ok"}})
    engine = ServerRolloutEngine(url, SGLangProtocol(), vocab_size=4099)
    out = engine.generate([[1, 19]], SamplingConfig(max_new_tokens=3, temperature=0.7, logprobs_topk=2), seed=3)
    assert out.topk_ids[0, 1].tolist() == [19, 31] and out.mask.all()
    body = log[0][1]
    assert body["input_ids"] == [1, 19] and body["return_logprob"] is True and body["top_logprobs_num"] == 2
    assert body["sampling_params"]["temperature"] == 0.7 and body["sampling_params"]["sampling_seed"] == 3
    engine.reload_weights("/models/lab")
    assert log[1] == ("/update_weights_from_disk", {"model_path": "/models/lab"})


def test_sglang_refuses_truncation_and_a_failed_reload(stub):
    with pytest.raises(ValueError, match="top_k: SGLang reports log-probs before"):
        SGLangProtocol().request([1], SamplingConfig(top_k=5), 0)
    url, _ = stub({"/update_weights_from_disk": {"success": False, "message": "shape mismatch"}})
    with pytest.raises(ServerError, match="answer.success is not true.*shape mismatch"):
        ServerRolloutEngine(url, SGLangProtocol()).reload_weights("/m")


def test_sglang_ids_must_agree():
    answer = _load("sglang_generate.json")
    answer["output_ids"] = [20, 223, 3]
    with pytest.raises(ServerError, match="output_ids .* differ from the ids"):
        parse_sglang_generate(answer, SamplingConfig(), where="sglang request 0")


def test_http_error_names_request(stub):
    url, _ = stub({})
    engine = ServerRolloutEngine(url, SGLangProtocol(), vocab_size=4099)
    with pytest.raises(ServerError, match=r"sglang request 0 \(/generate\): .* answered HTTP 404"):
        engine.generate([[1]], SamplingConfig(max_new_tokens=2), seed=0)

"""The llama.cpp rollout engine: answers parsed exactly, μ equal to the trainer's replay of the reported recipe, one
clear error for a server that is down, slow, malformed or off-vocabulary."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from offpolicy_testkit.stub_server import stub_servers

pytest.importorskip("xllamacpp")
pytest.importorskip("gguf")

from offpolicy.rollout.http import ServerError
from offpolicy.rollout.llamacpp import (
    LlamaCppRolloutEngine,
    connect_llamacpp,
    llamacpp_sampling,
    parse_llamacpp_completion,
)
from offpolicy.rollout.processes import free_port
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.scoring import score_tokens


@pytest.fixture(scope="module")
def engine(sharp, tmp_path_factory):
    model, tok = sharp
    e = LlamaCppRolloutEngine(model, tok, weights="f32", threads=1, workdir=tmp_path_factory.mktemp("gguf"))
    yield e
    e.close()


def _replay(model, prompts, out, cfg):
    with torch.no_grad():
        return score_tokens(model, prompts, out.completion_ids, cfg)[0]


# -- the parser, on answers written as llama-server writes them ------------------------------------------------------
def _step(i, value, top, post=False):
    key, v = ("prob", "prob") if post else ("logprob", "logprob")
    return {"id": i, "token": "x", "bytes": [120], key: value,
            ("top_probs" if post else "top_logprobs"): [{"id": a, "token": "x", "bytes": [120], v: b} for a, b in top]}


def test_parse_raw_log_probs_passes_them_through_when_not_the_whole_support():
    a = {"content": "ab", "tokens": [5, 9],
         "completion_probabilities": [_step(5, -0.1, [(5, -0.1), (2, -2.5)]), _step(9, -3.0, [(1, -0.2), (9, -3.0)])]}
    c = parse_llamacpp_completion(a, SamplingConfig(logprobs_topk=2), vocab_size=10)
    assert c.ids == [5, 9] and c.logp == [-0.1, -3.0] and c.text == "ab"
    assert c.top_ids == [[5, 2], [1, 9]] and c.top_logp == [[-0.1, -2.5], [-0.2, -3.0]]


def test_parse_renormalises_the_whole_support():
    # post-sampling probabilities 0.5 and 0.3 (top-k kept 2 tokens; 2 < n_probs = 4 → the whole support), they sum
    # to 0.8: μ = 0.5/0.8 = 0.625 → log 0.625 = −0.4700, 0.3/0.8 = 0.375 → −0.9808.
    a = {"tokens": [3], "completion_probabilities": [_step(3, 0.3, [(1, 0.5), (3, 0.3)], post=True)]}
    c = parse_llamacpp_completion(a, SamplingConfig(temperature=0.5, top_k=2, logprobs_topk=4), vocab_size=10)
    assert c.logp[0] == pytest.approx(math.log(0.375))
    assert c.top_ids == [[1, 3]] and c.top_logp[0] == pytest.approx([math.log(0.625), math.log(0.375)])


def test_parse_marks_positions_llama_server_skipped():
    # llama-server writes no entry for a token ending inside a UTF-8 character (165 here); the entry of the token
    # that completes it (165 again) is the later one.
    a = {"tokens": [7, 165, 165, 8], "completion_probabilities": [
        _step(7, -0.5, [(7, -0.5)]), _step(165, -1.0, [(165, -1.0)]), _step(8, -0.2, [(8, -0.2)])]}
    c = parse_llamacpp_completion(a, SamplingConfig(logprobs_topk=1), vocab_size=200)
    assert c.missing == [1] and c.logp[0] == -0.5 and math.isnan(c.logp[1]) and c.logp[2:] == [-1.0, -0.2]


@pytest.mark.parametrize("answer, message", [
    ({"tokens": [1]}, "has no field 'completion_probabilities'"),
    ({"tokens": [1], "completion_probabilities": [_step(1, float("nan"), [])]}, r"\.logprob must be a log-prob"),
    ({"tokens": [1], "completion_probabilities": [_step(1, 0.5, [], post=True) | {"prob": "high"}]},
     r"\.prob must be a probability"),
    ({"tokens": [1], "completion_probabilities": [_step(2, -0.1, [])]}, r"\.id = 2 matches no sampled token"),
    ({"tokens": [12], "completion_probabilities": [_step(12, -0.1, [])]}, "outside the trainer's vocabulary of 10"),
    ({"tokens": [1], "completion_probabilities": [_step(1, -0.1, [(1, -0.1), (99, -3.0)])]},
     r"top_logprobs\[1\]\.id = 99 is outside"),
    ({"tokens": [1], "completion_probabilities": [_step(1, 0.0, [(1, 0.0)], post=True)]}, "has probability 0"),
    ([1, 2], "has no field 'tokens'"),
])
def test_parse_errors_name_the_request_and_the_field(answer, message):
    with pytest.raises(ServerError, match=message) as err:
        parse_llamacpp_completion(answer, SamplingConfig(logprobs_topk=2), where="llama.cpp request 3",
                                  vocab_size=10)
    assert str(err.value).startswith("llama.cpp request 3")


def test_sampler_chain_follows_the_replay_order_and_turns_defaults_off():
    s = llamacpp_sampling(SamplingConfig(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, logit_bias={3: -1.0}))
    assert s["samplers"] == ["temperature", "top_k", "top_p", "min_p"]
    assert s["logit_bias"] == [[3, -1.0]]
    plain = llamacpp_sampling(SamplingConfig())
    assert plain["samplers"] == ["temperature"] and plain["top_k"] == 0 and plain["top_p"] == 1.0
    assert plain["min_p"] == 0.0 and plain["repeat_penalty"] == 1.0 and plain["dry_multiplier"] == 0.0
    with pytest.raises(ValueError, match="repetition_penalty: llama.cpp applies penalties"):
        llamacpp_sampling(SamplingConfig(repetition_penalty=1.1))


# -- the engine on a real server ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [
    SamplingConfig(max_new_tokens=6),
    SamplingConfig(max_new_tokens=6, temperature=0.7, top_k=50, logprobs_topk=5),
    SamplingConfig(max_new_tokens=6, temperature=1.3, top_p=0.9, min_p=0.02, logit_bias={31: 2.0}),
], ids=["plain", "temperature-top_k", "top_p-min_p-bias"])
def test_mu_is_the_trainers_replay_of_the_reported_recipe(engine, sharp, prompts, cfg):
    model, _ = sharp
    out = engine.generate(prompts, cfg, seed=5)
    assert out.sampling == cfg and out.mask.any()
    logp = _replay(model, prompts, out, out.sampling)
    # F32 file, F32 KV cache: different kernels, same numbers to ~1e-5 nats
    assert float((logp - out.logp)[out.mask].abs().max()) < 2e-4
    if cfg.logprobs_topk:
        assert bool((out.topk_logp[out.mask][:, :-1] >= out.topk_logp[out.mask][:, 1:]).all())  # sorted
        assert bool((out.logp[out.mask] <= out.topk_logp[out.mask][:, 0] + 1e-6).all())  # nothing above the top-1
    again = engine.generate(prompts, cfg, seed=5)
    assert again.completion_ids == out.completion_ids and torch.equal(again.logp, out.logp)


def test_positions_without_an_entry_are_refilled(tiny, tmp_path):
    # The random tiny model samples byte tokens of multi-byte characters (seed 3, "1+2=": token 165 at position 6);
    # their μ comes from a second request and must still equal the replay.
    model, tok = tiny
    e = LlamaCppRolloutEngine(model, tok, threads=1, workdir=tmp_path)
    try:
        prompts = [tok("1+2=")["input_ids"]]
        cfg = SamplingConfig(max_new_tokens=8, logprobs_topk=3)
        out = e.generate(prompts, cfg, seed=3)
    finally:
        e.close()
    assert 165 in out.completion_ids[0]
    assert float((_replay(model, prompts, out, cfg) - out.logp)[out.mask].abs().max()) < 2e-4


def test_sync_weights_restarts_on_the_new_weights(sharp, prompts, tmp_path):
    model, tok = sharp
    e = LlamaCppRolloutEngine(model, tok, weights="f16", threads=1, workdir=tmp_path)
    try:
        cfg = SamplingConfig(max_new_tokens=4)
        before = e.generate(prompts[:2], cfg, seed=0)
        changed = copy.deepcopy(model)
        with torch.no_grad():
            changed.model.norm.weight.mul_(0.5)
        e.sync_weights(changed)
        after = e.generate(prompts[:2], cfg, seed=0)
        assert len(e.sync_log) == 1 and e.sync_log[0]["export_s"] > 0 and e.sync_log[0]["restart_s"] > 0
        assert len(list(tmp_path.glob("*.gguf"))) == 1  # the old file is gone
        new = _replay(changed, prompts[:2], after, cfg)
        assert float((new - after.logp)[after.mask].abs().max()) < 5e-3  # F16 weights
        assert not torch.equal(before.logp, after.logp)
    finally:
        e.close()


# -- servers that misbehave ---------------------------------------------------------------------------------------------
@pytest.fixture
def stub():
    """Start a stub answering every POST with ``reply`` (bytes) after ``delay`` seconds; returns its url."""
    with stub_servers() as start:
        yield lambda reply, delay=0.0: start({"*": reply}, delay)[0]


def test_a_server_that_is_down(prompts):
    e = connect_llamacpp(f"http://127.0.0.1:{free_port()}", vocab_size=4099, timeout=2)
    with pytest.raises(ServerError, match=r"llama.cpp request 0 \(/completion\): cannot reach http://127"):
        e.generate(prompts[:1], SamplingConfig(max_new_tokens=2), seed=0)


def test_a_server_that_times_out(stub, prompts):
    e = connect_llamacpp(stub(b"{}", delay=1.0), vocab_size=4099, timeout=0.2)
    with pytest.raises(ServerError, match=r"request 0 \(/completion\): .* did not answer within 0.2 s"):
        e.generate(prompts[:1], SamplingConfig(max_new_tokens=2), seed=0)


def test_a_server_that_answers_malformed_json(stub, prompts):
    e = connect_llamacpp(stub(b'{"tokens": [1, 2'), vocab_size=4099)
    with pytest.raises(ServerError, match=r"request 0 \(/completion\): .* answered malformed JSON"):
        e.generate(prompts[:1], SamplingConfig(max_new_tokens=2), seed=0)


def test_a_server_that_answers_other_token_ids(stub, prompts):
    reply = json.dumps({"tokens": [5000], "completion_probabilities": [_step(5000, -0.1, [(5000, -0.1)])]})
    e = connect_llamacpp(stub(reply.encode()), vocab_size=4099)
    with pytest.raises(ServerError, match=r"request 0 \(/completion\): answer.tokens\[0\] = 5000 is outside"):
        e.generate(prompts[:1], SamplingConfig(max_new_tokens=2), seed=0)


def test_connect_to_a_running_llamacpp_server(engine, sharp, prompts):
    # server=URL: the same protocol against the engine's own server
    model, _ = sharp
    e = connect_llamacpp(engine.url, vocab_size=model.config.vocab_size)
    cfg = SamplingConfig(max_new_tokens=4, logprobs_topk=3)
    out = e.generate(prompts[:2], cfg, seed=2)
    assert out.completion_ids == engine.generate(prompts[:2], cfg, seed=2).completion_ids
    with pytest.raises(ValueError, match="cannot take tensors"):
        e.sync_weights(model)

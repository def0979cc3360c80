"""The verl plug-in's rollout path against live vLLM: verl 0.9.1's own rollout stack (``LLMServerManager``, standalone:
``vLLMReplica`` → ``vLLMHttpServer`` in a Ray actor, vLLM's ``AsyncLLM`` inside, the load balancer and
``LLMServerClient``) on vLLM's CPU build with the tiny model in float32. The requests the stub in
tests/integrations/test_verl_plugin.py records are replayed against it, the plug-in's agent loop runs end to end
through verl's client, then verl's weight sync goes into the same server, judged by the sync check.

One script run for the module (tests/vllm/scripts/verl_server.py: ≈ 4–6 min on two busy cores — Ray, vLLM's start-up,
the first request, a 20 s wait on verl's stuck sync; every other request well under a second)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

if importlib.util.find_spec("verl") is None or importlib.util.find_spec("ray") is None:
    pytest.skip("verl (with ray) is not installed: verl's own vLLM server cannot run", allow_module_level=True)

pytestmark = pytest.mark.slow  # ≈ 5 min for the module, nearly all of it the script's start-up (module docstring)

SCRIPT = Path(__file__).parent / "scripts" / "verl_server.py"
K = 3  # the stub's K


@pytest.fixture(scope="module")
def live(run_vllm_script):
    proc = run_vllm_script(SCRIPT, timeout=900)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    result["log"] = proc.stdout + proc.stderr
    assert "error" not in result, result["error"]
    return result


def test_verls_own_vllm_server_starts_on_cpu_and_answers(live):
    assert live["startup_s"] > 0 and live["server_actor"] == "vLLMReplica"
    gen = live["generate"]
    assert gen["fields"] == gen["stub_fields"]  # both verl's TokenOutput
    assert 1 <= len(gen["token_ids"]) <= 8 and gen["stop_reason"] == "completed"  # response_length 8
    assert gen["types"] == gen["stub_types"] == ["int", "float"]
    assert len(gen["log_probs"]) == len(gen["token_ids"]) and all(lp <= 0 for lp in gen["log_probs"])
    assert "global_steps" in gen["extra_fields"]
    assert len(live["greedy"]["token_ids"]) >= 1


def test_the_recorded_scoring_answer_has_the_live_answers_layout(live):
    """The stub's prompt_logprobs rows (one per token after the first, ranks 1…K, a dummy last row) are what verl's
    server returns from vLLM, and the agent loop's parser reads the live answer."""
    score = live["score"]
    n = score["n_tokens"]
    for ids, logps in ((score["prompt_ids"], score["prompt_logprobs"]),
                       (score["stub_prompt_ids"], score["stub_prompt_logprobs"])):
        assert len(ids) == len(logps) == n  # n − 1 rows + the dummy
        assert all(len(row) == K for row in ids) and all(len(row) == K for row in logps)
        assert ids[-1] == [0] * K and logps[-1] == [0.0] * K
        assert all(isinstance(i, int) for row in ids for i in row)
        assert all(row[0] >= row[1] >= row[2] for row in logps[:-1])  # ranks 1…K in order
    parsed = live["parsed"]
    assert len(parsed["ids"]) == len(live["generate"]["token_ids"])
    assert all(len(row) == K and len(set(row)) == K for row in parsed["ids"])
    assert len(score["token_ids"]) == 1  # max_tokens 1: the scoring request generates one token, dropped


def test_sampled_log_probs_are_the_recipes_at_the_request_temperature(live):
    """μ from verl's server (processed log-probs) is the plug-in engine's recipe log-probs (token_scores) of the same tokens — DVP /
    sampling replay's rollout side checked on live vLLM: min-p 0.05 then top-k 20 at T = 0.8, float32 on both sides."""
    at_t = live["recipe_vs_sampled_t08"]
    assert max(at_t) < 1e-4
    assert max(live["recipe_vs_sampled_t1"]) > 1e-2  # the same tokens at the wrong temperature do not match
    assert live["plain_sampled_vs_raw"] < 1e-4  # no recipe, T = 1: μ is the raw model's softmax


def test_prompt_log_probs_are_raw_whatever_the_request_says(live):
    """vLLM's prompt log-probs skip the sampler: the scoring request asked for T = 0.8, min-p and top-k, and got log
    softmax of the raw logits — what the agent loop's refusal of T ≠ 1 rests on."""
    assert live["prompt_logprobs_vs_raw"] < 1e-4
    assert live["prompt_logprobs_vs_tempered"] > 1e-2
    assert live["prompt_ids_are_raw_topk"]


def test_agent_loop_end_to_end_through_verls_client(live):
    loop = live["loop"]
    assert loop["response_len"] >= 1
    assert loop["sampled_vs_recipe"] < 1e-4  # the recipe reached vLLM (min_p / top_k in the request)
    assert loop["topk_vs_raw"] < 1e-4 and loop["topk_ids_equal_raw"]  # T = 1: the top-K is the sampler's
    assert loop["stored_dtypes"] == ["torch.int64", "torch.float32"]
    n = loop["stored_shapes"][0][0]
    assert loop["stored_shapes"] == [[n, K], [n, K]]
    assert loop["stored_row"] == loop["first_topk_row"]  # row prompt − 1 predicts response token 0
    assert "temperature 0.8" in live["loop_t08"] and "raw model's at temperature 1" in live["loop_t08"]


def test_verls_weight_sync_fails_on_vllms_cpu_backend_and_the_sync_check_says_so(live):
    """verl's sync (``ServerAdapter.update_weights``, shared memory: verl's fallback without CUDA IPC) reaches the vLLM
    worker and stops in vLLM's ``model.load_weights`` — the CPU backend repacks every linear weight and leaves
    parameters without a ``weight_loader`` — and the worker never answers verl's sender, which waits on a blocking
    zmq receive (the script's receive timeout turns that hang into an error). The engine keeps serving, on weights
    that are not the trainer's: the sync check, calibrated before the sync on the same probe, fails it by name.
    When this test fails, a vLLM or verl release has changed that: update docs/frameworks/verl.md."""
    assert live["sync_uses_shared_memory"] is True
    assert live["verl_sync_error"] is not None  # the sender's receive timed out: the receiver never answered
    assert "'Parameter' object has no attribute 'weight_loader'" in live["log"]
    assert "vllm_rollout/utils.py" in live["log"] and "layers/linear.py" in live["log"]
    assert live["sync_calibrate"]["sync/baseline"] < 1e-4  # fp32 server against the fp32 trainer, same weights
    caught = live["sync_caught"]
    assert caught is not None and not caught.startswith("no answer"), caught
    assert "verl sync 1" in caught

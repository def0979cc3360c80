"""The vLLM server as a child process: it starts on the embedded model and answers its own protocol."""

from __future__ import annotations

from offpolicy.rollout.http import post_json


def test_the_server_answers_a_completion_with_logprobs(vllm_servers):
    server = vllm_servers.get("tiny", "bfloat16")
    body = {"model": str(server.model_dir), "prompt": [1, 40, 41], "max_tokens": 4, "logprobs": 3, "seed": 0,
            "temperature": 1.0, "return_tokens_as_token_ids": True}
    answer = post_json(server.url + "/v1/completions", body, timeout=60, what="test")
    choice = answer["choices"][0]
    assert len(choice["logprobs"]["tokens"]) >= 1
    assert all(t.startswith("token_id:") for t in choice["logprobs"]["tokens"])

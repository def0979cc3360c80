"""A stub of verl's LLM server for the plug-in's agent loop: it records each request and answers generation with
``RESPONSE`` and a scoring request (``prompt_logprobs=K``) with verl's prompt log-prob rows. Used by
tests/integrations/test_verl_plugin.py and, to replay its recorded requests on a live server,
tests/vllm/scripts/verl_server.py."""

from __future__ import annotations

PROMPT = [11, 12, 13]
RESPONSE = [21, 22, 23, 24]
K = 3


def prompt_logprobs_rows(n_tokens: int) -> dict:
    """What verl's vLLM server returns for a scoring request with ``prompt_logprobs=K``: one row per token after the
    first (ids ranked 1…K, log-probs descending), then a dummy row; row r's top id is 100 + r (a value to find)."""
    ids = [[100 + r, 200 + r, 300 + r] for r in range(n_tokens - 1)] + [[0] * K]
    logps = [[-0.1 * (r + 1), -1.0 - r, -2.0 - r] for r in range(n_tokens - 1)] + [[0.0] * K]
    return {"prompt_ids": ids, "prompt_logprobs": logps}


class StubServer:
    """Records each request; answers generation with RESPONSE and a scoring request with prompt log-probs."""

    def __init__(self):
        self.requests: list[dict] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        self.requests.append({"prompt_ids": list(prompt_ids), "sampling_params": dict(sampling_params)})
        if "prompt_logprobs" in sampling_params:
            return TokenOutput(token_ids=[0], extra_fields=prompt_logprobs_rows(len(prompt_ids)))
        return TokenOutput(token_ids=RESPONSE, log_probs=[-0.5] * len(RESPONSE))

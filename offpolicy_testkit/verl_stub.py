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


def _agent_loop(server):
    """The plug-in's agent loop built without verl's dataset and tokenizer, talking to ``server`` (a stub or verl's
    own client): what run() needs, set by hand."""
    import json
    import types

    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    from offpolicy.integrations.verl.agent_loop import AGENT_NAME, OffPolicyAgentLoop
    from offpolicy.integrations.verl.settings import settings_from_text

    assert _agent_loop_registry[AGENT_NAME]["_target_"].endswith("OffPolicyAgentLoop")
    loop = object.__new__(OffPolicyAgentLoop)  # verl builds it with a tokenizer and the dataset; run() needs these
    loop.config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"prompt_length": 8, "response_length": 8}}})
    loop.server_manager = server
    loop.rollout_config = loop.config.actor_rollout_ref.rollout
    loop.prompt_length = loop.response_length = 8
    loop.offpolicy = settings_from_text(json.dumps({"sampling": {"min_p": 0.05, "top_k": 20},
                                                    "topk_logprobs": K}))

    async def no_media(messages):
        return {}

    async def tokens(messages, **kwargs):
        return list(PROMPT)

    async def merge(prompt_ids, response_ids, *args, assistant_logprobs=None):
        merged = types.SimpleNamespace(token_ids=list(prompt_ids) + list(response_ids))
        return merged, [1] * len(response_ids), assistant_logprobs

    loop.process_multi_modal_info = no_media
    loop.ct_build_initial_tokens = tokens
    loop.ct_merge_assistant_token = merge
    loop._get_mm_processor_kwargs = lambda audios: {}
    loop._assert_mm_supported = lambda has: None
    loop.build_sglang_video_payload = lambda videos, inputs: None
    return loop

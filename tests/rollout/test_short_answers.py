"""An engine answer with fewer log-probs than tokens is an error naming the request — never μ = 1 or 0 padding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from offpolicy_testkit.stub_server import stub_servers

from offpolicy.rollout.http import ServerError
from offpolicy.rollout.protocols import ServerCompletion, parse_sglang_generate
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.server_engine import ServerRolloutEngine
from offpolicy.rollout.vllm import _to_output


class _ShortProtocol:
    """A user's own protocol whose parser keeps whatever the server sent (as a third-party one might)."""

    name, path = "mine", "/generate"

    def applied(self, cfg):
        return cfg

    def request(self, prompt, cfg, seed):
        return {"prompt": prompt}

    def parse(self, answer, cfg, *, where, vocab_size):
        return ServerCompletion(answer["ids"], answer["logp"])

    def score_request(self, prompt, completion):
        return {"prompt": prompt + completion}

    def parse_score(self, answer, prompt, completion, *, where):
        return answer["logp"]


def test_server_engine_refuses_a_short_answer_naming_the_request():
    with stub_servers() as start:
        url, _ = start({"/generate": {"ids": [5, 6, 7], "logp": [-0.1, -0.2]}})
        engine = ServerRolloutEngine(url, _ShortProtocol())
        with pytest.raises(ServerError, match=r"mine request 0 \(/generate\): 3 tokens but 2 log-probs"):
            engine.generate([[1, 2]], SamplingConfig(max_new_tokens=4), seed=0)
        with pytest.raises(ServerError, match=r"mine scoring request 0 .*: 2 log-probs came back for 3 completion"):
            engine.score([[1]], [[5, 6, 7]])


def test_server_completion_checks_its_top_k_rows():
    ServerCompletion([5], [-0.1], [[5]], [[-0.1]]).check_lengths("r")  # one row per token: fine
    with pytest.raises(ServerError, match="r: 2 tokens but 1 top_ids rows"):
        ServerCompletion([5, 6], [-0.1, -0.2], [[5]], [[-0.1]]).check_lengths("r")


def test_sglang_answer_shorter_than_its_completion_tokens_is_refused():
    answer = {"text": "x", "meta_info": {"completion_tokens": 3, "output_token_logprobs": [[-0.25, 4, None]]}}
    with pytest.raises(ServerError, match=r"sglang request 2: answer.meta_info: completion_tokens = 3 but "
                                          r"output_token_logprobs has 1 entries"):
        parse_sglang_generate(answer, SamplingConfig(), where="sglang request 2")
    answer["meta_info"]["completion_tokens"] = 1
    assert parse_sglang_generate(answer, SamplingConfig()).logp == [-0.25]


def _lp(value):
    return SimpleNamespace(logprob=value)


def test_vllm_in_process_output_with_fewer_log_probs_than_tokens_is_refused():
    short = SimpleNamespace(request_id="r-7", outputs=[SimpleNamespace(token_ids=[5, 2], text="x",
                                                                       logprobs=[{5: _lp(-0.1)}])])
    fine = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[8], text="y", logprobs=[{8: _lp(-0.05)}])])
    with pytest.raises(ValueError, match=r"vLLM request 1 \(id r-7\): 2 tokens but 1 log-prob entries"):
        _to_output([[1], [1]], [fine, short], k=0)
    short.outputs[0].logprobs = None  # SamplingParams without logprobs: none at all
    with pytest.raises(ValueError, match="2 tokens but 0 log-prob entries"):
        _to_output([[1]], [short], k=0)
    short.outputs[0].logprobs = [{5: _lp(-0.1)}, {9: _lp(-0.3)}]  # the sampled 2 missing from its entry
    with pytest.raises(ValueError, match="position 1: the sampled token 2 has no log-prob entry"):
        _to_output([[1]], [short], k=0)


def test_vllm_prompt_logprobs_shorter_than_the_sequence_are_refused():
    pytest.importorskip("vllm")
    from offpolicy.rollout.vllm import prompt_logprobs

    out = SimpleNamespace(request_id="s-1", prompt_logprobs=[None, {5: _lp(-0.5)}])  # 2 entries for 3 tokens
    llm = SimpleNamespace(generate=lambda prompts, params, use_tqdm: [out])
    with pytest.raises(ValueError, match=r"row 0 \(request s-1\) has 2 entries for 3 tokens"):
        prompt_logprobs(llm, [[1]], [[5, 6]])

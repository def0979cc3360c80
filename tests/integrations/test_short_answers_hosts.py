"""TRL's rollout_func, TRL's sync-check scorer and verl's agent loop refuse an answer with fewer log-probs than
tokens, naming the completion / sequence / sample (TRL and verl would otherwise pad μ = 1)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from offpolicy.integrations.trl.rollout import engine_rollout, rollout_logprob_lists
from offpolicy.integrations.trl.vllm_sync import ServerScorer
from offpolicy.rollout.base import RolloutOutput


def _out(mask):
    return RolloutOutput(prompt_ids=[[1], [1]], completion_ids=[[5, 6], [7, 8]], logp=torch.tensor([[-0.5, -0.1],
                         [-0.2, 0.0]]), mask=torch.tensor(mask))


def test_trl_rollout_func_refuses_a_short_engine_answer_naming_step_and_completion():
    got = rollout_logprob_lists(_out([[True, True], [True, True]]), where="x")
    assert torch.allclose(torch.tensor(got), torch.tensor([[-0.5, -0.1], [-0.2, 0.0]]))

    class Engine:
        def generate(self, prompt_ids, cfg, *, seed):
            return _out([[True, True], [True, False]])  # completion 1: its second token has no log-prob

        def sync_weights(self, model):
            pass

    trainer = SimpleNamespace(state=SimpleNamespace(global_step=3), model=None,
                              processing_class=lambda text, add_special_tokens: {"input_ids": [1]},
                              args=SimpleNamespace(max_completion_length=2, temperature=1.0))
    rollout = engine_rollout(Engine())
    with pytest.raises(ValueError, match=r"engine_rollout at step 3 \(generation 1\): completion 1 has 2 tokens "
                                         r"but 1 log-probs"):
        rollout(["a", "b"], trainer)


def test_trl_server_scorer_refuses_short_rows_naming_the_probe_scoring():
    answers = [{"actual_logprobs": [[[-0.1], [-0.2]]]},  # one row for two sequences
               {"actual_logprobs": [[[-0.1], [-0.2]], [[-0.3]]]},  # sequence 1: one entry for two tokens
               {"actual_logprobs": [[[-0.1], [-0.2]], [[-0.3], []]]},  # an empty entry
               {"actual_logprobs": [[[-0.1], [-0.2]], [[-0.3], [-0.4]]]}]
    client = SimpleNamespace(get_sequence_logprobs=lambda seqs, starts, top_logprobs: answers.pop(0))
    scorer = ServerScorer(client)
    prompts, completions = [[1], [1]], [[5, 6], [7, 8]]
    for message in (r"probe scoring 1\): 1 rows of actual_logprobs for 2 sequences",
                    r"probe scoring 2\): sequence 1 has 1 entries for 2 tokens",
                    r"probe scoring 3\): sequence 1 token 1 has no log-prob"):
        with pytest.raises(ValueError, match=message):
            scorer.score(prompts, completions)
    logp, mask = scorer.score(prompts, completions)
    assert mask.all() and torch.allclose(logp, torch.tensor([[-0.1, -0.2], [-0.3, -0.4]]))


def test_verl_agent_loop_refuses_missing_rollout_log_probs_naming_the_sample():
    pytest.importorskip("verl")
    pytest.importorskip("hydra")
    from offpolicy.integrations.verl.agent_loop import _sample_name, check_response_logprobs

    where = _sample_name({"index": 12, "raw_prompt": []})
    assert where == "offpolicy_agent sample (index 12)"
    check_response_logprobs({"logprobs": True}, [5, 6], [-0.1, -0.2], where=where)
    check_response_logprobs({"logprobs": False}, [5, 6], None, where=where)  # not asked for: nothing to check
    with pytest.raises(ValueError, match=r"sample \(index 12\): 2 response tokens but 0 rollout log-probs"):
        check_response_logprobs({"logprobs": True}, [5, 6], None, where=where)
    with pytest.raises(ValueError, match="2 response tokens but 1 rollout log-probs"):
        check_response_logprobs({"logprobs": 1}, [5, 6], [-0.1], where=where)

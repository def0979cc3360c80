"""The multi-turn rollout loop: the engine gets the prompt, its own sampled ids and the tool's ids (token in), and
the conversation keeps exactly what it sampled (token out)."""

from __future__ import annotations

import pytest
import torch
from offpolicy_testkit.toy_tokenizer import ToyTokenizer

from offpolicy.rollout.base import RolloutOutput, pad_ids
from offpolicy.rollout.multi_turn import TurnPrompt, run_turns, tool_ids, turn_seed
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.tasks import ToolCalcTask

TOK = ToyTokenizer()


class ScriptedEngine:
    """Answers turn t of row i with ``script[t][i]`` (ids), μ = −0.1 per token; records every request."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def generate(self, prompt_ids, cfg, *, seed):
        turn = len(self.calls)
        self.calls.append(([list(p) for p in prompt_ids], seed))
        rows = [list(r) for r in self.script[turn]]
        logp, mask = pad_ids(rows, 0, side="right")
        return RolloutOutput([list(p) for p in prompt_ids], rows, torch.where(mask, -0.1, 0.0), mask,
                             texts=[TOK.decode(r, skip_special_tokens=True) for r in rows])


def test_turns_are_token_in_token_out():
    t = TOK.tokens
    eos = (TOK.eos_token_id,)
    prompts = [TurnPrompt("12*7=", [1, *t("1", "2", "*", "7", "=")], {"a": 12, "b": 7, "op": "*"}),
               TurnPrompt("2*3=", [1, *t("2", "*", "3", "=")], {"a": 2, "b": 3, "op": "*"})]
    # row 0 calls calc(12*7) split non-canonically ("c" "a" "l" "c"); row 1 writes no call and no eos
    turn1 = [t("c", "a", "l", "c", "(", "1", "2", "*", "7", ")") + eos, t("9")]
    turn2 = [t("8", "4") + eos, t("6") + eos]
    engine = ScriptedEngine([turn1, turn2])
    convs, first = run_turns(engine, TOK, ToolCalcTask(), prompts, SamplingConfig(max_new_tokens=16), seed=5)
    assert [s for _, s in engine.calls] == [turn_seed(5, 0), turn_seed(5, 1)] and turn_seed(5, 0) == 5
    assert first.completion_ids == [list(r) for r in turn1]
    answer0, answer1 = tool_ids(TOK, "\n= 84\n"), tool_ids(TOK, "\n= 9\n")
    # the second request: prompt + the sampled ids + the tool's text tokenized on its own — never re-tokenized
    assert engine.calls[1][0] == [prompts[0].ids + list(turn1[0]) + answer0, prompts[1].ids + list(turn1[1]) + answer1]
    c0 = convs[0]
    assert [s.role for s in c0.segments] == ["prompt", "policy", "tool", "policy"]
    assert c0.segments[1].ids == turn1[0] and c0.segments[1].logp == pytest.approx([-0.1] * 11)
    assert c0.segments[1].text == "calc(12*7)<eos>" and c0.texts == ("calc(12*7)", "84")
    assert c0.segments[2].ids == tuple(answer0) and c0.segments[2].text == "\n= 84\n"
    assert convs[1].segments[1].text == "9"  # no eos sampled: nothing written after the turn

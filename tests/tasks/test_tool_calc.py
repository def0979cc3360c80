"""The two-turn calculator task: the call's grammar, the environment's answer, the reward, the options."""

from __future__ import annotations

import pytest

from offpolicy.tasks import ToolCalcTask, evaluate_call, get_task, is_multi_turn


@pytest.mark.parametrize("call, value", [
    ("calc(12*7)", 84), ("12*7", 84), (" calc( 3+4*5 ) ", 23), ("10-2-3", 5), ("2*3*4*5", 120), ("0", 0),
    ("calc(12*7", None), ("12/4", None), ("-3", None), ("1+2+3+4+5", None), ("1234567", None), ("", None),
    ("calc()", None), ("12 * 7", None),
])
def test_evaluate_call(call, value):
    assert evaluate_call(call) == value


def test_examples_respond_and_reward():
    task = ToolCalcTask(max_digits=2, ops="*+-")
    examples = task.examples(50, seed=1)
    assert examples == task.examples(50, seed=1)  # deterministic
    for ex in examples:
        a, b, op = ex.meta["a"], ex.meta["b"], ex.meta["op"]
        assert ex.prompt == f"{a}{op}{b}=" and int(ex.answer) == evaluate_call(f"{a}{op}{b}")
        assert task.respond(ex.prompt, [f"calc({a}{op}{b})"], **ex.meta) == f"\n= {ex.answer}\n"
    assert task.respond("1*1=", ["what"]) == "\n= error\n"
    with pytest.raises(ValueError, match="turns"):
        task.respond("1*1=", ["1", "2"])
    assert task.reward([" 84 ", "85", "84.0", ""], answer=["84"] * 4) == [1.0, 0.1, 0.0, 0.0]


def test_options_and_registry():
    assert isinstance(get_task("tool_calc", max_digits=3), ToolCalcTask)
    assert is_multi_turn(get_task("tool_calc")) and not is_multi_turn(get_task("arithmetic"))
    for bad, match in [({"max_digits": 0}, "max_digits"), ({"ops": "/"}, "ops"), ({"turns": 3}, "turns")]:
        with pytest.raises(ValueError, match=match):
            ToolCalcTask(**bad)

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.tasks.arithmetic import ArithmeticTask
from offpolicy.tasks.base import parse_int


def test_reward_hand_checked():
    task = ArithmeticTask()
    completions = ["46", " 46\n", "47", "-46", "4 6", "46abc", "", "+46", "٤٦"]
    # exact (whitespace ignored) → 1; another integer → 0.1; not exactly one ASCII integer → 0
    assert task.reward(completions, answer=["46"] * 9) == [1.0, 1.0, 0.1, 0.1, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert task.reward(["-2", "2"], answer=["-2", "-2"]) == [1.0, 0.1]


def test_examples_are_correct_and_deterministic():
    task = ArithmeticTask(max_digits=3)
    a, b = task.examples(200, seed=5), task.examples(200, seed=5)
    assert a == b and a != task.examples(200, seed=6)
    for ex in a:
        x, op, y = ex.meta["a"], ex.meta["op"], ex.meta["b"]
        assert ex.prompt == f"{x}{op}{y}="
        assert int(ex.answer) == (x + y if op == "+" else x - y)
        assert x < 1000 and y < 1000
    # short and long operands both occur (digit count drawn first)
    assert {len(str(ex.meta["a"])) for ex in a} == {1, 2, 3}


def test_reference_answers_get_full_reward():
    task = ArithmeticTask()
    ex = task.examples(50, seed=0)
    assert task.reward([e.answer for e in ex], answer=[e.answer for e in ex]) == [1.0] * 50


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="max_digits"):
        ArithmeticTask(max_digits=0)
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(ops="*")


@settings(max_examples=50, deadline=None)
@given(st.integers(-10**6, 10**6), st.sampled_from(["", " ", "\n"]))
def test_parse_int_roundtrip(n, pad):
    assert parse_int(f"{pad}{n}{pad}") == n

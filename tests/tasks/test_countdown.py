from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.tasks.countdown import CountdownTask, expression_numbers, safe_eval


def test_safe_eval_hand_checked():
    assert safe_eval("1+2*3") == 7  # precedence: 2*3 first
    assert safe_eval("(1+2)*3") == 9
    assert safe_eval("8/4/2") == 1  # left-associative: (8/4)/2
    assert safe_eval("10-4-3") == 3  # (10-4)-3
    assert safe_eval("7/2") == Fraction(7, 2)  # exact, no float rounding
    assert safe_eval(" ( 3 * 5 ) + 7 ") == 22


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os').system('true')",
        "2**10",
        "-3+5",  # unary minus is not allowed: numbers come from the puzzle
        "1.5+2",
        "abs(3)",
        "3 5",
        "(1+2",
        "1+2)",
        "1+",
        "",
        "1/0",
        "1/(2-2)",
        "(" * 40 + "1" + ")" * 40,
        "1+" * 150 + "1",
        "x",
        "1;2",
    ],
)
def test_safe_eval_rejects_non_arithmetic(expr):
    with pytest.raises(ValueError):
        safe_eval(expr)


def test_reward_hand_checked():
    task = CountdownTask()
    # numbers 3 5 7, target 22
    completions = ["3*5+7", "7+3*5", "(3*5)+7", "3*5+7+0", "3*7+5", "5*3+7 ", "22", "3*5", "3+5+7", "eval('22')"]
    expected = [1.0, 1.0, 1.0, 0.1, 0.1, 1.0, 0.1, 0.1, 0.1, 0.0]
    # "3*5+7+0" reaches 22 but uses an extra number; "3*7+5" = 26; "22" uses no given number
    assert task.reward(completions, answer=["(3*5)+7"] * 10) == expected
    # explicit numbers/target columns take precedence over the answer column
    assert task.reward(["3*5+7"], answer=["(3*5)+7"], numbers=[[3, 5, 7]], target=[23]) == [0.1]


def test_examples_are_solvable_and_deterministic():
    task = CountdownTask(n_numbers=4)
    ex = task.examples(100, seed=1)
    assert ex == task.examples(100, seed=1)
    for e in ex:
        assert safe_eval(e.answer) == e.meta["target"] and 0 < e.meta["target"] <= 999
        assert sorted(expression_numbers(e.answer)) == sorted(e.meta["numbers"])
        assert e.prompt == f"Use {' '.join(map(str, e.meta['numbers']))} to make {e.meta['target']}:"
    rewards = task.reward(
        [e.answer for e in ex],
        answer=[e.answer for e in ex],
        numbers=[e.meta["numbers"] for e in ex],
        target=[e.meta["target"] for e in ex],
    )
    assert rewards == [1.0] * 100


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet="0123456789+-*/() abcx._'", max_size=40))
def test_safe_eval_never_crashes_otherwise(expr):
    """Arbitrary input either evaluates to a Fraction or raises ValueError — nothing else escapes."""
    try:
        assert isinstance(safe_eval(expr), Fraction)
    except ValueError:
        pass

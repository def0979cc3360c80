"""The free-digits task: hand-checked rewards, many right answers, the copy policy's known score, bad options."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.tasks import BUILTIN_TASKS, get_task
from offpolicy.tasks.free_digits import FreeDigitsTask, free_digit_validity


def test_reward_hand_checked():
    task = FreeDigitsTask(length=8, period=4, free=2)
    # pattern "4817", free slots 2 and 3 (the last two of each period): 1 and 7 must change every period.
    # "48234856": 4 8 repeat; 2 ≠ 1, 3 ≠ 7, then 5 ≠ 2, 6 ≠ 3                    → 8/8
    # "48174817": a copy: the four free positions repeat                         → 4/8
    # "48234823": second period's free slots repeat 2 and 3                       → 6/8
    # "4823 48": 4 8 2 3 right; the space is no digit; the next 4 should copy the 8 a period back (wrong); the 8
    #            lands in a free slot and differs from the 2 a period back (right)      → 5/8
    # "99999999": first period: 9 ≠ 4, 9 ≠ 8 wrong, 9 ≠ 1, 9 ≠ 7 right; second period: the fixed slots copy the 9s
    #             written a period back (right, local validity), the free slots repeat them (wrong) → 4/8
    completions = ["48234856", "48174817", "48234823", "4823 48", "99999999"]
    assert task.reward(completions, answer=["-"] * 5, pattern=["4817"] * 5) == [1.0, 0.5, 0.75, 0.625, 0.5]


def test_registered_and_options():
    assert BUILTIN_TASKS["free_digits"] is FreeDigitsTask
    assert get_task("free_digits", length=16, free=2) == FreeDigitsTask(length=16, free=2)
    for bad, match in [({"free": 5}, "free must be ≤ period"), ({"free": 0}, "free must be an int"),
                       ({"length": True}, "length must be an int")]:
        with pytest.raises(ValueError, match=match):
            FreeDigitsTask(**bad)
    with pytest.raises(ValueError, match="pattern"):
        FreeDigitsTask().reward(["1"], answer=["1"])


def test_examples_deterministic_and_prompt_like_pattern():
    from offpolicy.tasks import PatternTask

    a = FreeDigitsTask().examples(50, seed=3)
    assert a == FreeDigitsTask().examples(50, seed=3) != FreeDigitsTask().examples(50, seed=4)
    # the same prompts as the pattern task (the lab model's format)
    assert [e.prompt for e in a] == [e.prompt for e in PatternTask().examples(50, seed=3)]


@settings(max_examples=60, deadline=None)
@given(period=st.integers(1, 6), data=st.data(), length=st.integers(1, 40), seed=st.integers(0, 10**6))
def test_properties(period, data, length, seed):
    free = data.draw(st.integers(1, period))
    task = FreeDigitsTask(length=length, period=period, free=free)
    ex = task.examples(1, seed)[0]
    p = ex.meta["pattern"]
    assert task.reward([ex.answer], answer=[ex.answer], pattern=[p]) == [1.0]  # the reference answer is right
    # the copy policy (the pattern task's answer) gets exactly the fixed slots right
    copy = (p * (length // period + 1))[:length]
    fixed = sum(1 for t in range(length) if t % period < period - free)
    assert free_digit_validity(p, copy, length, free) == pytest.approx(fixed / length)
    # any right answer stays right when a free slot takes another digit that still differs from its neighbours:
    # many answers are right (9 choices per free position)
    alt = list(ex.answer)
    t = next(t for t in range(length) if t % period >= period - free) if length > period - free else None
    if t is not None:
        before = (p + ex.answer)[t]  # the character one period earlier
        after = ex.answer[t + period] if t + period < length else None
        choice = next(d for d in "0123456789" if d not in (before, after, ex.answer[t]))
        alt[t] = choice
        assert free_digit_validity(p, "".join(alt), length, free) == 1.0
    # arbitrary text: reward in [0, 1]
    text = data.draw(st.text(alphabet="0123456789x", max_size=length + 3))
    assert 0.0 <= free_digit_validity(p, text, length, free) <= 1.0

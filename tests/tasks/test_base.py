import math

import pytest
import torch

from offpolicy.tasks.base import RewardError, check_rewards, compute_rewards


def test_check_rewards_accepts_numbers():
    assert check_rewards([1, 0.5, torch.tensor(0.25)], ["a", "b", "c"]) == [1.0, 0.5, 0.25]


@pytest.mark.parametrize(
    "rewards, message",
    [
        ([1.0, float("nan")], r"sample 1 \(completion 'b'\) is nan"),
        ([math.inf, 0.0], r"sample 0 \(completion 'a'\) is inf"),
        ([1.0, None], r"sample 1 .* is None of type NoneType, not a number"),
        ([1.0, "1"], r"sample 1 .* of type str"),
        ([True, 1.0], r"sample 0 .* of type bool"),
        ([1.0], "got 1 rewards for 2 completions"),
        (0.5, "must be a list"),
    ],
)
def test_check_rewards_rejects_garbage(rewards, message):
    with pytest.raises(RewardError, match=message):
        check_rewards(rewards, ["a", "b"])
    assert issubclass(RewardError, ValueError)


def test_compute_rewards_names_the_sample_that_raises():
    def fragile(completions, *, answer):
        return [1.0 / int(c) for c in completions]  # "0" → ZeroDivisionError

    assert compute_rewards(fragile, ["1", "2"], answer=["x", "y"]) == [1.0, 0.5]
    with pytest.raises(RewardError, match=r"'fragile' raised on sample 2 \(completion '0'\).*ZeroDivisionError") as err:
        compute_rewards(fragile, ["1", "2", "0"], answer=["x"] * 3)
    assert isinstance(err.value.__cause__, ZeroDivisionError)


def test_compute_rewards_nan_is_an_error_not_zero():
    with pytest.raises(RewardError, match="sample 0"):
        compute_rewards(lambda completions, **kw: [float("nan")], ["x"], answer=["y"])


def test_compute_rewards_checks_column_lengths():
    with pytest.raises(ValueError, match="column 'answer'"):
        compute_rewards(lambda completions, **kw: [0.0], ["x"], answer=["y", "z"])

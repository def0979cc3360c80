"""Task protocol, examples and reward validation.

A reward function has TRL's signature ``reward(completions, **columns) -> list[float]``: dataset columns (here
``answer`` plus any ``Example.meta`` keys) arrive as keyword lists aligned with ``completions``. A reward that
raises, returns a non-number or NaN must stop the run with the sample named — never become a silent 0.
"""

from __future__ import annotations

import math
import numbers
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

RewardFn = Callable[..., Sequence[float]]


@dataclass(frozen=True)
class Example:
    """One prompt with its reference answer; ``meta`` holds extra dataset columns (passed to rewards as kwargs)."""

    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Task(Protocol):
    """A verifiable task: deterministic examples and a TRL-style reward function."""

    name: str

    def examples(self, n: int, seed: int) -> list[Example]: ...

    def reward(self, completions: list[str], *, answer: list[str], **kwargs: Any) -> list[float]: ...


@runtime_checkable
class MultiTurnTask(Task, Protocol):
    """A task answered in ``turns`` policy turns with the environment's text between them.

    ``respond(prompt, turns, **meta)`` is the environment's answer (plain text, tokenized on its own by the rollout)
    after the policy's decoded ``turns`` so far; ``reward`` judges the final turn's text. See
    :class:`~offpolicy.tasks.tool_calc.ToolCalcTask` and :mod:`offpolicy.rollout.multi_turn`.
    """

    turns: int

    def respond(self, prompt: str, turns: list[str], **meta: Any) -> str: ...


def is_multi_turn(task: Any) -> bool:
    """Whether ``task`` is answered in several policy turns (a :class:`MultiTurnTask` with ``turns`` > 1).

    >>> from offpolicy.tasks.tool_calc import ToolCalcTask
    >>> from offpolicy.tasks.arithmetic import ArithmeticTask
    >>> is_multi_turn(ToolCalcTask()), is_multi_turn(ArithmeticTask())
    (True, False)
    """
    return callable(getattr(task, "respond", None)) and int(getattr(task, "turns", 1)) > 1


class RewardError(ValueError):
    """A reward function failed on (or returned garbage for) a named sample."""


def _short(text: Any, limit: int = 60) -> str:
    s = repr(text)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def check_rewards(rewards: Any, completions: Sequence[str]) -> list[float]:
    """Validate rewards for ``completions``: one real, finite number each → ``list[float]``.

    Raises :class:`RewardError` (a ``ValueError``) naming the first bad sample and its completion.

    >>> check_rewards([1, 0.5], ["a", "b"])
    [1.0, 0.5]
    >>> check_rewards([1.0, float("nan")], ["a", "b"])
    Traceback (most recent call last):
    ...
    offpolicy.tasks.base.RewardError: reward for sample 1 (completion 'b') is nan; rewards must be finite numbers
    """
    if isinstance(rewards, (str, bytes)) or not hasattr(rewards, "__len__"):
        raise RewardError(f"rewards must be a list of numbers, got {type(rewards).__name__}")
    if len(rewards) != len(completions):
        raise RewardError(f"got {len(rewards)} rewards for {len(completions)} completions")
    out = []
    for i, (r, c) in enumerate(zip(rewards, completions)):
        if hasattr(r, "item") and getattr(r, "ndim", 0) == 0:  # 0-d tensor / numpy scalar
            r = r.item()
        if isinstance(r, bool) or not isinstance(r, numbers.Real):
            raise RewardError(
                f"reward for sample {i} (completion {_short(c)}) is {_short(r)} of type {type(r).__name__}, not a number"
            )
        if not math.isfinite(float(r)):
            raise RewardError(f"reward for sample {i} (completion {_short(c)}) is {float(r)}; rewards must be finite numbers")
        out.append(float(r))
    return out


def compute_rewards(reward_fn: RewardFn, completions: list[str], **columns: Any) -> list[float]:
    """Call ``reward_fn(completions, **columns)`` and :func:`check_rewards` the result.

    If the batch call raises, each sample is retried alone to name the one that fails; the original exception is
    chained. Columns must be lists aligned with ``completions``.

    >>> compute_rewards(lambda completions, answer: [float(c == a) for c, a in zip(completions, answer)],
    ...                 ["4", "5"], answer=["4", "4"])
    [1.0, 0.0]
    """
    for key, col in columns.items():
        if len(col) != len(completions):
            raise ValueError(f"column {key!r} has {len(col)} entries for {len(completions)} completions")
    name = getattr(reward_fn, "__name__", type(reward_fn).__name__)
    try:
        rewards = reward_fn(completions, **columns)
    except Exception as batch_error:
        for i, c in enumerate(completions):
            try:
                reward_fn([c], **{k: [v[i]] for k, v in columns.items()})
            except Exception as err:
                raise RewardError(f"reward function {name!r} raised on sample {i} (completion {_short(c)}): {err!r}") from err
        raise RewardError(f"reward function {name!r} raised on the batch: {batch_error!r}") from batch_error
    return check_rewards(rewards, completions)


def parse_int(text: str) -> int | None:
    """The integer a completion states (surrounding whitespace ignored), or None if it is not exactly one.

    >>> parse_int(" -42 "), parse_int("4 2"), parse_int("x")
    (-42, None, None)
    """
    s = text.strip()
    body = s[1:] if s[:1] in "+-" else s
    if not body or not body.isascii() or not body.isdigit():
        return None
    return int(s)


def exact_int_rewards(completions: Sequence[str], answers: Sequence[str], partial: float) -> list[float]:
    """Per completion: 1.0 when it states exactly the integer ``answer``, ``partial`` when it states another integer,
    0.0 when it states none (:func:`parse_int`).

    >>> exact_int_rewards(["7", " 8", "seven"], ["7", "7", "7"], 0.1)
    [1.0, 0.1, 0.0]
    """
    rewards = []
    for c, a in zip(completions, answers, strict=True):
        got = parse_int(c)
        rewards.append(0.0 if got is None else 1.0 if got == int(a) else float(partial))
    return rewards


def random_operand(rng: random.Random, max_digits: int) -> int:
    """An integer of 1 to ``max_digits`` digits, the number of digits drawn uniformly first (so short and long
    operands are equally common)."""
    digits = rng.randint(1, max_digits)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def check_int_options(*fields: tuple[str, Any, int, int]) -> None:
    """A task's integer options: each ``(name, value, low, high)`` must be an int in ``[low, high]`` (bools are not).

    >>> check_int_options(("length", 32, 1, 512))
    >>> check_int_options(("period", 0, 1, 16))
    Traceback (most recent call last):
    ...
    ValueError: period must be an int in [1, 16], got 0
    """
    for name, value, low, high in fields:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")

"""Built-in verifiable tasks (arithmetic, countdown, pattern, free_digits, the two-turn tool_calc), JSONL tasks and reward
validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from offpolicy.tasks.arithmetic import ArithmeticTask
from offpolicy.tasks.base import (
    Example,
    MultiTurnTask,
    RewardError,
    RewardFn,
    Task,
    check_rewards,
    compute_rewards,
    is_multi_turn,
)
from offpolicy.tasks.countdown import CountdownTask, safe_eval
from offpolicy.tasks.free_digits import FreeDigitsTask
from offpolicy.tasks.jsonl import JsonlTask, exact_match_reward
from offpolicy.tasks.pattern import PatternTask
from offpolicy.tasks.tool_calc import ToolCalcTask, evaluate_call

BUILTIN_TASKS = {"arithmetic": ArithmeticTask, "countdown": CountdownTask, "pattern": PatternTask,
                 "free_digits": FreeDigitsTask, "tool_calc": ToolCalcTask}
# A small JSONL task shipped as package data: the format example for ``--task path.jsonl``.
EXAMPLE_JSONL = Path(__file__).parent / "data" / "times_table.jsonl"


def get_task(name_or_path: str | Path, reward_fn: RewardFn | None = None, **options: Any) -> Task:
    """A built-in task by name ("arithmetic", "countdown", "pattern", "free_digits") or a :class:`JsonlTask` from a
    ``.jsonl`` path.

    ``reward_fn`` replaces the JSONL task's default exact match; built-in tasks have their own reward and
    reject one (ValueError) rather than silently ignoring it. ``options`` are a built-in task's arguments
    (``get_task("pattern", length=64)``); an unknown one is a ValueError naming it.

    >>> get_task("arithmetic").name
    'arithmetic'
    >>> get_task("sudoku")
    Traceback (most recent call last):
    ...
    ValueError: unknown task 'sudoku': use one of ['arithmetic', 'countdown', ...] or a path to a .jsonl file
    """
    key = str(name_or_path)
    if key in BUILTIN_TASKS:
        if reward_fn is not None:
            raise ValueError(f"reward_fn: built-in task {key!r} has its own reward; use a JSONL task for a custom one")
        try:
            return BUILTIN_TASKS[key](**options)
        except TypeError as err:  # an unknown keyword: name it instead of showing a constructor traceback
            raise ValueError(f"task options {sorted(options)} do not fit task {key!r}: {err}") from None
    if options:
        raise ValueError(f"task options {sorted(options)} only apply to built-in tasks, not {key!r}")
    if key.endswith(".jsonl") or Path(key).is_file():
        return JsonlTask(key, reward_fn=reward_fn)
    raise ValueError(f"unknown task {key!r}: use one of {sorted(BUILTIN_TASKS)} or a path to a .jsonl file")


__all__ = [
    "BUILTIN_TASKS",
    "EXAMPLE_JSONL",
    "ArithmeticTask",
    "CountdownTask",
    "Example",
    "FreeDigitsTask",
    "JsonlTask",
    "MultiTurnTask",
    "PatternTask",
    "RewardError",
    "RewardFn",
    "Task",
    "ToolCalcTask",
    "check_rewards",
    "compute_rewards",
    "evaluate_call",
    "exact_match_reward",
    "get_task",
    "is_multi_turn",
    "safe_eval",
]

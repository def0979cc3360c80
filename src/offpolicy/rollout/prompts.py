"""A rollout's prompts and its rewards: a task's examples tokenised for the engine, and the task's checked rewards of
the completions, laid out as the trainer groups them (``group_size`` completions per prompt, prompt-major).

Used by the trainer's rollout step and by the warm start's evaluation (:func:`offpolicy.models.evaluate_reward`).
Rewards go through :func:`offpolicy.tasks.compute_rewards`, which names the sample whose reward raised or was NaN.

>>> from offpolicy.tasks import get_task
>>> from offpolicy.models.tokenizer import build_tokenizer
>>> p = step_prompts(get_task("arithmetic"), build_tokenizer(), 2, seed=0)
>>> len(p), p[0].example.prompt, p[0].ids[0] == build_tokenizer().bos_token_id
(2, '63-4=', True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from offpolicy.tasks import Example, RewardError
from offpolicy.tasks import compute_rewards as _checked_rewards


@dataclass(frozen=True)
class Prompt:
    """One example and its token ids (as the engine and the scorer receive them)."""

    example: Example
    ids: list[int]


def step_prompts(task: Any, tokenizer: Any, n: int, seed: int) -> list[Prompt]:
    """``n`` prompts for one step, tokenised (the tokenizer adds bos when it is configured to)."""
    out = []
    for ex in task.examples(n, seed):
        ids = list(tokenizer(ex.prompt)["input_ids"])
        if not ids:
            raise ValueError(f"task {getattr(task, 'name', task)!r}: prompt {ex.prompt!r} tokenises to nothing")
        out.append(Prompt(ex, ids))
    return out


def compute_rewards(task: Any, prompts: list[Prompt], group_size: int, texts: list[str] | None,
                    completions: list[list[int]]) -> Tensor:
    """Rewards ``[B]`` (float32) for ``group_size`` completions per prompt, laid out prompt-major.

    A reward function that raises, or returns NaN / a non-number, raises :class:`RewardError` naming the sample
    (its index, prompt and completion).
    """
    if texts is None:
        raise ValueError("the rollout engine returned no texts (no tokenizer?): rewards need decoded completions")
    examples = [p.example for p in prompts for _ in range(group_size)]
    columns: dict[str, list[Any]] = {"answer": [e.answer for e in examples]}
    for key in examples[0].meta if examples else ():
        columns[key] = [e.meta.get(key) for e in examples]
    try:
        rewards = _checked_rewards(task.reward, list(texts), **columns)
    except RewardError as err:
        raise RewardError(f"task {getattr(task, 'name', '?')!r}: {err} [prompts: "
                          f"{[p.example.prompt for p in prompts][:8]}]") from err
    return torch.tensor(rewards, dtype=torch.float32)

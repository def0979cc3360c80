"""Trainer-side glue to :mod:`offpolicy.tasks`: the task a config names, with its reward function.

Prompts per step and checked rewards (:func:`step_prompts`, :func:`compute_rewards`, :class:`Prompt`) live in
:mod:`offpolicy.rollout.prompts`, below the trainer, where the warm start's evaluation reaches them too. Prompts are drawn fresh each step from ``task.examples(n, seed)`` with a seed derived
from ``(run.seed, step)``, so a resumed run needs no data-loader state.

>>> from offpolicy.rollout.prompts import step_prompts
>>> from offpolicy.tasks import get_task
>>> from offpolicy.models.tokenizer import build_tokenizer
>>> p = step_prompts(get_task("arithmetic"), build_tokenizer(), 2, seed=0)
>>> len(p), p[0].example.prompt, p[0].ids[0] == build_tokenizer().bos_token_id
(2, '63-4=', True)
"""

from __future__ import annotations

import importlib
from typing import Any

from offpolicy.tasks import get_task

__all__ = ["load_task", "resolve_reward_fn"]


def resolve_reward_fn(spec: str | None):  # -> RewardFn | None
    """``"package.module:function"`` → the function (a local import; nothing is downloaded)."""
    if spec is None:
        return None
    if ":" not in spec:
        raise ValueError(f"task.reward_fn {spec!r} must look like 'package.module:function'")
    mod, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"task.reward_fn {spec!r} cannot be imported: {err}") from err
    if not callable(fn):
        raise ValueError(f"task.reward_fn {spec!r} is not callable")
    return fn


def load_task(task_cfg: Any):  # -> Task
    """The task named by ``task.name`` (built-in or a JSONL path), with ``task.options`` / ``task.reward_fn``."""
    return get_task(task_cfg.name, reward_fn=resolve_reward_fn(task_cfg.reward_fn), **task_cfg.options)

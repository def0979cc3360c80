"""Shared fixtures for the trainer tests: a very small random model and a task whose reward varies."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest

from offpolicy.tasks import Example

TINY = "{num_hidden_layers: 2, hidden_size: 32, intermediate_size: 64, num_attention_heads: 2, num_key_value_heads: 1}"


@dataclass
class VaryingTask:
    """Reward = fraction of digit characters in the completion (varies across random samples, so A ≠ 0)."""

    name: str = "varying"
    fail: str | None = None  # "raise" | "nan": a broken reward for the error-path tests

    def examples(self, n: int, seed: int) -> list[Example]:
        return [Example(prompt=f"{seed % 97 + i}+1=", answer=str(seed % 97 + i + 1)) for i in range(n)]

    def reward(self, completions: list[str], *, answer: list[str], **kwargs: Any) -> list[float]:
        if self.fail == "raise":
            raise RuntimeError("boom")
        out = [sum(ch.isdigit() for ch in c) / max(len(c), 1) + 0.1 * len(c) for c in completions]
        if self.fail == "nan":
            out[1] = float("nan")
        return out


def overrides(tmp_path, preset: str = "naive", steps: int = 2, **extra: Any) -> list[str]:
    ov = [
        f"algorithm.preset={preset}", "model.path=tiny-random", f"model.tiny_config={TINY}", f"run.steps={steps}",
        f"run.out_dir={tmp_path}", "run.progress=false", "run.tensorboard=false", "task.prompts_per_step=2",
        "algorithm.group_size=2", "rollout.sampling.max_new_tokens=4", "optim.lr=1e-3",
    ]
    if preset == "alp":
        ov += ["alp.enabled=true", "alp.init_std=0.01"]
    ov += [f"{k.replace('__', '.')}={v}" for k, v in extra.items()]
    return ov


@pytest.fixture(scope="session")
def tiny_pair():
    from offpolicy.models.tiny import build_tiny_model

    return build_tiny_model(0, num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                            num_key_value_heads=1)


@pytest.fixture
def fresh(tiny_pair):
    """A fresh copy of the tiny model (identical weights every time) and its tokenizer."""
    model, tok = tiny_pair
    return copy.deepcopy(model), tok


@pytest.fixture
def make_overrides():
    return overrides


@pytest.fixture
def varying_task():
    return VaryingTask

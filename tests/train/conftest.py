"""Shared fixtures for the trainer tests: a very small random model and its config overrides (the task whose reward
varies is in tests/conftest.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

TINY = "{num_hidden_layers: 2, hidden_size: 32, intermediate_size: 64, num_attention_heads: 2, num_key_value_heads: 1}"


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


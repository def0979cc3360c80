"""Shared pieces of the lab tests: tiny trainer overrides and the fake trainer command."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

FAKE = str(Path(__file__).with_name("fake_trainer.py"))

# A real trainer run of this size takes about a second once the zygote has torch imported.
TINY_RUN = [
    "model.path=tiny-random",
    "model.tiny_config={num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64, num_attention_heads: 2, "
    "num_key_value_heads: 1}",
    "task.prompts_per_step=2",
    "algorithm.group_size=2",
    "task.options={length: 4}",
    "rollout.sampling.max_new_tokens=4",
    "optim.lr=1e-3",
]


def fake_command(overrides, resume):
    return [sys.executable, FAKE, *overrides, *(["--resume"] if resume else [])]


def read_events(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.is_file() else []


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """The fake trainer: ``command`` for ``run_sweep(command=...)``, ``events()`` its start / end records."""
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv("FAKE_EVENTS", str(path))
    monkeypatch.setenv("FAKE_STEP_S", "0.02")
    monkeypatch.delenv("FAKE_FAIL", raising=False)
    events = lambda: read_events(path)  # noqa: E731

    def ctrl_c_after_starts(n: int, timeout_s: float = 60.0) -> None:
        """In a background thread: once ``n`` fake runs have started, SIGINT this process only (the sweep runner),
        as a terminal's Ctrl-C would reach it."""
        def press() -> None:
            deadline = time.time() + timeout_s
            while sum(e["event"] == "start" for e in events()) < n and time.time() < deadline:
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=press, daemon=True).start()

    return SimpleNamespace(command=fake_command, events=events, path=FAKE, ctrl_c_after_starts=ctrl_c_after_starts)


@pytest.fixture
def tiny_run():
    """Trainer overrides for a real run of about a second (tiny random model, 4-token answers)."""
    return list(TINY_RUN)

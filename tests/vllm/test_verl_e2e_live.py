"""verl end to end on a CPU: ``python -m verl.trainer.main_ppo`` (verl 0.9.1's own trainer loop, Ray local, the FSDP2
actor, vLLM's CPU build as verl's rollout) trains the embedded tiny model with the plug-in — weights pushed into vLLM
after every step, TIS on, the sync check after every sync — through examples/verl_end_to_end.py; then a run whose
harness makes the push do nothing from step 2 must fail naming that step's sync.

Slow (minutes on 2 cores each): marked ``slow``. Skipped without verl, ``transfer_queue`` or vLLM (this folder's
conftest skips without vLLM).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl is not installed (pip install 'offpolicy[verl-ci]')")
pytest.importorskip("transfer_queue", reason="verl's v1 trainer needs transfer_queue (pip install transferqueue)")
pytest.importorskip("ray", reason="verl's trainer needs Ray")

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "verl_end_to_end.py"
STEPS = 6


def _example():
    spec = importlib.util.spec_from_file_location("verl_end_to_end_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return _example()


def test_main_ppo_trains_with_every_sync_checked(example, tmp_path):
    result = example.run(STEPS, log=tmp_path / "main_ppo.log")
    assert result["rc"] == 0, result["tail"]
    assert result["steps"] == STEPS, result["tail"]
    # the initial sync (calibration) and one per step, every one passed and logged under verl's step metrics
    assert result["checks"] == STEPS + 1 and result["passed"] == STEPS + 1, result["tail"]
    assert result["sync_ok"] == [1.0] * STEPS
    assert math.isfinite(result["reward_first"]) and math.isfinite(result["reward_last"])
    text = Path(result["log"]).read_text(errors="replace")
    assert "rollout_corr/" in text  # TIS ran in the driver after verl's advantages


def test_a_push_that_does_nothing_fails_the_run_naming_the_sync(example, tmp_path):
    result = example.run(STEPS, break_sync_at=2, log=tmp_path / "main_ppo_broken.log")
    assert result["rc"] != 0, result["tail"]
    text = Path(result["log"]).read_text(errors="replace")
    assert "SyncCheckError" in text and "verl step 2: " in text, result["tail"]
    assert result["steps"] <= 2  # step 1 was logged; step 2's sync stopped the run before its metrics

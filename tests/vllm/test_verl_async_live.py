"""verl's asynchronous loops end to end on a CPU with the plug-in, through examples/verl_end_to_end.py ``--loop``:
``python -m offpolicy.integrations.verl.async_loops LOOP`` runs verl 0.9.1's own ``main`` of the loop (Ray local, the
FSDP2 actor in its own pool, one vLLM CPU server in another, the weights over the test kit's CPU checkpoint engine,
:mod:`offpolicy_testkit.verl_async`) with the plug-in's trainer in front of verl's: TIS after verl's advantages
(``rollout_corr/*``), the staleness of each trajectory (``offpolicy/staleness/*``) and the sync check after every
weight sync (``sync/*``).

One launch per loop: a few steps train with every sync checked and passing, then the push does nothing from a
later sync on (examples/verl_end_to_end.py ``break_sync_at``) and the run must stop at the first sync after the actor's
weights moved, with the sync check's error naming it, no step line after it and every check before it passed.

* one-step off-policy: the batch of step k was sampled by the weights synced at step k − 1, so every trajectory is one
  version stale; steps 1 and 2 train, the push does nothing from step 3's sync;
* fully async (partial rollouts on, a sync after every step): steps 1 and 2 train on samples at most one version
  stale, each trajectory's version span (``min_global_steps`` / ``max_global_steps``) reaching the metrics; the push
  does nothing from step 4's sync (verl logs a step's metrics at the next sync).

What the merged runs do not show: a loop running to its end with the plug-in in front (each run stops at the broken
sync); that the last step's sync is checked too.

The runs are slow (minutes on 2 cores, most of it verl's and vLLM's start-up): marked ``slow``. Skipped without verl,
``transfer_queue`` or vLLM (this folder's conftest skips without vLLM).
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl is not installed (pip install 'offpolicy[verl-ci]')")
pytest.importorskip("transfer_queue", reason="verl's trainer needs transfer_queue (pip install transferqueue)")
pytest.importorskip("ray", reason="verl's trainer needs Ray")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "verl_end_to_end.py"
SAMPLES = 4  # per prompt: GRPO's advantages are 0 when a prompt's samples score alike, and the weights do not move


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("verl_end_to_end_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_broken_run(result: dict, steps: int, break_sync_at: int, first_line: int) -> tuple[int, list[dict]]:
    """A run whose push does nothing from sync ``break_sync_at`` (after the initial one): it failed with the sync
    check's error naming a verl step F ≥ ``break_sync_at`` (later only when a step moved no weight: GRPO's advantages
    are 0 when a prompt's samples score alike), and before it every sync was checked and passed and every step
    line is there — the lines ``first_line`` … F − 1, one each, the line of step s carrying the checks of the initial
    sync and of steps 1 … s + 1 − ``first_line``; TIS ran on each. Returns F and the lines' metrics."""
    assert result["rc"] != 0, result["tail"]
    text = Path(result["log"]).read_text(errors="replace")
    failed = re.search(r"SyncCheckError: verl step (\d+): weight sync into the rollout engine: ", text)
    assert failed, result["tail"]
    failed_step = int(failed.group(1))
    assert break_sync_at <= failed_step <= steps, result["tail"]
    lines = result["sync_records"]  # verl's file logger's records carrying the sync check
    assert [s for s, _ in lines] == list(range(first_line, failed_step)), result["tail"]
    assert len(lines) < steps
    # the initial sync (calibration) and each step's before the failed one ran and passed; the failed one logs none
    assert result["checks_run"] == failed_step, result["tail"]
    logged = [m for _, m in lines]
    for i, m in enumerate(logged):
        assert m["sync/ok"] == 1.0
        assert m["sync/checks"] == m["sync/passed"] == i + 2  # the initial sync and one per step so far
        assert m["rollout_corr/tis/kept_frac"] == 1.0  # TIS ran in the trainer, after verl's advantages
        corr = {k: v for k, v in m.items() if k.startswith(("rollout_corr/", "offpolicy/staleness/", "sync/"))}
        assert all(math.isfinite(v) for k, v in corr.items() if k not in ("sync/stale_fraction", "sync/engine_motion"))
        assert m["offpolicy/staleness/max"] >= m["offpolicy/staleness/mean"] >= 0.0
    return failed_step, logged


@pytest.mark.slow
def test_one_step_off_policy_trains_one_version_stale_then_a_push_that_does_nothing_fails_naming_the_sync(
        example, tmp_path):
    """One launch: the push does nothing from the third sync after the initial one on (step 3's). Step k's sync
    (before its training) pushes step k − 1's update and is checked in step k's line, so steps 1 and 2 train with
    their syncs checked and passed, and the run stops at the first sync after the actor's weights moved — step 3's
    unless step 2 moved no weight (then step 4's, or 5's)."""
    steps = 5
    result = example.run(steps, samples=SAMPLES, loop="one_step_off_policy", break_sync_at=3,
                         log=tmp_path / "one_step.log")
    failed_step, logged = _check_broken_run(result, steps, break_sync_at=3, first_line=1)
    assert len(logged) >= 2  # steps 1 and 2 at least
    for m in logged:  # sampled by the weights synced one step earlier: one version stale, one version each
        assert m["offpolicy/staleness/mean"] == 1.0 and m["offpolicy/staleness/span_max"] == 0.0
        assert m["offpolicy/staleness/d1/tokens"] > 0
    text = Path(result["log"]).read_text(errors="replace")
    assert "'backend': 'offpolicy_cpu'" in text  # the weights went over the test kit's checkpoint engine


@pytest.mark.slow
def test_fully_async_trains_with_partial_rollouts_then_a_push_that_does_nothing_fails_naming_the_sync(
        example, tmp_path):
    """One launch: the push does nothing from the fourth sync after the initial one on. verl's fully async
    trainer syncs at the end of each step k (version k, checked there) and logs step k's metrics (aggregated over
    its sync cycle) under step k + 1 at the next sync, after that sync's check: the lines step:2 and step:3
    (steps 1 and 2, their syncs checked and passed) come before the run stops at step 4's sync — later only when
    step 4 moved no weight. The check scores the probe on the replica's own server while the rollouter keeps
    sampling."""
    steps = 5
    result = example.run(steps, samples=SAMPLES, loop="fully_async", break_sync_at=4,
                         log=tmp_path / "fully_async.log")
    failed_step, logged = _check_broken_run(result, steps, break_sync_at=4, first_line=2)
    assert len(logged) >= 2  # steps 1 and 2 at least
    assert logged[0]["offpolicy/staleness/max"] == 0.0  # step 1 trains on samples of version 0, at version 0
    for m in logged:  # samples at most staleness_threshold = 1 version behind, each within the versions it spans
        assert m["offpolicy/staleness/max"] <= 1.0
        assert 0.0 <= m["offpolicy/staleness/span_mean"] <= m["offpolicy/staleness/span_max"] <= 1.0
    text = Path(result["log"]).read_text(errors="replace")
    assert "'partial_rollout': True" in re.sub(r"\s+", " ", text)

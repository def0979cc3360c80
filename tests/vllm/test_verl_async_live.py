"""verl's asynchronous loops end to end on a CPU with the plug-in, through examples/verl_end_to_end.py ``--loop``:
``python -m offpolicy.integrations.verl.async_loops LOOP`` runs verl 0.9.1's own ``main`` of the loop (Ray local, the
FSDP2 actor in its own pool, one vLLM CPU server in another, the weights over the test kit's CPU checkpoint engine,
:mod:`offpolicy_testkit.verl_async`) with the plug-in's trainer in front of verl's: TIS after verl's advantages
(``rollout_corr/*``), the staleness of each trajectory (``offpolicy/staleness/*``) and the sync check after every
weight sync (``sync/*``).

* one-step off-policy: the batch of step k was sampled by the weights synced at step k − 1, so every trajectory is one
  version stale; every sync checked; then a run whose push does nothing from the second sync must stop at the first
  sync after the actor's weights moved, naming it;
* fully async (partial rollouts on, a sync after every step): the same, with each trajectory's version span
  (``min_global_steps`` / ``max_global_steps``) reaching the metrics.

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


def _step_metrics(text: str) -> list[dict]:
    """The training steps' console lines (those carrying the sync check; the fully async trainer also logs timing
    lines under the same step numbers)."""
    steps = []
    for line in text.splitlines():
        m = re.search(r"step:(\d+) - (.*)", line)
        if m and "sync/ok:" in line:
            metrics = {}
            for item in m.group(2).split(" - "):
                key, _, value = item.partition(":")
                value = re.sub(r"^np\.\w+\((.*)\)$", r"\1", value.strip())
                try:
                    metrics[key.strip()] = float(value)
                except ValueError:
                    pass
            steps.append(metrics)
    return steps


def _check_trained(result: dict, steps: int, logged_steps: int) -> list[dict]:
    assert result["rc"] == 0, result["tail"]
    logged = _step_metrics(Path(result["log"]).read_text(errors="replace"))
    assert len(logged) == logged_steps, result["tail"]
    last = logged[-1]
    # the initial sync (calibration) and one per step ran, every logged one passed (a failed one stops the run)
    assert result["checks_run"] == steps + 1, result["tail"]
    assert [m["sync/ok"] for m in logged] == [1.0] * logged_steps
    assert last["sync/checks"] == last["sync/passed"] >= logged_steps
    for m in logged:
        assert m["rollout_corr/tis/kept_frac"] == 1.0  # TIS ran in the trainer, after verl's advantages
        corr = {k: v for k, v in m.items() if k.startswith(("rollout_corr/", "offpolicy/staleness/", "sync/"))}
        assert all(math.isfinite(v) for k, v in corr.items() if k not in ("sync/stale_fraction", "sync/engine_motion"))
        assert m["offpolicy/staleness/max"] >= m["offpolicy/staleness/mean"] >= 0.0
    return logged


@pytest.mark.slow
def test_one_step_off_policy_trains_one_version_stale_with_every_sync_checked(example, tmp_path):
    result = example.run(2, samples=SAMPLES, loop="one_step_off_policy", log=tmp_path / "one_step.log")
    logged = _check_trained(result, 2, 2)
    assert logged[-1]["sync/checks"] == 3.0  # the initial sync and the sync of each step
    for m in logged:  # sampled by the weights synced one step earlier: one version stale, one version each
        assert m["offpolicy/staleness/mean"] == 1.0 and m["offpolicy/staleness/span_max"] == 0.0
        assert m["offpolicy/staleness/d1/tokens"] > 0
    text = Path(result["log"]).read_text(errors="replace")
    assert "'backend': 'offpolicy_cpu'" in text  # the weights went over the test kit's checkpoint engine


@pytest.mark.slow
def test_one_step_off_policy_a_push_that_does_nothing_fails_the_run_naming_the_sync(example, tmp_path):
    """The push does nothing from the second sync on (step 2's): the run must stop at the first sync after the
    actor's weights moved — step 2's unless a step had all-equal rewards (no gradient)."""
    result = example.run(4, samples=SAMPLES, loop="one_step_off_policy", break_sync_at=2,
                         log=tmp_path / "one_step_broken.log")
    assert result["rc"] != 0, result["tail"]
    text = Path(result["log"]).read_text(errors="replace")
    assert "SyncCheckError" in text, result["tail"]
    failed = re.search(r"verl step (\d+): weight sync into the rollout engine: ", text)
    assert failed, result["tail"]
    logged = _step_metrics(text)
    assert int(failed.group(1)) >= 2 and len(logged) < 4
    assert [m["sync/ok"] for m in logged] == [1.0] * len(logged)  # every sync before the broken ones passed


@pytest.mark.slow
def test_fully_async_trains_with_partial_rollouts_and_every_sync_checked(example, tmp_path):
    """3 steps: verl's fully async trainer logs a step's metrics (aggregated over its sync cycle) at the next
    sync, so the last step's never reach the log — 2 step lines, 4 checks."""
    result = example.run(3, samples=SAMPLES, loop="fully_async", log=tmp_path / "fully_async.log")
    logged = _check_trained(result, 3, 2)
    assert logged[0]["offpolicy/staleness/max"] == 0.0  # step 1 trains on samples of version 0, at version 0
    for m in logged:  # samples at most staleness_threshold = 1 version behind, each within the versions it spans
        assert m["offpolicy/staleness/max"] <= 1.0
        assert 0.0 <= m["offpolicy/staleness/span_mean"] <= m["offpolicy/staleness/span_max"] <= 1.0
    text = Path(result["log"]).read_text(errors="replace")
    assert "'partial_rollout': True" in re.sub(r"\s+", " ", text)


@pytest.mark.slow
def test_fully_async_a_push_that_does_nothing_fails_the_run_naming_the_sync(example, tmp_path):
    """The push does nothing from the second sync on: the trainer's check after that sync stops the run (the
    rollouter keeps sampling meanwhile; the check scores the probe on the replica's own server)."""
    result = example.run(3, samples=SAMPLES, loop="fully_async", break_sync_at=2,
                         log=tmp_path / "fully_async_broken.log")
    assert result["rc"] != 0, result["tail"]
    text = Path(result["log"]).read_text(errors="replace")
    failed = re.search(r"SyncCheckError: verl step (\d+): weight sync into the rollout engine: ", text)
    assert failed and int(failed.group(1)) >= 2, result["tail"]
    assert result["checks_run"] >= 2  # the initial sync and step 1's passed before it

"""One writer per run folder, as a user meets it: two ``offpolicy train`` on one ``run.out_dir``, and a ``kill -9``.

Issue 19: two runs started a second apart into the same folder both exited 0 and interleaved their metrics. Now the
second is refused with one line naming the first; a run killed with SIGKILL leaves no lock that blocks the next run
or ``--resume``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform == "win32", reason="flock, SIGSTOP: POSIX")]


def _train(args, **kw):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    return [sys.executable, "-m", "offpolicy.cli", "train", *args], {"env": env, **kw}


def _owner_pid(folder):
    try:
        return json.loads((folder / ".run.lock").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def _wait(cond, timeout=120.0):
    deadline = time.time() + timeout
    while not cond() and time.time() < deadline:
        time.sleep(0.05)
    return cond()


def _steps(folder):
    return [json.loads(ln)["step"] for ln in (folder / "metrics.jsonl").read_text().splitlines()]


def test_a_second_train_into_a_live_run_folder_is_refused(tmp_path, make_overrides):
    out = tmp_path / "run"
    args = [*make_overrides(out, steps=6), "run.threads=1", "run.checkpoint_every=2"]
    cmd, kw = _train(args)
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    try:
        assert _wait(lambda: _owner_pid(out) == first.pid or first.poll() is not None)
        os.kill(first.pid, signal.SIGSTOP)  # the first holds the folder (stopped, so it surely outlives the second)
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
        os.kill(first.pid, signal.SIGCONT)
        first_out, _ = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            os.kill(first.pid, signal.SIGCONT)
            first.kill()
    assert second.returncode != 0
    lines = [ln for ln in (second.stdout + second.stderr).splitlines() if ln.strip()]
    assert lines[-1].startswith(f"error: run.out_dir {str(out)!r} is in use by pid {first.pid} on host "), lines
    assert "(`offpolicy train algorithm.preset=naive model.path=tiny-random " in lines[-1]  # the owner's command
    assert first.returncode == 0, first_out
    assert _steps(out) == [1, 2, 3, 4, 5, 6]  # the first run's log, whole and in order
    assert (out / ".run.lock").read_text() == ""  # released at the end: no owner


def test_a_killed_run_never_blocks_the_next_run_or_resume(tmp_path, make_overrides):
    out = tmp_path / "run"
    args = [*make_overrides(out, steps=4), "run.threads=1", "run.checkpoint_every=1"]
    cmd, kw = _train(args)
    victim = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)
    try:
        assert _wait(lambda: (out / "checkpoints" / "step_00000001.safetensors").is_file() or victim.poll() is not None)
    finally:
        victim.kill()  # SIGKILL: no cleanup; the lock file keeps its record
        victim.wait()
    assert _owner_pid(out) == victim.pid

    resumed = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=300, **kw)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert _steps(out) == [1, 2, 3, 4]

    from offpolicy.train import load_config, train  # a fresh run in this process: the folder is free too

    result = train(load_config(None, make_overrides(out, steps=1)), overwrite=True)
    assert result.steps_done == 1 and _steps(out) == [1]
    assert (out / ".run.lock").read_text() == ""

"""``offpolicy lab --executor ray``: the same sweep as Ray actors on a local Ray cluster (2 CPUs, no dashboard).

The contract is the local executor's: the same run folders, summary and metrics (identical numbers on CPU), the same
failure report and retry-by-rerun, the same Ctrl-C (one SIGINT per running run, then resume).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from offpolicy_testkit.lab_plans import no_prepare, small_plan

from offpolicy.lab.ray_exec import RayExecutor, forwarded_env
from offpolicy.lab.sweep import run_sweep
from offpolicy.lab.sweep_folder import read_summary, run_state

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_executor():
    """One local Ray cluster and its run slots for the module (starting a Ray worker costs seconds): each sweep
    enters the executor again and finds both running."""
    with RayExecutor(num_cpus=2) as executor:
        yield executor


@pytest.fixture
def cluster(ray_executor, fake):
    return ray_executor


def _env(executor):
    """The executor, handing the fake trainer's settings as they are now ($FAKE_*) to the runs it starts."""
    executor.env = {k: v for k, v in os.environ.items() if k.startswith("FAKE_")}
    return executor


def _numbers(path):
    """A run's metrics without its timings (the only fields that differ between two identical runs)."""
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def _summary(out):
    data = read_summary(out)
    data.pop("updated")
    data["failed"].sort(key=lambda f: f["dir"])  # listed as they fail: the order of two parallel runs varies
    return json.loads(json.dumps(data).replace(str(out), "OUT"))


@pytest.mark.slow
def test_a_ray_sweep_equals_the_local_sweep_run_for_run(tmp_path, tiny_run, cluster):
    """Real trainer runs (2 runs of 2 steps): the same files, the same numbers, through Ray as locally."""
    local, remote = tmp_path / "local", tmp_path / "ray"
    kw = {"presets": "naive", "mismatches": "bf16", "seeds": 1, "steps": 2, "extra": ["run.threads=1"]}
    done_local = run_sweep(small_plan(local, tiny_run, **kw), jobs=2)
    done_ray = run_sweep(small_plan(remote, tiny_run, **kw), jobs=2, executor=_env(cluster))
    assert done_local.complete and done_ray.complete, [f.error for f in done_ray.failed]
    assert _summary(local) == _summary(remote)
    runs = [r["dir"] for r in read_summary(local)["runs"]]
    assert runs == ["runs/naive__none__s0", "runs/naive__bf16__s0"]
    for run in runs:
        a, b = _numbers(local / run / "metrics.jsonl"), _numbers(remote / run / "metrics.jsonl")
        assert [r["step"] for r in a] == [1, 2] and a == b  # identical floats, not close ones
        assert (local / run / "config.yaml").read_text().replace(str(local), "OUT") == \
            (remote / run / "config.yaml").read_text().replace(str(remote), "OUT")
        assert sorted(p.name for p in (remote / run / "checkpoints").iterdir()) == ["step_00000002.safetensors"]
        assert (remote / run / ".run.lock").read_text() == ""  # the run held its folder and let it go


def test_ray_sweep_contract_failures_and_retry(tmp_path, tiny_run, fake, monkeypatch, cluster):
    monkeypatch.setenv("FAKE_FAIL", "mis")
    local, remote = tmp_path / "local", tmp_path / "ray"
    run_sweep(small_plan(local, tiny_run), jobs=2, command=fake.command, prepare=no_prepare)
    result = run_sweep(small_plan(remote, tiny_run), jobs=2, command=fake.command, prepare=no_prepare,
                       executor=_env(cluster))
    assert {r.preset for r in result.done} == {"naive"} and len(result.done) == 4
    assert [(f.error, f.returncode) for f in result.failed] == \
        [("error: the fake trainer fails on purpose for preset mis", 2)] * 4
    summary = _summary(remote)
    assert summary == _summary(local)
    for r in summary["runs"]:
        assert _numbers(remote / r["dir"] / "metrics.jsonl") == _numbers(local / r["dir"] / "metrics.jsonl")
    monkeypatch.delenv("FAKE_FAIL")  # a rerun retries the failed runs only
    before = len(fake.events())
    again = run_sweep(small_plan(remote, tiny_run), jobs=2, command=fake.command, prepare=no_prepare,
                      executor=_env(cluster))
    assert again.complete and len(again.skipped) == 4
    assert {e["name"].split("__")[0] for e in fake.events()[before:]} == {"mis"}


def test_ray_ctrl_c_checkpoints_the_running_runs_then_a_rerun_resumes_them(tmp_path, tiny_run, fake, monkeypatch,
                                                                            cluster):
    monkeypatch.setenv("FAKE_STEP_S", "0.1")
    out = tmp_path / "out"
    plan = small_plan(out, tiny_run, presets="naive,mis", mismatches="none", steps=40)  # 4 runs of 4 s

    fake.ctrl_c_after_starts(2)
    result = run_sweep(plan, jobs=2, command=fake.command, prepare=no_prepare, poll_s=0.01,
                       executor=_env(cluster))
    ev = fake.events()
    assert result.interrupted and not result.failed and not result.done
    assert len([e for e in ev if e["event"] == "start"]) == 2  # no run started after the Ctrl-C
    assert sorted(e["code"] for e in ev if e["event"] == "end") == [130, 130]  # each got exactly one SIGINT
    stopped_at = {e["name"]: e["step"] for e in ev if e["event"] == "end"}
    for name, step in stopped_at.items():
        assert 0 < step < 40 and run_state(out, next(r for r in plan.runs if r.name == name)) == ("partial", step)

    monkeypatch.setenv("FAKE_STEP_S", "0.001")
    again = run_sweep(plan, jobs=2, command=fake.command, prepare=no_prepare, poll_s=0.01, executor=_env(cluster))
    assert again.complete
    resumed = {e["name"]: e["resume"] for e in fake.events()[len(ev):] if e["event"] == "start"}
    assert resumed == {r.name: r.name in stopped_at for r in plan.runs}


def test_a_run_whose_actor_dies_is_a_failure_that_a_rerun_resumes(tmp_path, tiny_run, fake, monkeypatch, cluster):
    monkeypatch.setenv("FAKE_STEP_S", "0.1")
    out = tmp_path / "out"
    plan = small_plan(out, tiny_run, presets="naive", mismatches="none", seeds=1, steps=40)
    executor = _env(cluster)

    def kill_the_actor():  # as a lost node would: the actor's process dies, the run with it
        deadline = time.time() + 60
        while not (out / plan.runs[0].dir / "checkpoints" / "step_00000002.safetensors").is_file():
            if time.time() > deadline:
                return
            time.sleep(0.02)
        ray.kill(executor.last_run.actor)

    threading.Thread(target=kill_the_actor, daemon=True).start()
    result = run_sweep(plan, jobs=1, command=fake.command, prepare=no_prepare, poll_s=0.01, executor=executor)
    assert not result.done and len(result.failed) == 1
    failure = result.failed[0]
    assert failure.returncode == -signal.SIGKILL
    assert failure.error.startswith("killed by SIGKILL; last log line: error: the Ray actor of this run died: ")
    assert run_state(out, plan.runs[0])[0] == "partial"
    again = run_sweep(plan, jobs=1, command=fake.command, prepare=no_prepare, poll_s=0.01, executor=_env(cluster))
    assert again.complete and [e["resume"] for e in fake.events() if e["event"] == "start"] == [False, True]


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(ValueError, match="cpus_per_run must be a number > 0, got 0"):
        RayExecutor(cpus_per_run=0)
    with pytest.raises(ValueError, match="num_cpus sizes a local Ray cluster; it cannot be set with address"):
        RayExecutor("auto", num_cpus=2)


def test_forwarded_env():
    env = {"OFFPOLICY_CACHE": "/c", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/bin", "HOME": "/h"}
    assert forwarded_env(env) == {"OFFPOLICY_CACHE": "/c", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.mark.slow
def test_offpolicy_lab_executor_ray(tmp_path, tiny_run, cluster, monkeypatch):
    """``offpolicy lab --executor ray --address A``: the sweep runs on the executor built for A (here the module's
    cluster: starting another would cost seconds), the report follows as with local runs."""
    from typer.testing import CliRunner

    import offpolicy.lab.ray_exec as ray_exec
    from offpolicy.cli import app

    asked = []
    monkeypatch.setattr(ray_exec, "RayExecutor", lambda address: asked.append(address) or _env(cluster))
    out = tmp_path / "lab"
    res = CliRunner().invoke(app, ["lab", "--executor", "ray", "--address", "auto", "--presets", "naive", "--mismatch",
                                   "none", "--seeds", "1", "--steps", "2", "--out", str(out), *tiny_run])
    assert res.exit_code == 0, res.output
    assert asked == ["auto"] and "runs start on a local Ray cluster (1 node, 2 CPUs, 1 per run)" in res.output
    assert read_summary(out)["complete"] and (out / "report.html").is_file()


@pytest.mark.parametrize(("args", "line"), [
    (["--executor", "slurm"], "error: --executor must be local or ray, got 'slurm'"),
    (["--address", "auto"], "error: --address names a Ray cluster: use it with --executor ray"),
])
def test_offpolicy_lab_executor_errors(tmp_path, args, line):
    from typer.testing import CliRunner

    from offpolicy.cli import app

    res = CliRunner().invoke(app, ["lab", *args, "--out", str(tmp_path / "lab")])
    assert res.exit_code == 2 and res.output.strip().splitlines()[-1] == line
    assert not (tmp_path / "lab").exists()

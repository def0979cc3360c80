"""The sweep runner: the parallelism bound, resume (fake and real runs), failures, Ctrl-C, the summary contract."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from offpolicy_testkit.lab_plans import no_prepare, small_plan
from rich.console import Console

from offpolicy.lab.plan import plan_sweep, planned_config
from offpolicy.lab.sweep import run_sweep
from offpolicy.lab.sweep_folder import config_conflicts, read_summary, run_state
from offpolicy.train.config import config_to_yaml


def _max_overlap(events: list[dict]) -> int:
    """The most runs alive at once, from each fake run's own start and end times."""
    edges = sorted((e["t"], 1 if e["event"] == "start" else -1) for e in events)
    alive = peak = 0
    for _, delta in edges:  # at equal times an end (-1) sorts before a start (+1): touching runs do not overlap
        alive += delta
        peak = max(peak, alive)
    return peak


@pytest.mark.parametrize("jobs", [2, 3])
def test_never_more_than_jobs_runs_at_once(tmp_path, tiny_run, fake, monkeypatch, jobs):
    monkeypatch.setenv("FAKE_STEP_S", "0.1")  # 0.3 s per run: long enough to overlap whenever the runner lets them
    plan = small_plan(tmp_path / "out", tiny_run)  # 2 presets × (none, bf16) × 2 seeds = 8 runs
    result = run_sweep(plan, jobs=jobs, command=fake.command, prepare=no_prepare, poll_s=0.01)
    ev = fake.events()
    assert len(result.done) == 8 and not result.failed
    assert sorted(e["name"] for e in ev if e["event"] == "start") == sorted(r.name for r in plan.runs)
    assert _max_overlap(ev) == jobs  # never more than --jobs, and the runner does fill the slots


def test_models_are_prepared_once_before_any_run(tmp_path, tiny_run, fake):
    calls = []

    def prepare(plan):
        assert fake.events() == []  # nothing started yet
        calls.append(time.time())

    result = run_sweep(small_plan(tmp_path / "out", tiny_run), jobs=2, command=fake.command, prepare=prepare)
    assert len(calls) == 1 and len(result.done) == 8
    assert min(e["t"] for e in fake.events()) > calls[0]


def test_prepare_models_builds_each_embedded_model_once(tmp_path, monkeypatch):
    import offpolicy.models

    built = []
    monkeypatch.setattr(offpolicy.models, "model_path", lambda recipe, cache_dir=None: built.append(recipe.name))
    from offpolicy.lab.sweep import prepare_models

    prepare_models(plan_sweep(tmp_path, "quick", presets="naive,mis", seeds=2))  # 2 × (none, int8+kv4) × 2: lab
    assert built == ["lab"]
    built.clear()
    prepare_models(plan_sweep(tmp_path, "quick", presets="naive", seeds=1, overrides=["model.path=tiny-random"]))
    assert built == []  # nothing to build for a random-init model


def test_failed_run_is_named_and_the_others_finish(tmp_path, tiny_run, fake, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "mis")
    out = tmp_path / "out"
    buf = io.StringIO()
    result = run_sweep(small_plan(out, tiny_run), jobs=2, command=fake.command, prepare=no_prepare,
                       console=Console(file=buf, width=300))
    assert {r.preset for r in result.done} == {"naive"} and len(result.done) == 4
    assert {f.run.preset for f in result.failed} == {"mis"} and len(result.failed) == 4
    assert all(f.error == "error: the fake trainer fails on purpose for preset mis" for f in result.failed)
    assert all(f.returncode == 2 for f in result.failed)
    text = buf.getvalue()
    assert f"failed {out / 'runs' / 'mis__bf16__s1'} (exit 2): error: the fake trainer fails on purpose" in text
    summary = read_summary(out)
    assert [r["preset"] for r in summary["runs"]] == ["naive"] * 4 and not summary["complete"]
    assert sorted(f["dir"] for f in summary["failed"]) == sorted(f"runs/mis__{m}__s{s}" for m in ("none", "bf16")
                                                                 for s in (0, 1))
    assert summary["failed"][0]["error"].startswith("error: the fake trainer fails")
    # the next sweep retries the failed runs only
    monkeypatch.delenv("FAKE_FAIL")
    before = len(fake.events())
    again = run_sweep(small_plan(out, tiny_run), jobs=2, command=fake.command, prepare=no_prepare)
    assert again.complete and len(again.skipped) == 4
    assert {e["name"].split("__")[0] for e in fake.events()[before:]} == {"mis"}


def test_summary_contract(tmp_path, tiny_run, fake):
    out = tmp_path / "out"
    plan = small_plan(out, tiny_run)
    run_sweep(plan, jobs=2, command=fake.command, prepare=no_prepare)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["setting"] == "quick" and summary["complete"] is True
    assert [r["dir"] for r in summary["runs"]] == [r.dir for r in plan.runs]  # plan order
    for r in summary["runs"]:
        assert set(r) == {"preset", "mismatch", "seed", "dir", "steps"} and r["steps"] == 3
        assert not os.path.isabs(r["dir"]) and r["dir"] == f"runs/{r['preset']}__{r['mismatch']}__s{r['seed']}"
        rows = [json.loads(x) for x in (out / r["dir"] / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in rows] == [1, 2, 3]
        # a finished run keeps only its final checkpoint
        assert sorted(p.name for p in (out / r["dir"] / "checkpoints").iterdir()) == ["step_00000003.safetensors"]
    assert summary["plan"]["mismatches"] == ["none", "bf16"] and summary["pending"] == []
    assert not list(out.glob(".summary-*"))  # written through a temp file that was renamed


def test_ctrl_c_checkpoints_the_running_runs_then_a_rerun_resumes_them(tmp_path, tiny_run, fake, monkeypatch):
    monkeypatch.setenv("FAKE_STEP_S", "0.1")
    out = tmp_path / "out"
    plan = small_plan(out, tiny_run, presets="naive,mis", mismatches="none", steps=40)  # 4 runs of 4 s

    fake.ctrl_c_after_starts(2)
    result = run_sweep(plan, jobs=2, command=fake.command, prepare=no_prepare, poll_s=0.01)
    ev = fake.events()
    assert result.interrupted and not result.failed and not result.done
    started = [e["name"] for e in ev if e["event"] == "start"]
    assert len(started) == 2  # no run started after the Ctrl-C
    assert sorted(e["code"] for e in ev if e["event"] == "end") == [130, 130]  # each got exactly one SIGINT
    summary = read_summary(out)
    assert summary["runs"] == [] and len(summary["pending"]) == 4
    stopped_at = {e["name"]: e["step"] for e in ev if e["event"] == "end"}
    for name, step in stopped_at.items():
        assert 0 < step < 40 and run_state(out, next(r for r in plan.runs if r.name == name)) == ("partial", step)

    monkeypatch.setenv("FAKE_STEP_S", "0.001")
    again = run_sweep(plan, jobs=2, command=fake.command, prepare=no_prepare, poll_s=0.01)
    assert again.complete
    resumed = {e["name"]: e["resume"] for e in fake.events()[len(ev):] if e["event"] == "start"}
    assert resumed == {r.name: r.name in stopped_at for r in plan.runs}
    for r in plan.runs:
        assert [json.loads(x)["step"] for x in (out / r.dir / "metrics.jsonl").read_text().splitlines()] == \
            list(range(1, 41))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_a_folder_of_another_config_is_refused_before_any_work(tmp_path, tiny_run, fake):
    out = tmp_path / "out"
    plan = small_plan(out, tiny_run)
    run = plan.runs[3]
    (out / run.dir).mkdir(parents=True)
    (out / run.dir / "config.yaml").write_text(config_to_yaml(planned_config(run)))
    assert config_conflicts(out, run) == []
    other = small_plan(out, tiny_run, extra=["optim.lr=0.5"])
    conflicts = config_conflicts(out, other.runs[3])
    assert conflicts == ["optim.lr=0.001 (planned 0.5)"]
    with pytest.raises(ValueError, match=r"run folder '.*naive__bf16__s1' holds a run of another config "
                                         r"\(optim\.lr=0\.001 \(planned 0\.5\)\)"):
        run_sweep(other, jobs=2, command=fake.command, prepare=no_prepare)
    assert fake.events() == []
    # what does not change a run's numbers may differ: a longer sweep continues the same runs
    assert config_conflicts(out, small_plan(out, tiny_run, steps=9).runs[3]) == []
    # a config written before a key existed: the missing key counts as its default
    import yaml

    saved = yaml.safe_load((out / run.dir / "config.yaml").read_text())
    del saved["optim"]["schedule"]
    (out / run.dir / "config.yaml").write_text(yaml.safe_dump(saved))
    assert config_conflicts(out, run) == []
    stepped = small_plan(out, tiny_run, extra=["optim.schedule=cosine"])
    assert config_conflicts(out, stepped.runs[3]) == ["optim.schedule='constant' (planned 'cosine')"]


def test_run_state(tmp_path, tiny_run):
    plan = small_plan(tmp_path, tiny_run, steps=3)
    run = plan.runs[0]
    d = tmp_path / run.dir
    assert run_state(tmp_path, run) == ("new", 0)
    (d / "checkpoints").mkdir(parents=True)
    (d / "checkpoints" / "step_00000002.safetensors").write_bytes(b"x")
    assert run_state(tmp_path, run) == ("partial", 2)
    (d / "checkpoints" / "step_00000003.safetensors").write_bytes(b"x")
    (d / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    assert run_state(tmp_path, run) == ("new", 0)  # final checkpoint but metrics short of it: start again
    (d / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    assert run_state(tmp_path, run) == ("done", 3)
    (d / "checkpoints" / "step_00000009.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"holds a checkpoint at step 9, past --steps 3"):
        run_state(tmp_path, run)


def test_another_sweep_in_the_same_folder_is_refused(tmp_path, tiny_run, fake):
    import fcntl

    out = tmp_path / "out"
    out.mkdir()
    with (out / ".lab.lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError, match=r"sweep folder --out '.*' is in use by another process"):
            run_sweep(small_plan(out, tiny_run), jobs=1, command=fake.command, prepare=no_prepare)


def test_a_live_sweep_is_named_and_a_killed_one_never_blocks(tmp_path, tiny_run, fake):
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from offpolicy.folder_lock import FolderLock; "
         "lock = FolderLock(sys.argv[1], '.lab.lock', 'sweep folder --out'); print('held', flush=True); "
         "time.sleep(600)",
         str(out)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=rf"sweep folder --out '.*' is in use by pid {holder.pid} on host "):
            run_sweep(small_plan(out, tiny_run), jobs=1, command=fake.command, prepare=no_prepare)
        assert fake.events() == []  # refused before any run started
    finally:
        holder.kill()  # SIGKILL: its record stays in .lab.lock, its lock does not
        holder.wait()
    result = run_sweep(small_plan(out, tiny_run), jobs=1, command=fake.command, prepare=no_prepare)
    assert result.complete


@pytest.mark.slow
def test_real_runs_resume_a_half_finished_sweep(tmp_path, tiny_run):
    """Real trainer runs: finished runs are left alone, a killed one continues from its checkpoint."""
    out = tmp_path / "out"
    plan = small_plan(out, tiny_run, presets="naive", mismatches="none", extra=["run.checkpoint_every=1"])
    first = run_sweep(plan, jobs=2, keep_checkpoints=True)
    assert first.complete, [f.error for f in first.failed]
    done_run, killed_run = plan.runs
    a, b = out / done_run.dir, out / killed_run.dir
    files_a = [a / "metrics.jsonl", a / "checkpoints" / "step_00000003.safetensors", a / "train.log"]
    stamps_a = [p.stat().st_mtime_ns for p in files_a]
    # make the second run look killed in its third step: no step-3 checkpoint, a half-written metrics line
    original = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    (b / "checkpoints" / "step_00000003.safetensors").unlink()
    lines = (b / "metrics.jsonl").read_text().splitlines()
    (b / "metrics.jsonl").write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:40])
    kept = [b / "checkpoints" / f"step_0000000{i}.safetensors" for i in (1, 2)]
    stamps_b = [p.stat().st_mtime_ns for p in kept]
    assert run_state(out, done_run) == ("done", 3) and run_state(out, killed_run) == ("partial", 2)

    second = run_sweep(plan, jobs=2, keep_checkpoints=True)
    assert second.complete and [r.name for r in second.skipped] == [done_run.name]
    assert [p.stat().st_mtime_ns for p in files_a] == stamps_a  # the finished run was not touched
    assert [p.stat().st_mtime_ns for p in kept] == stamps_b  # a fresh start would have replaced these
    headers = [ln for ln in (b / "train.log").read_text().splitlines() if ln.startswith("# offpolicy lab:")]
    assert len(headers) == 2 and "resume from step 2" in headers[1] and headers[1].endswith("--resume")
    resumed = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]

    def numbers(rows):
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]

    assert numbers(resumed) == numbers(original)  # resuming reproduces the uninterrupted run exactly


def _wait(cond, timeout=30.0):
    deadline = time.time() + timeout
    while not cond() and time.time() < deadline:
        time.sleep(0.02)
    return cond()


def test_zygote_forks_runs_with_their_env_cwd_log_and_exit_code(tmp_path, tiny_run, fake, monkeypatch):
    from offpolicy.lab.launch import Zygote

    z = Zygote(preload=[])  # nothing preloaded: the protocol, not the imports
    try:
        monkeypatch.setenv("FAKE_STEP_S", "0.01")
        env = dict(os.environ)  # set after the zygote started: each run gets the runner's environment of now
        ok = z.start([fake.path, "run.out_dir=a", "run.steps=3", "algorithm.preset=naive", "run.seed=0"],
                     tmp_path / "a.log", env, str(tmp_path))
        assert _wait(lambda: ok.poll() is not None) and ok.returncode == 0
        assert len((tmp_path / "a" / "metrics.jsonl").read_text().splitlines()) == 3  # relative to the given cwd
        bad = z.start([fake.path, "run.out_dir=b", "run.steps=3", "algorithm.preset=mis", "run.seed=0"],
                      tmp_path / "b.log", {**env, "FAKE_FAIL": "mis"}, str(tmp_path))
        assert _wait(lambda: bad.poll() is not None) and bad.returncode == 2
        assert (tmp_path / "b.log").read_text().splitlines()[-1].startswith("error: the fake trainer fails")
        slow = z.start([fake.path, "run.out_dir=c", "run.steps=500", "algorithm.preset=naive", "run.seed=0"],
                       tmp_path / "c.log", {**env, "FAKE_STEP_S": "0.05"}, str(tmp_path))
        assert _wait(lambda: (tmp_path / "c" / "metrics.jsonl").is_file()) and slow.poll() is None
        slow.send_signal(signal.SIGINT)  # the trainer's Ctrl-C: finish the step, checkpoint, exit 130
        assert _wait(lambda: slow.poll() is not None) and slow.returncode == 130
        crash = z.start([str(tmp_path / "missing.py")], tmp_path / "d.log", env, str(tmp_path))
        assert _wait(lambda: crash.poll() is not None) and crash.returncode == 1
        assert "missing.py" in (tmp_path / "d.log").read_text()  # the traceback went to the run's log
    finally:
        z.close()
    assert z.proc.returncode == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_runs_die_with_the_runner(tmp_path, fake, monkeypatch):
    """A killed runner takes its runs with it, forked by the zygote or started as subprocesses: a restarted sweep
    never races an orphan writing into the same folder."""
    monkeypatch.setenv("FAKE_STEP_S", "0.5")
    args = "'run.steps=100', 'algorithm.preset=naive', 'run.seed=0'"
    script = tmp_path / "runner.py"  # no `if __name__ == "__main__"` guard: the zygote never re-imports it
    script.write_text(
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from offpolicy.lab.launch import Zygote, start_run\n"
        "z = Zygote(preload=[])\n"
        f"forked = z.start([{fake.path!r}, 'run.out_dir=f', {args}], {str(tmp_path / 'f.log')!r},\n"
        f"                 dict(os.environ), {str(tmp_path)!r})\n"
        f"sub = start_run([sys.executable, {fake.path!r}, 'run.out_dir={tmp_path / 's'}', {args}],\n"
        f"                Path({str(tmp_path / 's.log')!r}), command=True)\n"
        "print(z.proc.pid, forked.pid, sub.pid, flush=True)\n"
        "time.sleep(60)\n")
    runner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = list(map(int, runner.stdout.readline().split()))
        assert len(pids) == 3 and all(_alive(p) for p in pids)
    finally:
        runner.kill()
        runner.wait()
    assert _wait(lambda: not any(_alive(p) for p in pids), timeout=10)


def test_heartbeat_names_the_running_runs_and_their_step(tmp_path, tiny_run, fake, monkeypatch):
    monkeypatch.setenv("FAKE_STEP_S", "0.1")
    buf = io.StringIO()
    run_sweep(small_plan(tmp_path / "out", tiny_run, presets="naive", mismatches="none", seeds=1, steps=5), jobs=1,
              command=fake.command, prepare=no_prepare, console=Console(file=buf, width=300), heartbeat_s=0.2,
              poll_s=0.01)
    beats = [ln for ln in buf.getvalue().splitlines() if ln.startswith("  running: ")]
    assert beats and all(ln.startswith("  running: naive__none__s0 step ") and ln.endswith("/5; 0/1 done, 0 waiting")
                         for ln in beats)

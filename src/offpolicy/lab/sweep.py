"""The lab's sweep runner: presets × mismatch sources × seeds, each an ordinary trainer run in its own process.

Layout of a sweep folder ``OUT`` (the output contract other tools read):

* ``OUT/runs/<preset>__<mismatch>__s<seed>/`` — an ordinary ``offpolicy train`` run folder (``config.yaml``,
  ``metrics.jsonl``, ``checkpoints/``) plus ``train.log`` (the run's console output, one header line per launch);
* ``OUT/summary.json`` — ``{"runs": [{"preset", "mismatch", "seed", "dir", "steps"}, ...], "setting": ..., ...}``:
  ``runs`` lists the *finished* runs in plan order, ``dir`` relative to ``OUT``; ``failed`` and ``pending`` list the
  others; ``plan`` holds the whole plan. Rewritten atomically (temp file + ``os.replace``) after every finished run.

How a sweep runs (:func:`run_sweep`):

1. every run's config is built and validated before any work (a bad override fails at once, naming the run);
2. an embedded model (``model.path=lab`` / ``tiny``) is warm-started and cached once, before the runs, so parallel
   runs do not each build it;
3. each run is ``offpolicy train <overrides>`` in its own OS process — forked from a zygote that has torch,
   transformers and the trainer imported (:mod:`offpolicy.lab.zygote`: 3–5 s less per run), else
   ``python -m offpolicy.cli train`` — with one torch thread and its own session (a Ctrl-C reaches it exactly once,
   forwarded by the runner), output appended to ``train.log``; at most ``jobs`` at a time;
4. resuming is the default: a finished run (metrics up to the last step + the final checkpoint) is skipped, a
   half-finished one continues from its last checkpoint (``--resume``), a run with no checkpoint starts fresh. A run
   folder whose ``config.yaml`` differs from the plan (other than ``run.steps``) is refused, not mixed;
5. a failed run is reported with its folder and the last line of its log; the others go on; the result lists it.

One sweep per folder: a second `offpolicy lab` on the same ``OUT`` is refused with one line naming the live process
that holds it (``OUT/.lab.lock``); a lock left by a killed sweep does not block.

Ctrl-C: the first one lets every running run finish its step and checkpoint (the trainer's own Ctrl-C), starts no
new run and writes the summary; a second one stops the runs at once. If the runner itself is killed, its runs are
killed with it (Linux: ``PR_SET_PDEATHSIG``), so a restarted sweep never races an orphan in the same folder. Call it
from the main thread (signals, and Linux ties the parent-death signal to the thread that started the launcher).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from offpolicy.folder_lock import FolderLock
from offpolicy.lab.launch import last_log_line, start_run, train_command

# the plan and the folder's state live in their own modules
from offpolicy.lab.plan import PlannedRun, SweepPlan, planned_config
from offpolicy.lab.sweep_folder import (
    FailedRun,
    SweepResult,
    _metrics_last_step,
    config_conflicts,
    run_state,
    write_summary,
)

RUN_LOG = "train.log"
LOCK_FILE = ".lab.lock"  # the sweep folder's lock (its owner's pid, host and command)

__all__ = [
    "LOCK_FILE",
    "RUN_LOG",
    "default_jobs",
    "prepare_models",
    "run_sweep",
]


@dataclass
class _Running:
    run: PlannedRun
    proc: Any  # subprocess.Popen or launch.ZygoteRun
    started: float


def _launch(out: Path, run: PlannedRun, resume_from: int,
            command: Callable[[Sequence[str], bool], list[str]] | None, executor: Any = None) -> _Running:
    run_dir = out / run.dir
    run_dir.mkdir(parents=True, exist_ok=True)
    resume = resume_from > 0
    argv = (command(run.overrides, resume) if command is not None
            else ["train", *run.overrides, "--resume" if resume else "--overwrite"])  # the sweep owns its folders
    log_path = run_dir / RUN_LOG
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    shown = argv if command is not None else train_command(run.overrides, resume)
    with log_path.open("a", encoding="utf-8") as log:
        log.write(f"# offpolicy lab: {when} {'resume from step ' + str(resume_from) if resume else 'start'}: "
                  f"{subprocess.list2cmdline(shown)}\n")
    start = start_run if executor is None else executor.start
    proc = start(argv, log_path, command=command is not None)
    return _Running(run, proc, time.perf_counter())



# -- the runner ------------------------------------------------------------------------------------------------------


def _sweep_lock(out: Path) -> FolderLock:
    """One sweep per folder at a time (two would run the same run twice into one folder); a ``ValueError`` names the
    live process that holds it. A lock left by a killed sweep does not block (:mod:`offpolicy.folder_lock`)."""
    return FolderLock(out, LOCK_FILE, "sweep folder --out")


class _Interrupts:
    """Counts Ctrl-C (SIGINT) instead of raising, so the runner can hand each one on to its runs exactly once."""

    def __init__(self) -> None:
        self.count = 0
        self._old: Any = None

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum: int, frame: Any) -> None:
        self.count += 1

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def prepare_models(plan: SweepPlan) -> list[Path]:
    """Warm-start and cache each embedded model the plan uses (once, here), so parallel runs only load it."""
    from offpolicy.models import RECIPES, get_recipe, model_path
    from offpolicy.models.warm_start import torch_threads

    built, seen = [], set()
    for run in plan.runs:
        cfg = planned_config(run)
        if cfg.model.path not in RECIPES:
            continue
        key = (cfg.model.path, json.dumps(cfg.model.tiny_config, sort_keys=True), cfg.model.cache_dir)
        if key in seen:
            continue
        seen.add(key)
        with torch_threads(cfg.run.threads or 1):
            built.append(model_path(get_recipe(cfg.model.path).with_overrides(cfg.model.tiny_config),
                                    cfg.model.cache_dir))
    return built


def default_jobs() -> int:
    """The number of cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def run_sweep(plan: SweepPlan, *, jobs: int | None = None, console: Any = None,
              command: Callable[[Sequence[str], bool], list[str]] | None = None,
              prepare: Callable[[SweepPlan], Any] = prepare_models, keep_checkpoints: bool = False,
              poll_s: float = 0.1, heartbeat_s: float = 60.0, executor: Any = None) -> SweepResult:
    """Run (or resume) the sweep ``plan`` into ``plan.out`` with at most ``jobs`` runs at a time (default: the cores).

    Each run is ``offpolicy train <overrides> [--resume]`` forked from a zygote that has the trainer imported
    (:mod:`offpolicy.lab.zygote`; a fresh interpreter where that is not possible); ``command(overrides, resume)``
    replaces that by a command line run as a subprocess (tests pass a fake trainer). ``prepare(plan)`` runs once before
    any run (default: build the embedded model). A finished run keeps only its final checkpoint unless
    ``keep_checkpoints``. ``console`` (rich) gets one line per start / finish / failure, and every ``heartbeat_s``
    the step each running run has reached. ``executor``: where the runs start — None: on this machine
    (:func:`offpolicy.lab.launch.start_run`); a :class:`offpolicy.lab.ray_exec.RayExecutor`: as Ray actors (``jobs``
    then defaults to what the cluster's CPUs hold, and ``prepare`` runs on every node).

    Raises ``ValueError`` before any work when the folder holds runs of another config or another sweep is running.
    """
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"--jobs must be an int >= 1, got {jobs!r}")
    out = plan.out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out {str(out)!r} cannot be created: {err.strerror or err}") from None
    say = _printer(console)
    with _sweep_lock(out), (executor if executor is not None else contextlib.nullcontext()):
        if jobs is None:
            jobs = default_jobs() if executor is None else executor.default_jobs()
        result = SweepResult(plan)
        todo: deque[tuple[PlannedRun, int]] = deque()
        for run in plan.runs:  # every folder checked before any work
            conflicts = config_conflicts(out, run)
            if conflicts:
                raise ValueError(f"run folder {str(out / run.dir)!r} holds a run of another config "
                                 f"({'; '.join(conflicts[:3])}); use another --out or remove the folder")
            state, step = run_state(out, run)
            if state == "done":
                result.done.append(run)
                result.skipped.append(run)
            else:
                todo.append((run, step if state == "partial" else 0))
        write_summary(result)
        n_resume = sum(1 for _, s in todo if s > 0)
        say(f"[bold]offpolicy lab[/bold] {plan.setting!r}: {_n(len(plan.presets), 'preset')} × "
            f"{_n(len(plan.mismatches), 'mismatch source')} × {_n(len(plan.seeds), 'seed')} = "
            f"{_n(len(plan.runs), 'run')} of {plan.steps} steps, {jobs} at a time "
            f"→ {_esc(out)}  ({len(result.skipped)} finished, {n_resume} to resume, {len(todo) - n_resume} to start)")
        if executor is not None:
            say(f"  runs start on {_esc(executor.describe())}")
        if todo:
            t0 = time.perf_counter()
            if executor is None:
                prepare(plan)
            else:
                executor.prepare(plan, prepare)
            if time.perf_counter() - t0 > 1.0:
                say(f"  embedded model ready in {time.perf_counter() - t0:.0f} s (cached for later runs)")
        _run_all(result, todo, jobs, command, keep_checkpoints, poll_s, say, heartbeat_s, executor)
        write_summary(result)
    return result


def _run_all(result: SweepResult, todo: deque, jobs: int, command: Callable | None, keep_checkpoints: bool,
             poll_s: float, say: Callable[[str], None], heartbeat_s: float = 60.0, executor: Any = None) -> None:
    out, total = result.plan.out, len(result.plan.runs)
    running: list[_Running] = []
    forwarded = 0
    last_beat = time.perf_counter()
    with _Interrupts() as interrupts:
        while running or (todo and not interrupts.count):
            while todo and len(running) < jobs and not interrupts.count:
                run, step = todo.popleft()
                try:
                    running.append(_launch(out, run, step, command, executor))
                except OSError as err:
                    result.failed.append(FailedRun(run, f"cannot start: {err}", None))
                    say(f"[red]failed[/red] {_esc(out / run.dir)}: cannot start: {_esc(err)}")
                    continue
                say(f"  start {run.name}" + (f" (resume from step {step})" if step else ""))
            while forwarded < interrupts.count:  # each Ctrl-C reaches each run once: 1st = checkpoint, 2nd = stop
                forwarded += 1
                result.interrupted = True
                say("[yellow]Ctrl-C: the running runs finish their step and save a checkpoint; no new run starts"
                    + (" (press again to stop at once)" if forwarded == 1 else "") + "[/yellow]")
                for r in running:
                    with contextlib.suppress(ProcessLookupError):
                        r.proc.send_signal(signal.SIGINT)
            for r in [r for r in running if r.proc.poll() is not None]:
                running.remove(r)
                _finish(result, r, keep_checkpoints, total, say)
            if running and time.perf_counter() - last_beat >= heartbeat_s:
                last_beat = time.perf_counter()
                say("  running: " + ", ".join(f"{r.run.name} step {_metrics_last_step(out / r.run.dir) or 0}/"
                                              f"{r.run.steps}" for r in running)
                    + f"; {len(result.done)}/{total} done, {len(todo)} waiting")
            if running:
                time.sleep(poll_s)
    if todo and result.interrupted:
        say(f"[yellow]stopped: {len(todo)} runs not started; run the same command again to resume[/yellow]")


def _finish(result: SweepResult, r: _Running, keep_checkpoints: bool, total: int, say: Callable[[str], None]) -> None:
    out, run, rc = result.plan.out, r.run, r.proc.returncode
    state, step = run_state(out, run)
    wall = time.perf_counter() - r.started
    if rc == 0 and state == "done":
        result.done.append(run)
        if not keep_checkpoints:
            _prune_checkpoints(out / run.dir, run.steps)
        write_summary(result)
        say(f"  [green]done[/green]  {run.name} in {wall:.0f} s  ({len(result.done)}/{total})")
    elif result.interrupted and rc != 0:
        # stopped by the forwarded Ctrl-C: exit 130 after a checkpoint, or an earlier exit if it came while the run
        # was still loading; either way it resumes (or restarts) with the next sweep, it did not fail
        where = f"at its checkpoint of step {step}" if state == "partial" else "before its first checkpoint"
        say(f"  [yellow]stopped[/yellow] {run.name} {where}")
    else:
        why = last_log_line(out / run.dir / RUN_LOG)
        if rc == 0:
            why = f"exited 0 without finishing (checkpoint at step {step}); last log line: {why}"
        elif rc is not None and rc < 0:
            why = f"killed by {signal.Signals(-rc).name}; last log line: {why}"
        result.failed.append(FailedRun(run, why, rc))
        write_summary(result)
        say(f"  [red]failed[/red] {_esc(out / run.dir)} (exit {rc}): {_esc(why)}")


def _prune_checkpoints(run_dir: Path, steps: int) -> None:
    """Keep only the final checkpoint of a finished run (the sweep's "done" test; optimizer state included)."""
    from offpolicy.train.checkpoint import checkpoint_files, checkpoint_path

    final = checkpoint_path(run_dir / "checkpoints", steps)
    for p in checkpoint_files(run_dir / "checkpoints"):
        if p != final:
            p.unlink(missing_ok=True)


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _esc(value: Any) -> str:
    from rich.markup import escape

    return escape(str(value))


def _printer(console: Any) -> Callable[[str], None]:
    if console is None:
        return lambda text: None
    return lambda text: console.print(text, soft_wrap=True)

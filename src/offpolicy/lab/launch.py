"""How a lab run is started: one OS process per run, forked from a preloaded interpreter when possible.

:func:`start_run` returns a handle with ``poll()``, ``returncode``, ``send_signal()`` and ``pid`` (a
``subprocess.Popen``, or :class:`ForkedRun` with the same calls):

* the default — ``offpolicy train <overrides>`` forked from a multiprocessing *forkserver* that has torch,
  transformers and the trainer imported once (:mod:`offpolicy.lab.worker`); each run is still its own process with
  its own memory, it only skips the 3–5 s of imports;
* without a forkserver (not POSIX), or for a given command line (tests run a fake trainer): a subprocess.

Either way the child runs in its own session (a terminal's Ctrl-C reaches it only through the runner, exactly once),
is killed when the runner dies (a subprocess: ``PR_SET_PDEATHSIG``; a forked run: :func:`die_with`), runs one
torch thread, and appends its output to the log.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def train_command(overrides: Sequence[str], resume: bool) -> list[str]:
    """The command line of one run in a fresh interpreter (what a run is; the forkserver path runs the same)."""
    return [sys.executable, "-m", "offpolicy.cli", "train", *overrides, *(["--resume"] if resume else [])]


def child_env() -> dict[str, str]:
    """Environment settings of a run process: one thread (the runner fills the cores with processes; run.threads=1
    sets torch's pool, these cover the OpenMP / BLAS pools), unbuffered UTF-8 output."""
    return {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONIOENCODING": "utf-8"}


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGKILL the child when the runner dies (None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: no dlopen between fork and exec
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG

    return preexec


def die_with(pid: int) -> None:
    """SIGKILL this process as soon as process ``pid`` (the runner) has exited (a watcher thread).

    A forked run's parent is the forkserver, which outlives the runner while runs hold its "alive" pipe, so the
    parent-death signal alone would leave orphans writing into their run folders. Linux: waits on a pidfd (no pid
    reuse race once opened); elsewhere: checks once a second.
    """

    def kill_self() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # already gone
        kill_self()
        return
    except (AttributeError, OSError):  # no pidfd (not Linux ≥ 5.3): poll
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])  # readable once the process has exited
        else:
            while True:
                time.sleep(1.0)
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                except PermissionError:  # alive, owned by someone else
                    pass
        kill_self()

    threading.Thread(target=watch, name="die-with-runner", daemon=True).start()


class ForkedRun:
    """A run forked from the preloaded forkserver, with the ``subprocess.Popen`` calls the runner uses."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc
        self.pid = proc.pid
        self._code: int | None = None

    def poll(self) -> int | None:
        if self._code is None and not self.proc.is_alive():
            self.proc.join()
            self._code = self.proc.exitcode
            self.proc.close()
        return self._code

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def send_signal(self, sig: int) -> None:
        if self._code is None:
            os.kill(self.pid, sig)


def _forkserver() -> Any:
    """The multiprocessing forkserver context with the trainer preloaded (None where there is no forkserver)."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["offpolicy.lab.worker"])
    return ctx


def start_run(argv: list[str], log_path: Path, *, command: bool) -> Any:
    """Start one run: ``argv`` as a subprocess when ``command`` (a command line), else the trainer CLI arguments
    forked from the preloaded forkserver (falls back to a subprocess of :func:`train_command` without one)."""
    ctx = None if command else _forkserver()
    if ctx is None:
        if not command:
            argv = [sys.executable, "-m", "offpolicy.cli", *argv]
        with log_path.open("a", encoding="utf-8") as log:  # the child holds its own copy of the descriptor
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **child_env()}, start_new_session=True,
                                    preexec_fn=_die_with_parent())
    proc = ctx.Process(target=_run_in_child, args=(argv, str(log_path), child_env(), os.getpid()), daemon=False)
    proc.start()
    return ForkedRun(proc)


def _run_in_child(argv: list[str], log_path: str, env: dict[str, str], runner: int) -> None:
    # the forked child's entry: offpolicy.lab.worker is already imported there (preloaded); the runner never imports it
    die_with(runner)
    from offpolicy.lab.worker import run_train_cli

    run_train_cli(argv, log_path, env)


def last_log_line(path: Path) -> str:
    """The last non-blank line of a run's log (what a failed run said last), or a note that there is none."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return f"(no log at {str(path)!r})"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("# offpolicy lab:")]
    return lines[-1] if lines else "(the run wrote nothing to its log)"

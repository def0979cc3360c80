"""How a lab run is started: one OS process per run, forked from a preloaded interpreter when possible.

:func:`start_run` returns a handle with ``pid``, ``poll()``, ``returncode`` and ``send_signal()`` (a
``subprocess.Popen``, or a :class:`ZygoteRun` with the same calls):

* the default — ``offpolicy train <overrides>`` forked from a :mod:`~offpolicy.lab.zygote` that has torch,
  transformers and the trainer imported once; each run is still its own process with its own memory, it only skips
  the 3–5 s of imports. One zygote per runner process, started on first use and reused;
* for a given command line (tests run a fake trainer), or where there is no ``os.fork``, or when the zygote cannot
  start: a subprocess.

Either way the run is in its own session (a terminal's Ctrl-C reaches it only through the runner, exactly once),
is killed when the runner dies (Linux, ``PR_SET_PDEATHSIG``; a zygote's runs through the zygote), runs one thread
and appends its output to its log.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def train_command(overrides: Sequence[str], resume: bool) -> list[str]:
    """The command line of one run in a fresh interpreter (what a run is; the zygote runs the same command)."""
    return [sys.executable, "-m", "offpolicy.cli", "train", *overrides, "--resume" if resume else "--overwrite"]


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


class Zygote:
    """The runner's side of :mod:`offpolicy.lab.zygote`: start it, ask it for runs, learn their exit codes.

    ``preload``: the modules it imports once (default: the trainer's). Raises ``OSError`` naming what the zygote
    said when it cannot start.
    """

    def __init__(self, preload: Sequence[str] | None = None, timeout_s: float = 300.0) -> None:
        cmd = [sys.executable, "-m", "offpolicy.lab.zygote"]
        if preload is not None:
            cmd += ["--preload", ",".join(preload)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env={**os.environ, **child_env()}, start_new_session=True,
                                     preexec_fn=_die_with_parent())
        self._codes: dict[int, int] = {}
        self._pids: queue.Queue[int | None] = queue.Queue()
        self._errors: collections.deque[str] = collections.deque(maxlen=20)
        self._lock = threading.Lock()
        self._write = threading.Lock()
        self.dead = False
        ready: queue.Queue[bool] = queue.Queue()
        threading.Thread(target=self._read, args=(ready,), name="zygote-reader", daemon=True).start()
        threading.Thread(target=self._drain_stderr, name="zygote-stderr", daemon=True).start()
        try:
            ok = ready.get(timeout=timeout_s)
        except queue.Empty:
            ok = False
        if not ok:
            self.close()
            raise OSError(f"the lab's run launcher did not start: {self.last_error() or 'no output'}")

    def _read(self, ready: queue.Queue) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            msg = json.loads(raw)
            if "ready" in msg:
                ready.put(True)
            elif "pid" in msg:
                self._pids.put(msg["pid"])
            elif "exit" in msg:
                with self._lock:
                    self._codes[msg["exit"]] = msg["code"]
        self.dead = True  # its runs died with it
        ready.put(False)
        self._pids.put(None)

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", errors="replace").strip()
            if line:
                self._errors.append(line)

    def last_error(self) -> str:
        return self._errors[-1] if self._errors else ""

    @property
    def alive(self) -> bool:
        return not self.dead and self.proc.poll() is None

    def start(self, argv: Sequence[str], log_path: Path, env: dict[str, str], cwd: str) -> ZygoteRun:
        """Fork a run: ``argv`` = ``["offpolicy", ...]`` or a script and its arguments."""
        request = json.dumps({"argv": list(argv), "log": str(log_path), "env": env, "cwd": cwd}) + "\n"
        with self._write:  # one request, one pid reply, in order
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(request.encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError) as err:
                raise OSError(f"the lab's run launcher is gone: {self.last_error() or err}") from None
            pid = self._pids.get()
        if pid is None:
            raise OSError(f"the lab's run launcher is gone: {self.last_error() or 'no output'}")
        return ZygoteRun(self, pid)

    def exit_code(self, pid: int) -> int | None:
        with self._lock:
            if pid in self._codes:
                return self._codes[pid]
        return -signal.SIGKILL if self.dead else None  # a dead zygote took its runs with it

    def close(self) -> None:
        """End of input: the zygote kills what still runs and exits."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ZygoteRun:
    """A run forked by a :class:`Zygote`, with the ``subprocess.Popen`` calls the runner uses."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid

    def poll(self) -> int | None:
        return self.zygote.exit_code(self.pid)

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


_ZYGOTE: Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()


def zygote() -> Zygote | None:
    """This process's zygote (started on first use, restarted if it died); None where there is no ``os.fork`` or
    it cannot start (a warning says why)."""
    global _ZYGOTE
    if not hasattr(os, "fork"):
        return None
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None or not _ZYGOTE.alive:
            try:
                _ZYGOTE = Zygote()
            except OSError as err:
                warnings.warn(f"{err}; starting each run in a fresh interpreter instead", stacklevel=3)
                _ZYGOTE = None
        return _ZYGOTE


def start_run(argv: list[str], log_path: Path, *, command: bool) -> Any:
    """Start one run: ``argv`` as a subprocess when ``command`` (a command line), else the offpolicy command-line
    arguments forked from the zygote (a subprocess of :func:`train_command`'s form without one)."""
    z = None if command else zygote()
    if z is not None:
        return z.start(["offpolicy", *argv], log_path, {**os.environ, **child_env()}, os.getcwd())
    if not command:
        argv = [sys.executable, "-m", "offpolicy.cli", *argv]
    with log_path.open("a", encoding="utf-8") as log:  # the child holds its own copy of the descriptor
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **child_env()}, start_new_session=True,
                                preexec_fn=_die_with_parent())


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

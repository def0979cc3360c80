"""A preloaded process that forks one process per lab run (a *zygote*, the way Android starts its apps).

Importing torch and transformers costs 3–5 s per process on a small CPU, longer than a short run of the lab's
model. ``python -m offpolicy.lab.zygote --preload offpolicy.cli,...`` imports those modules once, never runs a
tensor operation (so no thread pool exists and forking is safe), then forks a child per request. Each child is a
run's own OS process — own memory, own RNG state, nothing shared with the other runs — that only parses its
arguments and trains. Unlike ``multiprocessing``'s forkserver, nothing re-imports the caller's ``__main__`` (a
script calling :func:`offpolicy.lab.run_sweep` needs no ``if __name__ == "__main__"`` guard).

Protocol (JSON lines; :class:`offpolicy.lab.launch.Zygote` is the other side):

* zygote → runner: ``{"ready": pid}`` once the imports are done; ``{"pid": n}`` after each fork, in request order;
  ``{"exit": n, "code": c}`` when a child ends (``c`` < 0: killed by signal −c, as ``subprocess`` reports it);
* runner → zygote: ``{"argv": [...], "log": path, "env": {...}, "cwd": path}`` — ``argv`` is ``["offpolicy",
  ...]`` for the offpolicy command line, else a Python script and its arguments; the child runs in ``cwd`` with
  exactly ``env``, in its own session, stdin from /dev/null, stdout and stderr appended to ``log``;
* end of input (the runner closed the pipe or died): every child still running is killed, the zygote exits.

Linux also kills the zygote when the runner dies and each child when the zygote dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import sys
import traceback
from typing import Any

# What the lab's runs import: the trainer, the CLI, the models' classes (torch comes with them).
PRELOAD = ("offpolicy.cli", "offpolicy.train.loop", "offpolicy.models", "transformers.models.qwen2.modeling_qwen2")


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (a no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _send(message: dict[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())  # unbuffered: a fork never copies a pending line


def _run(request: dict[str, Any], zygote: int) -> int:
    """The child: become the run's process and run its command; returns the exit code."""
    os.setsid()  # out of the zygote's session: signals reach a run only when the runner sends them
    die_with_parent()
    if os.getppid() != zygote:  # the zygote died between the fork and the line above
        return 1
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    sys.stdout = open(1, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)  # noqa: SIM115
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    argv = list(request["argv"])
    sys.argv = argv
    if argv[0] == "offpolicy":
        from offpolicy.cli import app

        app(args=argv[1:], prog_name="offpolicy")  # ends with SystemExit
        return 0
    import runpy

    runpy.run_path(argv[0], run_name="__main__")
    return 0


def _child(request: dict[str, Any], zygote: int) -> None:
    code = 1
    try:
        code = _run(request, zygote)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the run's log gets the traceback, the runner the exit code
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def serve(preload: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the runner stops runs
    die_with_parent()
    for name in preload:
        importlib.import_module(name)
    me = os.getpid()
    _send({"ready": me})
    children: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            data = os.read(0, 65536)
            if not data:
                break
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request, me)  # never returns
                children.add(pid)
                _send({"pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
    for pid in children:  # the runner is gone: so are its runs
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def main(argv: list[str]) -> None:
    preload = list(PRELOAD)
    if argv[:1] == ["--preload"]:
        preload = [m for m in argv[1].split(",") if m] if len(argv) > 1 else []
    serve(preload)


if __name__ == "__main__":
    main(sys.argv[1:])

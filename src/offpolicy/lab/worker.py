"""The process one lab run lives in: the ordinary ``offpolicy train`` command, forked from a preloaded interpreter.

Importing torch and transformers costs 3–5 s per process on a small CPU, longer than a short run of the lab's
model. The sweep therefore starts runs through a multiprocessing *forkserver* that imports this module once (and
with it torch, transformers' Qwen2 and the trainer); each run is a fresh fork of that server — its own OS process,
its own memory and RNG state, nothing shared with the other runs — that only parses its arguments and trains.

:func:`run_train_cli` is the child's entry point: it leaves the terminal's process group (so a Ctrl-C reaches it
once, forwarded by the runner), asks Linux to kill it if its parent dies, sends its output to the run's log and runs
``offpolicy train <overrides> [--resume]``; its exit code is the command's. (The runner's launcher also makes it
die with the runner: :func:`offpolicy.lab.launch.die_with`.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

import torch  # noqa: F401  (preloaded: the point of this module)

import offpolicy.cli  # noqa: F401
import offpolicy.train.loop  # noqa: F401

with contextlib.suppress(ImportError):  # the trainer's model class and the embedded models' loader
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import offpolicy.models  # noqa: F401


def set_parent_death_signal() -> None:
    """Linux: SIGKILL this process when its parent dies (no orphan keeps writing into a run folder)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def run_train_cli(argv: list[str], log_path: str, env: dict[str, str]) -> None:
    """Run ``offpolicy <argv>`` with stdout and stderr appended to ``log_path`` (raises SystemExit with its code)."""
    with contextlib.suppress(OSError):
        os.setsid()  # out of the terminal's process group: the runner forwards each Ctrl-C exactly once
    set_parent_death_signal()
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)  # noqa: SIM115
    from offpolicy.cli import app

    app(args=argv, prog_name="offpolicy")

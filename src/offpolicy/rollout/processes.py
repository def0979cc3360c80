"""Server processes on this machine: a free local port, and stopping a child server with everything it started.

What the engines that start their own server share (:class:`~offpolicy.rollout.vllm_server.VLLMServer`'s child
process, :class:`~offpolicy.rollout.llamacpp.LlamaCppServer`'s port). Nothing here speaks a protocol.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    >>> 0 < free_port() < 65536
    True
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to every process left in ``process``'s group (started with ``start_new_session=True``): a server's
    engine core and workers are its children, and a signal to the server alone would leave them running."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is already empty
        pass


def stop_process(process: subprocess.Popen, *, grace: float = 20.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds, then whatever is left of the process group."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
    kill_group(process)


def log_tail(path: str | os.PathLike, n: int = 600) -> str:
    """The last ``n`` characters of a server's log file ("" when it cannot be read), for error messages."""
    try:
        return Path(path).read_bytes()[-n:].decode("utf-8", "replace")
    except OSError:
        return ""

"""One writer per folder: a run folder (``offpolicy train``) or a sweep folder (``offpolicy lab``) is written by one
live process at a time.

:class:`FolderLock` takes an exclusive ``flock`` on a lock file inside the folder and writes its owner (pid, host,
command line, start time) into it. A second process asking for the same folder gets one ``ValueError`` line naming
that owner. The kernel drops an ``flock`` when its process dies, however it dies (``kill -9`` included), so a lock
file left by a crashed run never blocks the next run or a ``--resume``: the file stays, the lock does not, and the
next owner overwrites the stale name.

The lock file is never deleted (deleting it while another process waits on it would let two processes hold locks on
two different files of the same name). On a network filesystem Linux maps ``flock`` to POSIX record locks, which
NFS carries between machines; the host in the message says where the owner runs. Where there is no ``fcntl`` (not
POSIX) the folder is not locked.

>>> import tempfile
>>> folder = tempfile.mkdtemp()
>>> with FolderLock(folder, ".run.lock", "run.out_dir"):
...     try:
...         FolderLock(folder, ".run.lock", "run.out_dir")  # a second writer, even in this process
...     except ValueError as err:
...         print(f"is in use by pid {os.getpid()} on host" in str(err))
True
>>> FolderLock(folder, ".run.lock", "run.out_dir").release()  # released: free again
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]

# The owner's command line is cut to this many characters in the message (a lab run's overrides fill a screen).
_COMMAND_CHARS = 200


class FolderLock:
    """Hold ``folder/name`` exclusively until :meth:`release` (or the end of a ``with`` block, or the process).

    ``what`` names the folder in the message (``"run.out_dir"``, ``"--out"``). Raises ``ValueError`` — one line
    naming the folder and the owner's pid, host and command — when a live process holds it.
    """

    def __init__(self, folder: str | Path, name: str, what: str) -> None:
        self.path = Path(folder) / name
        self._file: IO[str] | None = None
        if fcntl is None:
            return
        f = self.path.open("a+", encoding="utf-8")  # "a+": never truncates the owner's record before the lock
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            owner = _describe(f.read())
            f.close()
            raise ValueError(f"{what} {str(folder)!r} is in use by {owner}; wait for it to end or stop it "
                             "(a lock left by a process that died does not count)") from None
        f.seek(0)
        f.truncate()
        f.write(json.dumps(owner_record()) + "\n")
        f.flush()
        self._file = f

    @property
    def held(self) -> bool:
        return self._file is not None

    def release(self) -> None:
        """Drop the lock (the file stays, emptied: no owner). Idempotent."""
        f, self._file = self._file, None
        if f is None:
            return
        try:
            f.seek(0)
            f.truncate()
        finally:
            f.close()  # closing the only descriptor drops the flock

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def owner_record() -> dict[str, Any]:
    """What the lock file says about its owner: this process."""
    argv = list(sys.argv) or ["?"]
    program = Path(argv[0])
    # the program by its name: `offpolicy` for the console script and for `python -m offpolicy.cli` alike
    argv[0] = "offpolicy" if (program.name, program.parent.name) == ("__main__.py", "cli") else program.name
    return {"pid": os.getpid(), "host": socket.gethostname(), "command": shlex.join(argv),
            "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _describe(text: str) -> str:
    """``pid 123 on host h since t (`cmd`)`` from a lock file's record; a short note when it holds none (an owner
    that has not written it yet, or a lock taken by hand)."""
    try:
        rec = json.loads(text.splitlines()[0])
        pid = int(rec["pid"])
    except (ValueError, KeyError, IndexError, TypeError):
        return "another process (it has not recorded its pid)"
    command = str(rec.get("command", "?")).replace("\n", " ")
    if len(command) > _COMMAND_CHARS:
        command = command[: _COMMAND_CHARS - 1] + "…"
    return f"pid {pid} on host {rec.get('host', '?')} since {rec.get('since', '?')} (`{command}`)"

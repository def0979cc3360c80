"""One writer per folder (offpolicy.folder_lock): a live owner is named, a dead one never blocks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from offpolicy.folder_lock import FolderLock

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")

# A process that takes the lock, says so, and sleeps until it is killed (argv: folder).
HOLDER = """
import sys, time
from offpolicy.folder_lock import FolderLock
lock = FolderLock(sys.argv[1], ".run.lock", "run.out_dir")
print("held", flush=True)
time.sleep(600)
"""


def _holder(folder):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), "--marker-arg"], stdout=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_owner_is_named_with_pid_host_and_command(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(ValueError) as err:
            FolderLock(tmp_path, ".run.lock", "run.out_dir")
        msg = str(err.value)
        assert "\n" not in msg
        assert msg.startswith(f"run.out_dir {str(tmp_path)!r} is in use by pid {proc.pid} on host "
                              f"{socket.gethostname()} since ")
        assert "--marker-arg" in msg  # the owner's command line (python -c ... <folder> --marker-arg)
        record = json.loads((tmp_path / ".run.lock").read_text())
        assert record["pid"] == proc.pid and record["host"] == socket.gethostname()
        assert (tmp_path / ".run.lock").read_text() == json.dumps(record) + "\n"  # the refused one changed nothing
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_owner_never_blocks(tmp_path):
    proc = _holder(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)  # kill -9: no cleanup ran, the stale record stays in the file
    proc.wait()
    assert json.loads((tmp_path / ".run.lock").read_text())["pid"] == proc.pid
    with FolderLock(tmp_path, ".run.lock", "run.out_dir") as lock:
        assert lock.held
        assert json.loads((tmp_path / ".run.lock").read_text())["pid"] == os.getpid()  # the new owner's record
    assert (tmp_path / ".run.lock").read_text() == ""  # released: no owner recorded, the file stays
    FolderLock(tmp_path, ".run.lock", "run.out_dir").release()


def test_one_writer_per_folder_inside_one_process_too(tmp_path):
    first = FolderLock(tmp_path, ".run.lock", "run.out_dir")
    with pytest.raises(ValueError, match=f"is in use by pid {os.getpid()} "):
        FolderLock(tmp_path, ".run.lock", "run.out_dir")
    FolderLock(tmp_path, ".other.lock", "run.out_dir").release()  # another lock file: independent
    first.release()
    first.release()  # idempotent
    FolderLock(tmp_path, ".run.lock", "run.out_dir").release()


def test_an_owner_without_a_record_is_still_refused(tmp_path):
    import fcntl

    with (tmp_path / ".run.lock").open("w") as held:  # a lock taken by hand (or an owner between flock and write)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError, match=r"is in use by another process \(it has not recorded its pid\)"):
            FolderLock(tmp_path, ".run.lock", "run.out_dir")


def test_a_long_command_is_cut(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["offpolicy", "train", *[f"key{i}=value" for i in range(100)]])
    first = FolderLock(tmp_path, ".run.lock", "run.out_dir")
    try:
        with pytest.raises(ValueError) as err:
            FolderLock(tmp_path, ".run.lock", "run.out_dir")
        command = str(err.value).split("(`", 1)[1].split("`)", 1)[0]
        assert len(command) == 200 and command.startswith("offpolicy train key0=value") and command.endswith("…")
    finally:
        first.release()


@pytest.mark.parametrize(("argv0", "shown"), [
    ("/venv/lib/python3.12/site-packages/offpolicy/cli/__main__.py", "offpolicy"),  # python -m offpolicy.cli
    ("/venv/bin/offpolicy", "offpolicy"),  # the console script
    ("/home/me/scripts/__main__.py", "__main__.py"),  # another package's __main__: named as it is
])
def test_the_owner_is_named_by_its_program(monkeypatch, argv0, shown):
    from offpolicy.folder_lock import owner_record

    monkeypatch.setattr(sys, "argv", [argv0, "train", "run.steps=2"])
    assert owner_record()["command"] == f"{shown} train run.steps=2"

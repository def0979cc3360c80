"""Two (or more) processes over gloo for the multi-rank tests: each runs ``python SCRIPT RANK WORLD PORT OUT`` (the
script's ``__main__`` joins the group on ``MASTER_PORT`` = PORT and writes its verdict under OUT)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_ranks(script: str | Path, out: str | Path, *, world: int = 2, timeout: float = 300.0,
              hung: str = "a rank hung", env: dict[str, str] | None = None) -> list[str]:
    """Run the ranks (``env`` added to their environment) and return their outputs; an ``AssertionError`` with ``hung`` when one runs past ``timeout``
    (every rank is killed then), or with the outputs when one exits non-zero."""
    from offpolicy.rollout.processes import free_port

    port = free_port()
    root = str(Path(__file__).resolve().parents[1])  # the ranks import offpolicy_testkit, as pytest's rootdir does
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}),
                "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), str(port), str(out)], env=full_env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(hung) from None
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    return outputs

"""A stand-in for ``offpolicy train`` in the sweep tests: same arguments, same files, no torch (starts in ~50 ms).

``python fake_trainer.py key=value ... [--resume]`` writes ``run.out_dir/metrics.jsonl`` (one row per step with the
four contract fields) and an (empty) ``checkpoints/step_<N>.safetensors`` after every step, resumes after its last
checkpoint with ``--resume``, stops after the current step with exit 130 on SIGINT (as the trainer does), and
appends ``{"event": "start" | "end", "name", "t", "pid", "resume", "code"}`` lines to ``$FAKE_EVENTS``.
``$FAKE_STEP_S``: seconds per step; ``$FAKE_FAIL``: comma-separated presets that fail at once (exit 2, after printing
an error line).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path


def _event(kind: str, name: str, **extra: object) -> None:
    line = json.dumps({"event": kind, "name": name, "t": time.time(), "pid": os.getpid(), **extra}) + "\n"
    fd = os.open(os.environ["FAKE_EVENTS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())  # one O_APPEND write per event: lines of parallel fakes never interleave
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    resume = "--resume" in argv
    kv = dict(a.split("=", 1) for a in argv if "=" in a)
    out = Path(kv["run.out_dir"])
    steps, preset, seed = int(kv["run.steps"]), kv["algorithm.preset"], int(kv["run.seed"])
    name = out.name
    stop = []
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))  # before "start": a test signals once it sees that
    _event("start", name, resume=resume)
    if preset in os.environ.get("FAKE_FAIL", "").split(","):
        print("fake trainer: loading …")
        print(f"error: the fake trainer fails on purpose for preset {preset}")
        _event("end", name, code=2)
        return 2
    ckpt = out / "checkpoints"
    ckpt.mkdir(parents=True, exist_ok=True)
    done = [int(m.group(1)) for f in os.listdir(ckpt) if (m := re.match(r"step_(\d+)\.safetensors$", f))]
    start = max(done) if resume and done else 0
    metrics = out / "metrics.jsonl"
    kept = metrics.read_text().splitlines()[:start] if start and metrics.is_file() else []
    metrics.write_text("".join(ln + "\n" for ln in kept))
    delay = float(os.environ.get("FAKE_STEP_S", "0.05"))
    for step in range(start + 1, steps + 1):
        time.sleep(delay)
        row = {"step": step, "reward/mean": 0.1 * seed + 0.01 * step, "rollout_correction/k3_kl": 1e-3,
               "loss/grad_norm": 1.0, "correction/masked_frac": 0.0}
        with metrics.open("a") as f:
            f.write(json.dumps(row) + "\n")
        (ckpt / f"step_{step:08d}.safetensors").write_bytes(b"fake")
        if stop:
            print(f"interrupted after step {step}")
            _event("end", name, code=130, step=step)
            return 130
    _event("end", name, code=0, step=steps)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

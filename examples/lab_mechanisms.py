"""Reproduce the lab's mechanism figures (docs/lab/findings.md, "Mechanisms") into a new temporary folder, or --out.

    python examples/lab_mechanisms.py                    # ~10 min on 2 cores; prints the folder it wrote
    python examples/lab_mechanisms.py --out docs/lab     # redraw the figures the docs show

1. Off-policy update envelopes (ALP paper, arXiv 2603.19470, Fig. 2): the lab model after 8 on-policy steps, one
   batch of 16 prompts × 8 samples from an engine 8 updates behind (``lag8``), 16 updates per preset (lr 1e-4), the
   5–95 % envelope of log π_θ − log μ per μ-probability bin before and after.
2. TRM-Max acceptance against answer length beside (1 − p)^T (arXiv 2512.23075 §4), and the sign of Δ on sampled
   tokens (DVP, arXiv 2512.23087, Prop. 4.3), from ``offpolicy inspect`` of the tiny model with a bf16 engine
   (128 arithmetic prompts, 64 tokens sampled past eos).

About 10 minutes on 2 CPU cores (the lab and tiny models are warm-started first if they are not cached).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from offpolicy.inspect import read_dump
from offpolicy.lab.mechanisms import acceptance_vs_length, plot_acceptance, plot_envelopes, update_envelopes
from offpolicy.lab.mismatch import mismatch_overrides
from offpolicy.lab.settings import LAB_BASE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="where the figures go (default: a new temporary folder)")
    out = parser.parse_args().out or Path(tempfile.mkdtemp(prefix="lab_mechanisms_"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="offpolicy-mechanisms-"))

    # 1. a checkpoint mid-learning: 8 on-policy steps of the lab setting
    subprocess.run([sys.executable, "-m", "offpolicy.cli", "train", *LAB_BASE, *mismatch_overrides("none"),
                    "run.steps=8", f"run.out_dir={work / 'ck8'}"], check=True)
    checkpoint = work / "ck8" / "checkpoints" / "step_00000008.safetensors"
    runs = {p: [f"algorithm.preset={p}", *(["alp.enabled=true"] if p == "alp" else [])]
            for p in ("naive", "tis", "mis", "trm", "alp")}
    runs["bypass, no noise"] = ["algorithm.preset=naive", "algorithm.objective=bypass", "algorithm.dual_clip=10"]
    results = update_envelopes([*LAB_BASE, *mismatch_overrides("lag8"), "task.prompts_per_step=16", "optim.lr=1e-4"],
                               runs, updates=16, out_dir=work / "envelopes", checkpoint=checkpoint)
    (out / "update_envelopes_lag8.json").write_text(json.dumps(results))
    plot_envelopes(results, out / "update_envelopes_lag8.png")

    # 2. inspect the tiny model's bf16 engine; acceptance against length from its per-token dump
    inspect_dir = work / "inspect"
    subprocess.run([sys.executable, "-m", "offpolicy.cli", "inspect", "--model", "tiny", "--task", "arithmetic",
                    "--prompts", "128", "--max-new-tokens", "64", "--ignore-eos", "--rollout", "bf16", "--trainer",
                    "fp32", "--out", str(inspect_dir)], check=True)
    shutil.copy(inspect_dir / "prop43_sign.png", out / "prop43_sign_tiny_bf16.png")
    dump = read_dump(inspect_dir / "tokens.jsonl")
    rows = {delta: acceptance_vs_length(dump.kl, dump.mask, delta, [1, 2, 4, 8, 16, 32, 64])
            for delta in (0.01, 0.05, 0.2)}
    plot_acceptance(rows, out / "trm_acceptance_vs_length.png", "TRM-Max acceptance vs length (tiny model, bf16 vs fp32)")
    print(f"figures in {out}; working files in {work}")


if __name__ == "__main__":
    main()

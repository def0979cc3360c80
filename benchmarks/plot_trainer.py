"""Draw the trainer-vs-TRL measurements recorded in ``docs/benchmarks/trainer_vs_trl.json`` (one dot per repeat).

    python benchmarks/plot_trainer.py [JSON] [PNG]

Left: seconds per full step of each trainer, per configuration. Right: the ratio TRL / offpolicy of each repeat, with
the 2× line. The numbers are copied from ``benchmarks/trainer.py``'s output (docs/benchmarks.md says which run).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src = Path(sys.argv[1]) if len(sys.argv) > 1 else DOCS / "trainer_vs_trl.json"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else DOCS / "trainer_vs_trl.png"
    rows = json.loads(src.read_text())["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.7 * len(rows) + 1.6), sharey=True)
    for y, row in enumerate(rows):
        ours, trl = row["offpolicy"], row["trl"]
        left.scatter(ours, [y + 0.12] * len(ours), color="#1f77b4", s=22, label="offpolicy" if y == 0 else None)
        left.scatter(trl, [y - 0.12] * len(trl), color="#7f7f7f", s=22, label="TRL GRPOTrainer" if y == 0 else None)
        ratios = sorted(t / o for o, t in zip(ours, trl))
        right.scatter(ratios, [y] * len(ratios), color="#2ca02c", s=22)
        median = ratios[len(ratios) // 2] if len(ratios) % 2 else sum(ratios[len(ratios) // 2 - 1:][:2]) / 2
        right.plot([median, median], [y - 0.25, y + 0.25], color="black", linewidth=1.5)
    right.axvline(2.0, color="#d62728", linestyle="--", linewidth=1, label="2×")
    left.set_yticks(range(len(rows)), [r["label"] for r in rows])
    left.invert_yaxis()
    left.set_xlabel("seconds per full GRPO step (wall clock, set-up excluded)")
    left.set_xlim(left=0)
    left.legend(loc="lower right", fontsize=8)
    left.set_title("Step time, one dot per repeat", fontsize=10)
    right.set_xlabel("TRL s/step ÷ offpolicy s/step (black: median)")
    right.set_title("Ratio per repeat", fontsize=10)
    right.legend(loc="lower right", fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    print(out)


if __name__ == "__main__":
    main()

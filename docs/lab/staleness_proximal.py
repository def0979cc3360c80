"""Decoupled PPO under TIS with the π_prox forward (`tis`) against AReaL's log-linear π_prox (`tis_loglinear`, no
forward) on the lab's lagging engines: per lag, each arm's seeds, median [min–max], and the lab's verdict
(:func:`offpolicy.lab.stats.compare`: min–max ranges over seeds; 3 vs 3 seeds separate by chance with p = 0.1).

    offpolicy lab --setting stale --presets tis_loglinear,tis --mismatch lag4,lag8,lag16 --jobs 1 --out DIR
    python -m offpolicy.lab.staleness --evaluate DIR        # the trainer's final reward per run → eval.json
    PYTHONPATH=src python docs/lab/staleness_proximal.py DIR docs/lab

Writes ``staleness_proximal_table.md`` and ``staleness_proximal.png`` (the staleness figure for the two arms).
"""

import sys
from pathlib import Path

from offpolicy.lab.staleness import lag_label, plot_staleness, staleness_report
from offpolicy.lab.stats import compare, load_sweep, run_stats

BASE, VARIANT = "tis", "tis_loglinear"
HEADER = """# Decoupled PPO under TIS: the π_prox forward (`tis`) against AReaL's log-linear π_prox (`tis_loglinear`)

Lab model (5 M parameters), setting `stale`, 20 steps; written by `docs/lab/staleness_proximal.py` from the sweep in
[staleness.md](staleness.md#decoupled-ppo-with-areals-log-linear-proximal-policy); groups with fewer than 3 finished
seeds are shown as they are, and a verdict needs 2 seeds on each side.

"""


def per_seed(sweep, summary, rows, preset, mismatch):
    """(last-quarter engine reward, trainer's evaluated reward, k3 KL median, mean clipped fraction) per seed, seed
    order; the clipped fraction is PPO-clip's (low + high) over the run's steps."""
    import json

    out = []
    for r in sorted(summary["runs"], key=lambda r: r["seed"]):
        if r["preset"] != preset or r["mismatch"] != mismatch or len(rows.get(r["dir"]) or []) != r.get("steps"):
            continue
        stats = run_stats(rows[r["dir"]])
        path = Path(sweep) / r["dir"] / "eval.json"
        evaluated = json.loads(path.read_text())["reward"] if path.is_file() else None
        clipped = [x["loss/clipfrac_low"] + x["loss/clipfrac_high"] for x in rows[r["dir"]]]
        out.append((stats["reward_last"], evaluated, stats["k3_median"], sum(clipped) / len(clipped)))
    return out


def fmt(values):
    return "–" if not values else f"{sorted(values)[len(values) // 2]:.3f} [{min(values):.3f}–{max(values):.3f}]"


def verdict(c):
    return c["verdict"] if c["diff"] is None else f"{c['diff']:+.3f} {c['verdict']}"


def main(sweep, out):
    summary, rows = load_sweep(sweep)
    mismatches = sorted({r["mismatch"] for r in summary["runs"]}, key=lambda m: int(m[3:]) if m[3:].isdigit() else 0)
    lines = ["| lag (steps) | arm | seeds | trainer's final reward (eval), per seed | median [min–max] | "
             "reward last ¼ (engine), per seed | median [min–max] | k3 KL median | clipped | eval vs `tis` | "
             "last ¼ vs `tis` |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mismatch in mismatches:
        base = per_seed(sweep, summary, rows, BASE, mismatch)
        for preset in (BASE, VARIANT):
            seeds = per_seed(sweep, summary, rows, preset, mismatch)
            if not seeds:
                continue
            last, evals, k3, clipped = ([s[i] for s in seeds] for i in range(4))
            evals_known = [e for e in evals if e is not None]
            if preset == VARIANT and base:
                eval_vs = verdict(compare(evals, [s[1] for s in base], BASE))
                last_vs = verdict(compare(last, [s[0] for s in base], BASE))
            else:
                eval_vs = last_vs = "(reference)" if preset == BASE else "–"
            lines.append(f"| {lag_label(mismatch)} | `{preset}` | {len(seeds)} | "
                         f"{', '.join('–' if e is None else f'{e:.3f}' for e in evals)} | {fmt(evals_known)} | "
                         f"{', '.join(f'{x:.3f}' for x in last)} | {fmt(last)} | "
                         f"{sorted(k3)[len(k3) // 2]:.2e} | {fmt(clipped)} | {eval_vs} | {last_vs} |")
    text = HEADER + "\n".join(lines) + "\n"
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "staleness_proximal_table.md").write_text(text)
    plot_staleness(staleness_report(sweep), Path(out) / "staleness_proximal.png", (BASE, VARIANT))
    print(text)


if __name__ == "__main__":
    main(*sys.argv[1:3])

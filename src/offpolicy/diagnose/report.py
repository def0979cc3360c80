"""Run reports: summary rows, a rich table and matplotlib plots from ``metrics.jsonl`` files.

Used by ``offpolicy demo`` (several presets side by side) and ``offpolicy diagnose metrics.jsonl``.

>>> runs = {"naive": [{"step": 1, "reward/mean": 0.25, "rollout_correction/kl": 1e-3},
...                   {"step": 2, "reward/mean": 0.5, "rollout_correction/kl": 3e-3}]}
>>> row = summary_rows(runs, window=1)[0]   # reward over the first / last 1 step; KL mean (1e-3 + 3e-3) / 2
>>> row["run"], row["reward_first"], row["reward_last"], round(row["kl_mean"], 4)
('naive', 0.25, 0.5, 0.002)
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from offpolicy.lab.plots import pyplot
from offpolicy.lab.stats import trailing_mean
from offpolicy.train.logging import read_metrics

# (metric key, plot title, y label) — the four curves the demo promises, plus σ for ALP runs.
PLOTS: tuple[tuple[str, str, str], ...] = (
    ("reward/mean", "Reward", "mean reward"),
    ("rollout_correction/kl", "Train–inference KL  E_μ[log μ − log π_old]", "KL (nats/token)"),
    ("rollout_correction/log_ppl_abs_diff", "PPL gap  E|log PPL_train − log PPL_rollout|", "|Δ log PPL|"),
    ("correction/masked_frac", "Masked / dropped token fraction", "fraction"),
)


def run_labels(files: list[Path]) -> list[str]:
    """A distinct label per metrics file: its run folder (or the file stem), with as many parent folders as it
    takes to tell runs of the same name apart. Keyed by the folder name alone, ``a/run`` and ``b/run`` used to
    collapse into one row holding only the last file.

    >>> run_labels([Path("/x/a/run/metrics.jsonl"), Path("/x/b/run/metrics.jsonl"), Path("/x/naive/metrics.jsonl")])
    ['a/run', 'b/run', 'naive']
    """
    tails = []
    for f in files:
        run = f.parent if f.name == "metrics.jsonl" else f.with_suffix("")
        tails.append([part for part in run.resolve().parts if part != run.resolve().anchor] or [str(f)])
    depth = [1] * len(files)
    while True:
        labels = ["/".join(t[-d:]) for t, d in zip(tails, depth)]
        counts = Counter(labels)
        clash = [i for i, label in enumerate(labels) if counts[label] > 1 and depth[i] < len(tails[i])]
        if not clash:
            break
        for i in clash:
            depth[i] += 1
    seen: Counter[str] = Counter()  # the same file given twice: number the repeats rather than drop one
    out = []
    for label in labels:
        seen[label] += 1
        out.append(label if seen[label] == 1 else f"{label} ({seen[label]})")
    return out


def load_runs(paths: list[str | Path]) -> dict[str, list[dict[str, Any]]]:
    """``{run label: rows}`` (labels from :func:`run_labels`). A file with no logged step is left out with a
    warning naming it; a missing or damaged file is a ``ValueError`` naming it."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            p = p / "metrics.jsonl"
        if not p.is_file():
            raise ValueError(f"metrics path {str(p)!r} does not exist")
        files.append(p)
    runs: dict[str, list[dict[str, Any]]] = {}
    for label, p in zip(run_labels(files), files):
        rows = read_metrics(p)
        if not rows:
            warnings.warn(f"metrics file {str(p)!r} has no logged steps; leaving it out", stacklevel=2)
            continue
        runs[label] = rows
    return runs


def _series(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) if r.get(key) is not None else math.nan for r in rows if key in r]


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else math.nan


def summary_rows(runs: dict[str, list[dict[str, Any]]], window: int = 5) -> list[dict[str, Any]]:
    """Per run: reward over the first / last ``window`` steps, mean KL, k3 KL, PPL gap, masked fraction, σ."""
    out = []
    for name, rows in runs.items():
        reward = _series(rows, "reward/mean")
        out.append({
            "run": name,
            "steps": len(rows),
            "reward_first": _mean(reward[:window]),
            "reward_last": _mean(reward[-window:]),
            "kl_mean": _mean(_series(rows, "rollout_correction/kl")),
            "k3_kl_mean": _mean(_series(rows, "rollout_correction/k3_kl")),
            "kl_max": max((x for x in _series(rows, "rollout_correction/kl") if math.isfinite(x)), default=math.nan),
            "ppl_gap_mean": _mean(_series(rows, "rollout_correction/log_ppl_abs_diff")),
            "masked_frac_mean": _mean(_series(rows, "correction/masked_frac")),
            "sigma_last": (_series(rows, "alp/sigma_mean") or [math.nan])[-1],
            "step_s": _mean(_series(rows, "time/step_s")),
        })
    return out


def summary_table(rows: list[dict[str, Any]], title: str = "offpolicy summary"):  # -> rich.table.Table
    """A rich table of :func:`summary_rows`."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title)
    for header in ("run", "steps", "reward first→last", "KL(μ‖π) mean", "k3 KL", "|Δ log PPL|", "masked", "ALP σ",
                   "s/step"):
        table.add_column(header, justify="left" if header == "run" else "right")

    def f(v: Any, fmt: str) -> str:
        return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)

    for r in rows:
        table.add_row(
            escape(str(r["run"])), str(r["steps"]), f"{f(r['reward_first'], '{:.3f}')}→{f(r['reward_last'], '{:.3f}')}",
            f(r["kl_mean"], "{:.2e}"), f(r["k3_kl_mean"], "{:.2e}"), f(r["ppl_gap_mean"], "{:.2e}"),
            f(r["masked_frac_mean"], "{:.3f}"), f(r["sigma_last"], "{:.1e}"), f(r["step_s"], "{:.2f}"),
        )
    return table


def plot_runs(runs: dict[str, list[dict[str, Any]]], out_dir: str | Path) -> list[Path]:
    """One PNG per metric in :data:`PLOTS` (all runs overlaid) plus ``overview.png``; returns the written paths."""
    plt = pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    fig_all, axes = plt.subplots(2, 2, figsize=(11, 7))
    for (key, title, ylabel), ax_all in zip(PLOTS, axes.flat):
        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        for name, rows in runs.items():
            xs = [r["step"] for r in rows if key in r]
            ys = _series(rows, key)
            for a in (ax, ax_all):
                if len(xs) >= 20:  # noisy per-step values: faint raw curve + a 5-step moving average
                    line, = a.plot(xs, ys, alpha=0.25, linewidth=0.8)
                    a.plot(xs, trailing_mean(ys, 5), label=name, color=line.get_color())
                else:
                    a.plot(xs, ys, label=name, marker=".")
        for a in (ax, ax_all):
            a.set_title(title, fontsize=9)
            a.set_xlabel("step")
            a.set_ylabel(ylabel)
            a.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{key.replace('/', '_')}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    axes.flat[0].legend(fontsize=8)
    fig_all.tight_layout()
    overview = out / "overview.png"
    fig_all.savefig(overview, dpi=100)
    plt.close(fig_all)
    return [overview, *written]

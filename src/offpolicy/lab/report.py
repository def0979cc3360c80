"""The lab report of a sweep folder: ``report.html`` (self-contained), ``plots/*.png``, ``lab_table.md``,
``lab_stats.json``.

:func:`write_report` reads ``OUT/summary.json`` and the finished runs' ``metrics.jsonl`` (a missing or damaged one is
a one-line ``ValueError`` naming it), computes the numbers of :mod:`offpolicy.lab.stats` (its docstring defines each
one, the spread over seeds, the mismatch trend and the "within noise" rule; the report prints the same definitions),
draws the figures of :mod:`offpolicy.lab.plots` and writes:

* ``lab_table.md`` — two Markdown tables (numbers; verdicts), each cell median [min–max] over seeds: what the
  README quotes;
* ``lab_stats.json`` — every number: per run (keyed by its folder), per preset × mismatch (``groups``), with the
  definitions and the runs that are missing (failed or not run yet);
* ``report.html`` — the tables, the figures (PNG embedded as base64), the definitions, per-run numbers.

The tables and the headline are :mod:`offpolicy.lab.tables`, the page :mod:`offpolicy.lab.report_html`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from offpolicy.atomic_files import write_atomic
from offpolicy.lab import stats as st
from offpolicy.lab.mismatch import describe_mismatch
from offpolicy.lab.report_html import render_html
from offpolicy.lab.tables import definitions, headline, markdown_tables

__all__ = [
    "LabReport",
    "setting_rule",
    "sweep_report_stats",
    "write_report",
]


def setting_rule(setting: Any) -> str:
    """The comparison rule of a named lab setting (``"ranges"`` unless the setting says ``"rule"``; ``"ranges"`` for
    a name that is not a setting)."""
    from offpolicy.lab.settings import SETTINGS

    chosen = SETTINGS.get(setting) if isinstance(setting, str) else None
    return str((chosen or {}).get("rule", "ranges"))


@dataclass
class LabReport:
    """Where the report went and its numbers (``stats`` is what ``lab_stats.json`` holds)."""

    out: Path
    html: Path
    table: Path
    stats_path: Path
    plots: list[Path]
    stats: dict[str, Any] = field(default_factory=dict)


# -- numbers ---------------------------------------------------------------------------------------------------------


def sweep_report_stats(out: str | Path) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """``(lab_stats, {dir: rows})`` of the sweep in ``out`` (the numbers only, no files written)."""
    summary, rows = st.load_sweep(out)
    plan = summary.get("plan") or {}
    runs = summary["runs"]
    presets = _ordered(plan.get("presets"), [r["preset"] for r in runs])
    mismatches = _ordered(plan.get("mismatches"), [r["mismatch"] for r in runs])
    per_run = {r["dir"]: st.run_stats(rows[r["dir"]]) for r in runs}
    rule = setting_rule(summary.get("setting"))
    groups = st.sweep_stats(runs, per_run, presets, mismatches, rule)
    finished = {r["dir"] for r in runs}
    failed = {f["dir"]: f for f in summary.get("failed", []) if isinstance(f, dict) and "dir" in f}
    missing = [{**r, "status": "failed" if r["dir"] in failed else "not run",
                **({"error": failed[r["dir"]].get("error")} if r["dir"] in failed else {})}
               for r in plan.get("runs", []) if r.get("dir") not in finished]
    step_s = st.median([s["step_s_median"] for s in per_run.values()])
    lab = {
        "setting": summary.get("setting"),
        "description": summary.get("description"),
        "complete": not missing,
        "presets": presets,
        "mismatches": mismatches,
        "engines": {m: _engine(m, plan) for m in mismatches},
        "seeds": sorted({r["seed"] for r in runs}),
        "steps": sorted({s["steps"] for s in per_run.values()}),
        "overrides": plan.get("overrides", []),
        "step_s_median": step_s,
        "rule": rule,
        "definitions": dict(definitions(rule)),
        "groups": groups,
        "separated": st.separated(groups),
        "runs": {r["dir"]: {"preset": r["preset"], "mismatch": r["mismatch"], "seed": r["seed"], **per_run[r["dir"]]}
                 for r in runs},
        "missing": missing,
    }
    lab["headline"] = headline(lab)
    return lab, rows


def _ordered(planned: Any, seen: list[str]) -> list[str]:
    order = [x for x in (planned or []) if x in seen]
    return order + [x for x in dict.fromkeys(seen) if x not in order]


def _engine(mismatch: str, plan: dict[str, Any]) -> str:
    given = (plan.get("engines") or {}).get(mismatch)
    if given:
        return given
    try:
        return describe_mismatch(mismatch)
    except ValueError:
        return "(not a named mismatch source)"



# -- files -----------------------------------------------------------------------------------------------------------


def write_report(out: str | Path) -> LabReport:
    """Read the sweep in ``out`` and write ``report.html``, ``plots/*.png``, ``lab_table.md`` and ``lab_stats.json``.

    Raises ``ValueError`` (one line, naming the file or folder) for a missing summary, a run folder without
    ``metrics.jsonl``, a damaged record, or a sweep with no finished run.
    """
    from offpolicy.lab.plots import plot_sweep

    out = Path(out)
    lab, rows = sweep_report_stats(out)
    if not lab["groups"]:
        raise ValueError(f"{str(out / 'summary.json')!r} lists no finished run: nothing to report")
    groups: dict[tuple[str, str], list[list[dict[str, Any]]]] = {}
    last: dict[tuple[str, str], list[float]] = {}
    seeds: dict[tuple[str, str], list[int]] = {}
    for d, r in lab["runs"].items():
        groups.setdefault((r["preset"], r["mismatch"]), []).append(rows[d])
        last.setdefault((r["preset"], r["mismatch"]), []).append(r["reward_last"])
        seeds.setdefault((r["preset"], r["mismatch"]), []).append(r["seed"])
    plots = plot_sweep(groups, lab["presets"], lab["mismatches"], last, out / "plots",
                       seeds if lab["rule"] == "paired" else None)
    table = out / "lab_table.md"
    write_atomic(table, markdown_tables(lab))
    stats_path = out / "lab_stats.json"
    write_atomic(stats_path, json.dumps(_json_safe(lab), indent=1))
    report = out / "report.html"
    write_atomic(report, render_html(lab, plots))
    return LabReport(out, report, table, stats_path, plots, lab)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value

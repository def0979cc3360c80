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
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from offpolicy.lab import stats as st
from offpolicy.lab.mismatch import CONTROL, describe_mismatch

DEFINITIONS = [
    ("spread", "every cell is the median over seeds with [min–max] over seeds; with 3 seeds an interquartile "
               "range would only repeat two of the values."),
    ("quarters", "a run of N logged steps has q = max(1, ⌊N/4⌋); reward first ¼ / last ¼ = mean of reward/mean over "
                 "its first / last q steps."),
    ("reward drawdown", f"the largest fall of the {st.DRAWDOWN_WINDOW}-step trailing mean of reward/mean below its "
     "running maximum: a transient collapse that recovers before the last quarter shows here."),
    ("k3 KL", "rollout_correction/k3_kl = E_μ[ρ − 1 − log ρ] with ρ = π_old/μ per sampled token (≥ 0), median over "
              "the run's steps. The signed estimator E_μ[log μ − log π_old] is not used: on short answers it goes "
              "below zero."),
    ("exact KL", "mismatch/token_kl_exact_mean, KL(μ‖π_old) over the full vocabulary, median over steps; only presets "
                 "that compute it (trm) have it, '–' elsewhere."),
    ("PPL gap", "rollout_correction/log_ppl_abs_diff = |log PPL_trainer − log PPL_rollout|, median over steps."),
    ("‖∇‖", "loss/grad_norm before clipping: median, 95th percentile (linear interpolation) and maximum over the "
            "run's steps."),
    ("masked, length", "mean over steps of correction/masked_frac (tokens a correction dropped) and "
                       "response/length_mean (tokens)."),
    ("mismatch trend", f"per run, least-squares slope b of ln(max(k3, {st.K3_FLOOR:g})) against the step; the fitted "
                       "change over the run is ×exp(b · (last − first step)). growing: b > 0 in every seed and median "
                       f"change ≥ ×{st.GROWTH:g}; falling: b < 0 in every seed and median change ≤ ×{1 / st.GROWTH:g};"
                       " flat otherwise. The mismatch is 'bounded' unless it is growing."),
    ("vs naive / vs control", "every compared measure (" + ", ".join(n for _, n, _ in st.COMPARED) + ") against "
                              "naive under the same mismatch, and against the same preset under "
                              f"'{CONTROL}' (fp32 engine, no mismatch), by one rule. Δ = difference of the medians "
                              "over seeds. 'within noise': the two min–max ranges over seeds overlap. Otherwise "
                              "'higher' / 'lower' with p = 2 / C(n + m, n), the chance that ranges of n and m seeds "
                              "separate when the two settings do not differ (3 vs 3 seeds: p = 0.10). Fewer than 2 "
                              "seeds on a side: no verdict. p is per comparison: with k comparisons in a table, about "
                              "k · p of them separate by chance alone."),
]
# the same definition under the paired rule (a setting with "rule": "paired"; stats.compare_paired)
PAIRED_VERSUS = ("vs naive / vs control", "every compared measure (" + ", ".join(n for _, n, _ in st.COMPARED) + ") "
                 "against naive under the same mismatch, and against the same preset under "
                 f"'{CONTROL}' (fp32 engine, no mismatch), seed by seed: the same seed draws the same prompts (and, "
                 "until an engine's first sync, the same samples). Δ = median of the per-seed differences. 'higher' / "
                 "'lower': the difference has that sign in every seed both ran, with p = 2 / 2ⁿ, the chance that n "
                 "seeds agree when the two settings do not differ (6 seeds: p = 0.031); 'within noise': the seeds "
                 "disagree or one ties. Fewer than 2 seeds: no verdict. p is per comparison: with k comparisons in "
                 "a table, about k · p of them separate by chance alone.")


def definitions(rule: str = "ranges") -> list[tuple[str, str]]:
    """The report's definitions (name, text), the comparison's under ``rule`` (:data:`offpolicy.lab.stats.RULES`)."""
    return [PAIRED_VERSUS if rule == "paired" and name == PAIRED_VERSUS[0] else (name, text)
            for name, text in DEFINITIONS]


def setting_rule(setting: Any) -> str:
    """The comparison rule of a named lab setting (``"ranges"`` unless the setting says ``"rule"``; ``"ranges"`` for
    a name that is not a setting)."""
    from offpolicy.lab.settings import SETTINGS

    chosen = SETTINGS.get(setting) if isinstance(setting, str) else None
    return str((chosen or {}).get("rule", "ranges"))

NUMBER_COLUMNS = [  # (stats field, header, format)
    ("reward_first", "reward first ¼", "{:.3f}"),
    ("reward_last", "reward last ¼", "{:.3f}"),
    ("reward_drawdown", "reward drawdown", "{:.3f}"),
    ("k3_median", "k3 KL (nats/token)", "{:.2e}"),
    ("exact_kl_median", "exact KL (nats/token)", "{:.2e}"),
    ("ppl_gap_median", "PPL gap |Δ log PPL|", "{:.2e}"),
    ("grad_norm_median", "‖∇‖ median", "{:.3g}"),
    ("grad_norm_p95", "‖∇‖ p95", "{:.3g}"),
    ("grad_norm_max", "‖∇‖ max", "{:.3g}"),
    ("masked_frac_mean", "masked fraction", "{:.3f}"),
    ("length_mean", "length (tokens)", "{:.1f}"),
]
VERDICT_HEADERS = ["preset", "mismatch", "against", *[n for _, n, _ in st.COMPARED], "k3 change over the run",
                   "mismatch trend"]


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


# -- formatting ------------------------------------------------------------------------------------------------------


def fmt(value: float | None, form: str) -> str:
    return "–" if value is None or (isinstance(value, float) and not math.isfinite(value)) else form.format(value)


def fmt_spread(s: dict[str, Any], form: str) -> str:
    """``median [min–max]`` (just the value for one seed, ``–`` for none).

    >>> fmt_spread({"median": 0.5, "min": 0.25, "max": 0.75, "n": 3}, "{:.2f}")
    '0.50 [0.25–0.75]'
    """
    if not s or s.get("n", 0) == 0:
        return "–"
    if s["n"] == 1:
        return fmt(s["median"], form)
    return f"{fmt(s['median'], form)} [{fmt(s['min'], form)}–{fmt(s['max'], form)}]"


DIFF_FORMS = {"reward_first": "{:+.3f}", "reward_last": "{:+.3f}", "reward_drawdown": "{:+.3f}",
              "grad_norm_max": "{:+.3g}", "k3_median": "{:+.2e}"}


def fmt_comparison(c: dict[str, Any] | None, form: str = "{:+.3f}") -> str:
    """``Δ verdict`` and ``(p = …)`` when separated.

    >>> fmt_comparison({"diff": -1.13, "verdict": "lower", "within_noise": False, "chance": 0.1}, "{:+.3g}")
    '-1.13 lower (p = 0.1)'
    """
    if not c:
        return "–"
    if c["diff"] is None:
        return c["verdict"]
    text = f"{form.format(c['diff'])} {c['verdict']}"
    return text if c["within_noise"] else f"{text} (p = {c['chance']:.2g})"


def fmt_trend(t: dict[str, Any]) -> tuple[str, str]:
    change = t["change"]
    if not change or change.get("n", 0) == 0:
        return "–", t["verdict"]
    cell = fmt_spread(change, "×{:.2g}")
    return cell, t["verdict"] if t["trend"] in ("growing", "n/a") else f"{t['verdict']} ({t['trend']})"


def _against(g: dict[str, Any], against: str) -> str:
    return f"naive, {g['mismatch']}" if against == "naive" else f"{g['preset']}, {CONTROL}"


def table_rows(lab: dict[str, Any]) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    """``(headers, rows)`` of the numbers table and of the verdict table: one verdict row per comparison (against
    naive, against the control) with a cell per :data:`~offpolicy.lab.stats.COMPARED` measure, and the group's
    mismatch trend; a group compared with nothing (naive on the control) gets one row of dashes."""
    headers = ["preset", "mismatch", "seeds", *[h for _, h, _ in NUMBER_COLUMNS]]
    numbers, verdicts = [], []
    for g in lab["groups"]:
        numbers.append([g["preset"], g["mismatch"], str(len(g["seeds"])),
                        *[fmt_spread(g[k], form) for k, _, form in NUMBER_COLUMNS]])
        change, trend = fmt_trend(g["mismatch_trend"])
        if g["mismatch"] == CONTROL:
            change, trend = "–", "(control)"
        versus = g.get("versus") or {}
        for i, against in enumerate(versus or [None]):
            cells = ([fmt_comparison(versus[against][f], DIFF_FORMS[f]) for f, _, _ in st.COMPARED] if against
                     else ["–"] * len(st.COMPARED))
            verdicts.append([g["preset"], g["mismatch"], _against(g, against) if against else "–", *cells,
                             change if i == 0 else "", trend if i == 0 else ""])
    return headers, numbers, VERDICT_HEADERS, verdicts


def headline(lab: dict[str, Any]) -> str:
    """One sentence naming every separated comparison (measure, groups, both ranges, p), or saying that none is.

    >>> c = {"within_noise": False, "verdict": "lower", "diff": -1.13, "chance": 0.1, "range": [1.31, 1.37, 1.44],
    ...      "ref_range": [1.9, 2.5, 10.4]}
    >>> g = {"preset": "tis", "mismatch": "lag8", "versus": {"naive": {"grad_norm_max": c}}}
    >>> print(headline({"groups": [g]}))  # doctest: +NORMALIZE_WHITESPACE
    Separated over seeds (1 of 1 comparisons): tis on lag8 has a lower ‖∇‖ max than naive on lag8:
    1.37 [1.31–1.44] vs 2.5 [1.9–10.4] (p = 0.1).
    """
    found = st.separated(lab["groups"])
    total = sum(len(m) for g in lab["groups"] for m in (g.get("versus") or {}).values())
    if not found:
        return (f"No measure separates over the seeds: all {total} comparisons (against naive and against the "
                "control) are within noise.")
    forms = {f: form.replace("+", "") for f, form in DIFF_FORMS.items()}

    def span(r: list[float], form: str) -> str:
        return f"{form.format(r[1])} [{form.format(r[0])}–{form.format(r[2])}]"

    parts = []
    for f in found:
        form = forms.get(f["field"], "{:.3g}")
        other = f"naive on {f['mismatch']}" if f["versus"] == "naive" else f"{f['preset']} on the {CONTROL} control"
        seeds = f" in each of the {f['n']} seeds" if f.get("rule") == "paired" else ""
        parts.append(f"{f['preset']} on {f['mismatch']} has a {f['verdict']} {f['name']} than {other}{seeds}: "
                     f"{span(f['range'], form)} vs {span(f['ref_range'], form)} (p = {f['chance']:.2g})")
    return f"Separated over seeds ({len(found)} of {total} comparisons): " + "; ".join(parts) + "."


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown_tables(lab: dict[str, Any]) -> str:
    """``lab_table.md``: a one-line caption, the numbers table, the verdict table, the rule in one line."""
    headers, numbers, vheaders, verdicts = table_rows(lab)
    seeds, steps = lab["seeds"], lab["steps"]
    caption = (f"Lab setting `{lab['setting']}`: {len(seeds)} seed{'s' if len(seeds) != 1 else ''} "
               f"({', '.join(map(str, seeds))}), "
               f"{'/'.join(map(str, steps))} steps per run; each cell: median [min–max] over seeds.")
    compared = ("seed by seed, 'within noise' = the per-seed differences disagree in sign or one ties, else p = "
                "2/2ⁿ is the chance that n seeds agree without a real difference." if lab.get("rule") == "paired" else
                "'within noise' = the min–max ranges over seeds overlap, else p = 2/C(n+m, n) is the chance of "
                "separated ranges without a real difference.")
    rule = ("Trend: least-squares slope of ln k3 over the run, 'growing' = rising in every seed and ×"
            f"{st.GROWTH:g} or more (median); comparisons: every measure by one rule, " + compared)
    missing = f"\n\nMissing runs: {len(lab['missing'])} (see lab_stats.json)." if lab["missing"] else ""
    return (f"{caption}\n\n{_md_table(headers, numbers)}\n\n{_md_table(vheaders, verdicts)}\n\n{rule}\n\n"
            f"**{headline(lab)}**{missing}\n")


def rich_table(lab: dict[str, Any], title: str = "offpolicy lab"):  # -> rich.table.Table
    """The console summary (medians over seeds; the report has the spreads): reward first→last quarter and the
    last quarter's range, the worst reward drawdown over the seeds, k3 KL, gradient-norm maximum, masked fraction, the k3 trend and the two comparisons."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    chances = sorted({c["chance"] for g in lab["groups"] for m in (g.get("versus") or {}).values()
                      for c in m.values() if c.get("chance") is not None})
    compared = ", ".join(n for _, n, _ in st.COMPARED)
    caption = ("reward ¼: mean over the first / last quarter of steps; drawdown: the worst seed's largest fall of the "
               f"{st.DRAWDOWN_WINDOW}-step mean reward below its running maximum. vs naive / vs control: each of "
               f"{compared} tested by one rule — "
               + ("the measures higher (or lower) in every seed than the reference's run of the same seed, with "
                  "their direction; noise = the seeds disagree or tie" if lab.get("rule") == "paired" else
                  "the measures whose min–max ranges over seeds do not overlap, with their direction; noise = every "
                  "range overlaps")
               + (f" (chance of a separation without a real difference: p = {', '.join(f'{c:.2g}' for c in chances)}"
                  " per measure)" if chances else "") + ". Spreads and definitions: report.html")
    table = Table(title=escape(f"{title}: medians over seeds"), caption=escape(caption), box=box.SIMPLE_HEAD,
                  padding=(0, 1), pad_edge=False)
    for header in ("preset", "mismatch", "reward ¼\nfirst→last", "last ¼\nrange", "draw-\ndown", "k3 KL", "‖∇‖\nmax",
                   "masked",
                   "k3\ntrend", "vs\nnaive", "vs\ncontrol"):
        table.add_column(header, justify="left" if header in ("preset", "mismatch") else "right", no_wrap=True)

    short = {"reward_first": "reward first", "reward_last": "reward last", "reward_drawdown": "drawdown",
             "grad_norm_max": "‖∇‖ max", "k3_median": "k3"}

    def versus(measures: dict[str, dict[str, Any]] | None) -> str:
        if not measures:
            return "–"
        if all(c["within_noise"] is None for c in measures.values()):
            return "too few seeds"
        apart = [f"{short.get(f, f)} {'↑' if c['diff'] > 0 else '↓'}" for f, c in measures.items()
                 if c["within_noise"] is False]
        return "\n".join(apart) if apart else "noise"

    for g in lab["groups"]:
        change, _ = fmt_trend(g["mismatch_trend"])
        last = g["reward_last"]
        table.add_row(
            escape(g["preset"]), escape(g["mismatch"]),
            f"{fmt(g['reward_first']['median'], '{:.3f}')}→{fmt(last['median'], '{:.3f}')}",
            f"{fmt(last['min'], '{:.3f}')}–{fmt(last['max'], '{:.3f}')}" if last["n"] > 1 else "–",
            fmt(g["reward_drawdown"]["max"], "{:.2f}"), fmt(g["k3_median"]["median"], "{:.1e}"), fmt(g["grad_norm_max"]["median"], "{:.3g}"),
            fmt(g["masked_frac_mean"]["median"], "{:.3f}"),
            "(control)" if g["mismatch"] == CONTROL else
            g["mismatch_trend"]["trend"],
            versus((g.get("versus") or {}).get("naive")),
            versus((g.get("versus") or {}).get("control")),
        )
    return table


# -- files -----------------------------------------------------------------------------------------------------------


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
    _atomic_write(table, markdown_tables(lab))
    stats_path = out / "lab_stats.json"
    _atomic_write(stats_path, json.dumps(_json_safe(lab), indent=1))
    report = out / "report.html"
    _atomic_write(report, render_html(lab, plots))
    return LabReport(out, report, table, stats_path, plots, lab)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


# -- HTML ------------------------------------------------------------------------------------------------------------

_CSS = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 1250px; color: #222; line-height: 1.45; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { font-size: 1.25em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.8em; margin: 0.6em 0; }
th, td { border: 1px solid #ddd; padding: 3px 6px; text-align: right; white-space: nowrap; }
th { white-space: normal; vertical-align: bottom; }  /* long headers wrap: the table fits 1400 px windows */
.headline { font-weight: 600; background: #eef6ee; border-left: 4px solid #0a7d32; padding: 0.5em 1em; }
th { background: #f4f4f4; } td:first-child, td:nth-child(2), th:first-child, th:nth-child(2) { text-align: left; }
tr.control td { background: #fafafa; color: #555; }
.apart { color: #1a4fa0; font-weight: 600; }  /* separated: higher or lower is good or bad by the measure */
.growing { color: #b00020; font-weight: 600; }
img { max-width: 100%; border: 1px solid #eee; } code { background: #f4f4f4; padding: 0 3px; }
.note { color: #555; font-size: 0.9em; } dt { font-weight: 600; margin-top: 0.4em; } dd { margin-left: 1.5em; }
.range { color: #777; font-size: 0.9em; }
.warn { background: #fff4e5; border-left: 4px solid #f0a020; padding: 0.5em 1em; }
"""


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt)}">'


def _html_table(headers: list[str], rows: list[list[str]], control_col: int | None = 1) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cls = ' class="control"' if control_col is not None and row[control_col] == CONTROL else ""
        cells = []
        for c in row:
            klass = "apart" if "(p = " in c else ("growing" if c == "growing" else None)
            value, sep, rest = c.partition(" [")
            # "median [min–max]": the range on a second, quieter line keeps the table within the page
            text = (f"{html.escape(value)}<br><span class='range'>[{html.escape(rest)}</span>" if sep
                    else html.escape(c))
            cells.append(f'<td class="{klass}">{text}</td>' if klass else f"<td>{text}</td>")
        body.append(f"<tr{cls}>{''.join(cells)}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def render_html(lab: dict[str, Any], plots: list[Path]) -> str:
    """The self-contained report page (figures embedded as base64 PNG)."""
    e = html.escape
    headers, numbers, vheaders, verdicts = table_rows(lab)
    by_name = {p.stem: p for p in plots}
    seeds = ", ".join(map(str, lab["seeds"]))
    status = ("" if lab["complete"] else
              f'<p class="warn">{len(lab["missing"])} planned runs are missing (failed or not run yet); the tables '
              "use the finished runs only — see the end of this page.</p>")
    engines = "".join(f"<tr><td>{e(m)}</td><td style='text-align:left'>{e(d)}</td></tr>"
                      for m, d in lab["engines"].items())
    defs = "".join(f"<dt>{e(k)}</dt><dd>{e(v)}</dd>"
                   for k, v in (lab.get("definitions") or dict(DEFINITIONS)).items())
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>offpolicy lab — {e(str(lab['setting']))}</title><style>{_CSS}</style></head><body>",
        f"<h1>offpolicy lab — setting <code>{e(str(lab['setting']))}</code></h1>",
        f"<p>{e(str(lab.get('description') or ''))}</p>",
        f"<p class='headline'>{e(lab.get('headline') or headline(lab))}</p>",
        f"<p>{len(lab['presets'])} presets × {len(lab['mismatches'])} rollout engines × seeds {e(seeds)}; "
        f"{'/'.join(map(str, lab['steps']))} steps per run; median step time {fmt(lab['step_s_median'], '{:.2f}')} s "
        f"(one torch thread per run). The trainer always scores in fp32; the rollout engine differs as listed.</p>",
        status,
        f"<table><thead><tr><th>mismatch</th><th>rollout engine</th></tr></thead><tbody>{engines}</tbody></table>",
        ("<p class='note'>Shared trainer overrides: <code>" + e(" ".join(lab["overrides"])) + "</code></p>"
         if lab["overrides"] else ""),
        "<h2>Overview</h2>",
        _img(by_name["overview"], "overview") if "overview" in by_name else "",
        "<h2>Numbers per preset × mismatch</h2><p class='note'>median [min–max] over seeds; definitions below.</p>",
        _html_table(headers, numbers),
        "<h2>Verdicts</h2>",
        "<p class='note'>Each measure against naive on the same engine and against the same preset on the fp32 "
        "control, by one rule: "
        + ("seed by seed; 'within noise': the per-seed differences disagree in sign or one ties; otherwise p is the "
           "chance that every seed agrees" if lab.get("rule") == "paired" else
           "'within noise': the seeds' min–max ranges overlap; otherwise p is the chance of such a separation")
        + " between two settings that do not differ. 'bounded': the mismatch is not growing in every seed "
        f"by ×{st.GROWTH:g} or more.</p>",
        _html_table(vheaders, verdicts),
    ]
    if "final_reward" in by_name:
        parts += ["<h2>Last-quarter reward per run</h2>", _img(by_name["final_reward"], "final reward")]
    from offpolicy.lab.plots import CURVES

    for _, stem, title, *_ in CURVES:
        if stem in by_name:
            parts += [f"<h2>{e(title)}</h2>", _img(by_name[stem], title)]
    if "variants" in by_name:
        parts += ["<h2>Controllers beside their fixed-threshold presets, seed by seed</h2>",
                  _img(by_name["variants"], "variants")]
    if "controls" in by_name:
        parts += ["<h2>Closed-loop control: thresholds per step</h2>", _img(by_name["controls"], "controls")]
    parts += ["<h2>Definitions</h2>", f"<dl>{defs}</dl>", "<h2>Runs</h2>", _runs_table(lab)]
    if lab["missing"]:
        rows = [[m.get("preset", ""), m.get("mismatch", ""), str(m.get("seed", "")), m.get("dir", ""), m["status"],
                 m.get("error") or ""] for m in lab["missing"]]
        parts += ["<h2>Missing runs</h2>",
                  _html_table(["preset", "mismatch", "seed", "folder", "status", "last log line"], rows, None)]
    parts.append("</body></html>")
    return "\n".join(p for p in parts if p)


def _runs_table(lab: dict[str, Any]) -> str:
    headers = ["preset", "mismatch", "seed", "folder", "steps", "reward first ¼", "reward last ¼", "k3 KL",
               "k3 change", "‖∇‖ max", "masked", "s/step", "non-finite values"]
    rows = []
    for d, r in lab["runs"].items():
        rows.append([r["preset"], r["mismatch"], str(r["seed"]), d, str(r["steps"]), fmt(r["reward_first"], "{:.3f}"),
                     fmt(r["reward_last"], "{:.3f}"), fmt(r["k3_median"], "{:.2e}"), fmt(r["k3_change"], "×{:.2g}"),
                     fmt(r["grad_norm_max"], "{:.3g}"), fmt(r["masked_frac_mean"], "{:.3f}"),
                     fmt(r["step_s_median"], "{:.2f}"),
                     ", ".join(f"{k}: {v}" for k, v in r["nonfinite"].items()) or "0"])
    return f"<details><summary>{len(rows)} runs</summary>{_html_table(headers, rows)}</details>"

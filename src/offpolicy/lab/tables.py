"""The lab report's tables as text: the definitions it prints, cell formats (median [min–max] over seeds, a
comparison's Δ and verdict), the numbers and verdict tables (Markdown for ``lab_table.md``, rich for the console) and
the one-sentence headline. :mod:`offpolicy.lab.report` writes them; :mod:`offpolicy.lab.stats` computes what they
show.
"""

from __future__ import annotations

import math
from typing import Any

from offpolicy.lab import stats as st
from offpolicy.lab.mismatch import CONTROL

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

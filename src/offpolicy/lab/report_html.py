"""``report.html`` of a sweep: one self-contained page (figures embedded as base64 PNG) with the tables of
:mod:`offpolicy.lab.tables`, the definitions, every run and the missing ones."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from offpolicy.lab import stats as st
from offpolicy.lab.mismatch import CONTROL
from offpolicy.lab.tables import DEFINITIONS, fmt, headline, table_rows

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

"""The inspection report: ``report.json`` (stable keys, for machines), PNG figures and a self-contained ``report.html``.

``report.json`` keys every consumer may rely on: ``kl_mean``, ``kl_max``, ``tv_mean``, ``tail_head_ratio``, ``layers``
(list of ``{name, rel_error, share}``), ``first_divergent_layer``, ``recommended``
(``{correction: {threshold, …, kept_fraction}}``); the rest is documented in :func:`~offpolicy.inspect.summary.summarize`. A value that could not
be measured (no full logits, no model) is ``null``, never a made-up number.

The numbers are :mod:`offpolicy.inspect.summary`, the figures (``FIGURES``, PNG) :mod:`offpolicy.inspect.figures`;
this module writes them with a self-contained ``report.html``, and the mismatch table of several inspections.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from offpolicy.inspect.depth import depth_rows
from offpolicy.inspect.figures import write_figures
from offpolicy.inspect.measurements import Measurements
from offpolicy.inspect.summary import headline, summarize

__all__ = [
    "TABLE_COLUMNS",
    "markdown_table",
    "table_row",
    "write_html",
    "write_report",
]


def _fmt(x: Any) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.4g}"
    if isinstance(x, list):
        return "[" + ", ".join(_fmt(v) for v in x) + "]"
    return str(x)


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_CAPTIONS = {
    "overview": "Key figures.",
    "envelope": "Left: |Δ_a| / (2 ε_max e^{2 ε_max}) over the vocabulary against p_a; the black curve 1 − p is DVP "
                "Prop. 4.2 in the form that always holds, 2 ε_max (1 − p) e^{2 ε_max}; red points break it as printed, "
                "2 ε_max (1 − p). Right: mean |Δ| per probability decade (shaded: tail p < 1e-3, head p > 0.5).",
    "prop43_sign": "Sampled tokens: mean Δ = log π − log μ per decade of π; DVP Prop. 4.3 predicts Δ < 0 in the tail "
                   "(the engine over-estimates the rare tokens it samples).",
    "quantile_envelope": "Quantiles of log(π/μ) of sampled tokens per probability bin (ALP's quantile envelope).",
    "scatter": "π_train against π_infer of every sampled token, with Pearson r (ALP Fig. 10).",
    "trm_acceptance": "TRM acceptance against δ for the max and avg tests (70 % marked), and against length with the "
                      "i.i.d. prediction (1 − p)^T.",
    "layers": "Relative error of the hidden states at each hooked point; red: the first above the threshold.",
    "depth": "The mismatch by position in the response (doubling bins): k3 and ½r² of the sampled token and the "
             "per-token KL(μ‖π) of the full distributions (left, log axes); mean |log π − log μ| and the signed mean "
             "log μ − log π, Tinker's kl_sample_train_v1 (right). Does it grow with depth?",
}


def _routing_section(summary: dict) -> str:
    """Mixture-of-experts models: the routing flips per layer, the KL of flipped vs unflipped tokens, and the model
    measured beside this one (empty for a dense model without ``beside``)."""
    routing, beside = summary.get("routing"), summary.get("beside")
    parts = []
    if routing:
        rows = [[f"layer {i}", r] for i, r in enumerate(routing["flip_rate_per_layer"])]
        rows += [["all layers", routing["flip_rate"]]]
        parts.append("<h2>Routing flips (mixture of experts)</h2><p>Share of routed token slots whose top-k expert set "
                     "differs between the rollout engine and the trainer.</p>" + _table(["MoE layer", "flip rate"], rows))
        kl_rows = [[name, routing[f"{key}_flipped_mean"], routing[f"{key}_unflipped_mean"], routing[f"{key}_ratio"]]
                   for key, name in (("kl_reverse", "KL(π‖μ)"), ("kl", "KL(μ‖π)"))]
        kl_rows.append(["tokens", routing["flipped_tokens"], routing["unflipped_tokens"], None])
        parts.append("<p>Response tokens whose predicting position flipped in ≥ 1 layer against those with none.</p>"
                     + _table(["full-vocabulary KL", "flipped", "unflipped", "ratio"], kl_rows))
    if beside:
        rows = [[name, summary.get(key), beside.get(key), beside.get(f"{key}_ratio")]
                for key, name in (("kl_mean", "mean KL(μ‖π)"), ("kl_reverse_mean", "mean KL(π‖μ)"),
                                  ("k3_kl", "k3 of the sampled token"))]
        model = (summary.get("meta") or {}).get("model", "this model")
        parts.append(f"<h2>Beside {html.escape(str(beside['model']))}</h2><p>The same engines, prompts and seed on "
                     f"{html.escape(str(beside['model']))}.</p>"
                     + _table(["metric", str(model), str(beside["model"]), "ratio"], rows))
    return "".join(parts)


def write_html(summary: dict, figures: dict[str, Path], path: Path) -> None:
    """A single self-contained HTML file: tables of the numbers and every PNG embedded as base64."""
    meta = summary.get("meta") or {}
    specs = [[side, (meta.get(side) or {}).get("name", "–"), (meta.get(side) or {}).get("description", "–")]
             for side in ("rollout", "trainer") if meta.get(side)]
    key_rows = [[k, summary.get(k)] for k in (
        "kl_source", "kl_mean", "kl_median", "kl_p99", "kl_max", "kl_upper_mean", "kl_reverse_mean", "tv_mean", "tv_max",
        "topk_overlap_mean",
        "sampled_abs_delta_mean", "sampled_abs_delta_max", "tail_head_ratio", "tail_head_source", "pearson_r", "ess",
        "chi2_token", "chi2_seq", "k3_kl", "first_divergent_layer", "largest_share_layer", "positions", "sequences")]
    env = summary.get("envelope")
    if env:
        key_rows += [[f"envelope {k}", v] for k, v in env.items()]
    tail = summary.get("sampled_tail") or {}
    key_rows += [[f"sampled tail (π < {tail.get('p_below')}) {k}", v] for k, v in tail.items() if k != "p_below"]
    rec_rows = [[name, r.get("threshold"), r.get("target"), r.get("kept_fraction"), r.get("unit")]
                for name, r in summary["recommended"].items()]
    preset_rows = [[p["preset"], p["setting"], p["masked_tokens"], p["dropped_sequences"], p["truncated_tokens"]]
                   for p in summary["presets"]]
    layer_rows = [[x["name"], x["rel_error"], x["share"]] for x in summary.get("layers") or []]
    imgs = []
    for name, p in figures.items():
        data = base64.b64encode(Path(p).read_bytes()).decode("ascii")
        imgs.append(f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,{data}">'
                    f"<figcaption>{html.escape(_CAPTIONS.get(name, name))}</figcaption></figure>")
    sections = [
        f"<h1>offpolicy inspect</h1><p>{html.escape(headline(summary))}</p>",
        _table(["side", "spec", "numerics"], specs) if specs else "",
        "<h2>Mismatch</h2>" + _table(["metric", "value"], key_rows),
        "<h2>Recommended thresholds (re-applied to this data)</h2>"
        + _table(["correction", "threshold", "target", "kept (verified)", "of"], rec_rows),
        "<h2>Each correction at its defaults</h2>"
        + _table(["correction", "setting", "tokens masked", "sequences dropped", "tokens truncated"], preset_rows),
        ("<h2>Per-layer relative error</h2>" + _table(["point", "relative error", "share"], layer_rows))
        if layer_rows else "<h2>Per-layer relative error</h2><p>not measured (no model)</p>",
        "<h2>Mismatch by position in the response</h2>" + _table(*depth_rows(summary)),
        _routing_section(summary),
        "<h2>Figures</h2>" + "".join(imgs),
    ]
    style = ("body{font-family:sans-serif;max-width:1200px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;margin:0.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;"
             "font-size:13px;text-align:left}th{background:#f3f3f3}img{max-width:100%}"
             "figure{margin:1em 0 2em}figcaption{font-size:13px;color:#555}")
    path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>offpolicy inspect report</title>"
                    f"<style>{style}</style></head><body>{''.join(sections)}</body></html>", encoding="utf-8")


def write_report(measured: Measurements, out_dir: str | Path) -> dict[str, Any]:
    """``report.json``, the PNGs and ``report.html`` in ``out_dir``; returns the summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(measured)
    figures = write_figures(measured, summary, out)
    summary["figures"] = {name: p.name for name, p in figures.items()}
    (out / "report.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    write_html(summary, figures, out / "report.html")
    return summary


TABLE_COLUMNS = ("rollout", "trainer", "mean KL", "median KL", "max KL", "mean TV", "tail/head", "enters at",
                 "most added by",
                 "TRM-Max δ", "TRM-Avg δ", "MIS band", "OPSM δ", "veto τ", "DVP ρ")


def table_row(summary: dict) -> list[str]:
    """One row of the mismatch table (:data:`TABLE_COLUMNS`) from a :func:`summarize` result."""
    meta = summary.get("meta") or {}
    rec = summary.get("recommended") or {}

    def g(x: Any, fmt: str = "{:.2g}") -> str:
        return "–" if x is None else fmt.format(x)

    def kept(name: str, value: str) -> str:
        r = rec.get(name)
        return "–" if r is None else f"{value} ({r['kept_fraction']:.0%})"

    mis = rec.get("mis") or {}
    dvp = rec.get("dvp") or {}
    return [
        (meta.get("rollout") or {}).get("name", "–"), (meta.get("trainer") or {}).get("name", "–"),
        g(summary.get("kl_mean"), "{:.2e}"), g(summary.get("kl_median"), "{:.2e}"), g(summary.get("kl_max"), "{:.3g}"),
        g(summary.get("tv_mean"), "{:.2e}"),
        g(summary.get("tail_head_ratio"), "{:.1f}×"), summary.get("first_divergent_layer") or "–",
        summary.get("largest_share_layer") or "–",
        kept("trm_max", g((rec.get("trm_max") or {}).get("max_kl"))),
        kept("trm_avg", g((rec.get("trm_avg") or {}).get("avg_kl"))),
        kept("mis", f"[{mis.get('lower', 0):.3g}, {mis.get('upper', 0):.3g}]") if mis else "–",
        kept("opsm", g((rec.get("opsm") or {}).get("delta"))),
        kept("veto", g((rec.get("veto") or {}).get("threshold"))),
        kept("dvp", f"e^{dvp['log_rho']:.0f}") if dvp else "–",
    ]


def markdown_table(summaries: list[dict]) -> str:
    """The mismatch table of several inspections, as Markdown (the README's table)."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(table_row(s)) + " |" for s in summaries]
    return "\n".join(lines) + "\n"

"""The inspection report: ``report.json`` (stable keys, for machines), PNG figures and a self-contained ``report.html``.

``report.json`` keys every consumer may rely on: ``kl_mean``, ``kl_max``, ``tv_mean``, ``tail_head_ratio``, ``layers``
(list of ``{name, rel_error, share}``), ``first_divergent_layer``, ``recommended``
(``{correction: {threshold, …, kept_fraction}}``); the rest is documented in :func:`summarize`. A value that could not
be measured (no full logits, no model) is ``null``, never a made-up number.

Figures (each also embedded in the HTML as base64):

* ``envelope.png`` — |Δ_a| / (2 ε_max e^{2 ε_max}) against p_a over the vocabulary: DVP Prop. 4.2 in the form that
  always holds, 2 ε_max (1 − p) e^{2 ε_max} (:func:`offpolicy.mismatch_envelope`, ``rigorous=True``), is the curve
  1 − p; red points break the form as printed, 2 ε_max (1 − p). Right: mean |Δ| per probability decade — the
  head-vs-tail asymmetry.
* ``prop43_sign.png`` — Δ of *sampled* tokens per probability decade: DVP Prop. 4.3 predicts Δ < 0 (μ > π) in the tail.
* ``quantile_envelope.png`` — quantiles of log(π/μ) per probability decade (ALP, arXiv 2603.19470, Fig. 2).
* ``scatter.png`` — π_train against π_infer of sampled tokens with Pearson r (ALP Fig. 10).
* ``trm_acceptance.png`` — TRM acceptance against δ (max and avg tests) and against length with (1 − p)^T.
* ``layers.png`` — relative error per hooked point, the threshold and the first divergent layer.
* ``depth.png`` — the mismatch by position in the response (k3, ½r², the per-token KL, |Δ log p| per doubling bin:
  :mod:`offpolicy.inspect.depth`; ``by_position`` in ``report.json``).
* ``overview.png`` — six key panels in one picture (the README shows it).
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any

import torch

import offpolicy as op
from offpolicy.inspect.depth import depth_rows, depth_summary, plot_depth
from offpolicy.inspect.layers import LAYER_THRESHOLD, first_divergent, layer_shares
from offpolicy.inspect.measurements import HEAD_P, N_P_BINS, P_BIN_EDGES, TAIL_P, Measurements
from offpolicy.inspect.recommend import preset_effects, recommend, trm_divergence

REPORT_VERSION = 1
SAMPLED_TAIL_P = 1e-2  # Prop. 4.3's "tail" for sampled tokens: π < 1%
FIGURES = ("overview", "envelope", "prop43_sign", "quantile_envelope", "scatter", "trm_acceptance", "layers", "depth")


def _f(x: Any) -> float | None:
    """A finite float, or None (JSON has no NaN/inf)."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x[mask].double()


def _bin_index(p: torch.Tensor) -> torch.Tensor:
    """Probability decade of each p (0 … N_P_BINS − 1; p < 1e-12 in the first, p = 1 in the last)."""
    return torch.floor(torch.log10(p.clamp(min=1e-300))).add(N_P_BINS).clamp(0, N_P_BINS - 1).long()


def summarize(measured: Measurements) -> dict[str, Any]:
    """All report numbers as a JSON-ready dict (keys: module docstring and below).

    Beyond the stable keys: ``kl_source`` ("exact", "topk lower bound" or "k3 of the sampled token"), ``kl_median``,
    ``kl_p99`` (the mean is carried by a heavy tail of positions),
    ``kl_reverse_mean``, ``tv_max``, ``topk_overlap_mean``, ``sampled_abs_delta_mean/max`` (|log π − log μ| of the
    sampled tokens), ``tail_head_source`` ("vocabulary" or "sampled tokens"), ``envelope`` (Prop. 4.2 counts),
    ``sampled_tail`` (Prop. 4.3), ``pearson_r``, ``ess``, ``chi2_token``, ``chi2_seq``, ``k3_kl``,
    ``largest_share_layer``, ``layer_threshold``, ``presets`` (each correction at its defaults), ``dvp_grid`` (retained
    mass and kept tokens at every ρ of the grid), ``by_position`` (the mismatch per position bin,
    :func:`offpolicy.inspect.depth.depth_summary`), ``checks``, ``meta``.
    """
    t = measured.tokens
    m = t.mask
    n = int(m.sum())
    r = t.log_ratio[m].double()
    finite = torch.isfinite(r)
    out: dict[str, Any] = {"report_version": REPORT_VERSION, "positions": n, "sequences": int(m.any(-1).sum())}
    kl = None if t.kl is None else _masked(t.kl, m)
    if kl is not None:
        out["kl_source"] = "exact" if t.kl_kind == "exact" else "topk lower bound"
    else:  # no distribution: the k3 estimator of KL(μ‖π) from the sampled tokens (unbiased under μ)
        kl, out["kl_source"] = op.k3(t.log_ratio)[m].double(), "k3 of the sampled token"
    out["kl_mean"] = _f(kl.mean()) if n else 0.0
    out["kl_max"] = _f(kl.max()) if n else 0.0
    # the mean is carried by a few positions (a heavy tail); the median and the 99th percentile show the typical one
    out["kl_median"] = _f(kl.median()) if n else 0.0
    out["kl_p99"] = _f(torch.quantile(kl[torch.isfinite(kl)], 0.99)) if n and bool(torch.isfinite(kl).any()) else None
    out["kl_nonfinite_positions"] = int((~torch.isfinite(kl)).sum())
    out["kl_upper_mean"] = _f(_masked(t.kl_upper, m).mean()) if t.kl_upper is not None and n else None
    out["kl_reverse_mean"] = _f(_masked(t.kl_reverse, m).mean()) if t.kl_reverse is not None and n else None
    out["tv_mean"] = _f(_masked(t.tv, m).mean()) if t.tv is not None and n else None
    out["tv_max"] = _f(_masked(t.tv, m).max()) if t.tv is not None and n else None
    out["topk_overlap_mean"] = _f(_masked(t.topk_overlap, m).mean()) if t.topk_overlap is not None and n else None
    out["sampled_abs_delta_mean"] = _f(r[finite].abs().mean()) if bool(finite.any()) else None
    out["sampled_abs_delta_max"] = _f(r[finite].abs().max()) if bool(finite.any()) else None
    out["sampled_nonfinite"] = int((~finite).sum())
    out.update(_tail_head(measured))
    out["sampled_tail"] = _sampled_tail(measured)
    p_train, p_infer = t.trainer_logp[m].double().exp(), t.rollout_logp[m].double().exp()
    ok = torch.isfinite(p_train) & torch.isfinite(p_infer)
    out["pearson_r"] = _f(torch.corrcoef(torch.stack([p_train[ok], p_infer[ok]]))[0, 1]) if int(ok.sum()) > 1 else None
    metrics = op.offpolicy_metrics(t.trainer_logp, t.rollout_logp, m, prefix="")
    for key in ("ess", "chi2_token", "chi2_seq", "k3_kl"):
        out[key] = _f(metrics[key])
    out.update(_layers(measured))
    out["recommended"] = recommend(measured)
    out["dvp_grid"] = _dvp_grid(measured)
    out["presets"] = preset_effects(t)
    out["by_position"] = depth_summary(measured)
    out["checks"] = {
        "capture_max_abs_error": measured.meta.get("capture_max_abs_error"),
        "corrected_envelope_violations": None if measured.vocab is None else measured.vocab.corrected_violations,
    }
    out["meta"] = {k: v for k, v in measured.meta.items()}
    return _json_ready(out)


def _tail_head(measured: Measurements) -> dict[str, Any]:
    v = measured.vocab
    if v is not None:
        eps = measured.tokens.eps_max
        eps_v = eps[measured.tokens.mask].double() if eps is not None else torch.zeros(0)
        return {
            "tail_head_ratio": _f(v.tail_head_ratio), "tail_head_source": "vocabulary",
            "tail_abs_delta_mean": _f(v.tail_abs_delta / v.tail_count) if v.tail_count else None,
            "head_abs_delta_mean": _f(v.head_abs_delta / v.head_count) if v.head_count else None,
            "envelope": {
                "pairs": v.pairs, "skipped_positions": v.skipped_rows, "paper_violations": v.paper_violations,
                "paper_violation_fraction": v.paper_violations / v.pairs if v.pairs else 0.0,
                "corrected_violations": v.corrected_violations,
                "eps_max_mean": _f(eps_v.mean()) if eps_v.numel() else None,
                "eps_max_max": _f(eps_v.max()) if eps_v.numel() else None,
            },
        }
    t = measured.tokens
    p = t.trainer_logp[t.mask].double().exp()
    d = t.log_ratio[t.mask].double().abs()
    ok = torch.isfinite(d)
    head, tail = ok & (p > HEAD_P), ok & (p < TAIL_P)
    ratio = None
    if bool(head.any()) and bool(tail.any()) and float(d[head].mean()) > 0:
        ratio = float(d[tail].mean() / d[head].mean())
    return {"tail_head_ratio": ratio, "tail_head_source": "sampled tokens",
            "tail_abs_delta_mean": _f(d[tail].mean()) if bool(tail.any()) else None,
            "head_abs_delta_mean": _f(d[head].mean()) if bool(head.any()) else None, "envelope": None}


def _sampled_tail(measured: Measurements) -> dict[str, Any]:
    """DVP Prop. 4.3 on sampled tokens with π < 1 %: the mean of Δ = log π − log μ and how often it is negative."""
    t = measured.tokens
    p = t.trainer_logp[t.mask].double().exp()
    d = t.log_ratio[t.mask].double()
    sel = torch.isfinite(d) & (p < SAMPLED_TAIL_P)
    count = int(sel.sum())
    return {"p_below": SAMPLED_TAIL_P, "count": count, "mean_delta": _f(d[sel].mean()) if count else None,
            "frac_negative": _f((d[sel] < 0).double().mean()) if count else None}


def _dvp_grid(measured: Measurements) -> list[dict[str, float]] | None:
    """DVP at every ρ of the grid: the trainer's retained mass (min, mean) and the sampled tokens inside both sets."""
    g = measured.dvp
    if g is None or g.mass.numel() == 0:
        return None
    inside = g.inside_trainer & (g.inside_rollout if g.inside_rollout is not None else g.inside_trainer)
    return [{"rho": rho, "log_rho": math.log(rho), "mass_min": float(g.mass[:, j].min()),
             "mass_mean": float(g.mass[:, j].double().mean()), "kept_fraction": float(inside[:, j].double().mean())}
            for j, rho in enumerate(g.rhos)]


def _layers(measured: Measurements) -> dict[str, Any]:
    if not measured.layers:
        return {"layers": None, "first_divergent_layer": None, "largest_share_layer": None,
                "layer_threshold": measured.layer_threshold}
    threshold = measured.layer_threshold if measured.layer_threshold is not None else LAYER_THRESHOLD
    shares = layer_shares(measured.layers)
    largest = max(range(len(shares)), key=lambda i: shares[i]) if any(shares) else None
    return {
        "layers": [{"name": layer.name, "rel_error": layer.rel_error, "share": s}
                   for layer, s in zip(measured.layers, shares)],
        "first_divergent_layer": first_divergent(measured.layers, threshold),
        "largest_share_layer": None if largest is None else measured.layers[largest].name,
        "layer_threshold": threshold,
    }


def _json_ready(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _json_ready(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_ready(v) for v in x]
    if isinstance(x, torch.Tensor):
        return _json_ready(x.tolist())
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    return x


# ---------------------------------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # headless: never open a window
    import matplotlib.pyplot as plt

    return plt


def _bin_centres() -> list[float]:
    return [10 ** (P_BIN_EDGES[i] + 0.5) for i in range(N_P_BINS)]


def _sampled(measured: Measurements) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(π, μ, Δ = log π − log μ) of the valid sampled tokens with finite values, float64."""
    t = measured.tokens
    lp, lm = t.trainer_logp[t.mask].double(), t.rollout_logp[t.mask].double()
    ok = torch.isfinite(lp) & torch.isfinite(lm)
    return lp[ok].exp(), lm[ok].exp(), (lp - lm)[ok]


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9, color="0.4", wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def plot_envelope(ax, measured: Measurements, summary: dict) -> None:
    """|Δ| / (2 ε_max e^{2 ε_max}) against p: the corrected Prop. 4.2 envelope is the curve 1 − p, which no point may
    cross; red points cross the form as printed, 2 ε_max (1 − p)."""
    v = measured.vocab
    if v is not None and v.scatter_p:
        p = torch.tensor(v.scatter_p, dtype=torch.float64)
        d = torch.tensor(v.scatter_abs_delta, dtype=torch.float64)
        e = torch.tensor(v.scatter_eps_max, dtype=torch.float64)
        label = "(position, token) pairs"
        env = summary.get("envelope") or {}
        title = (f"|Δ| vs p, {env.get('pairs', 0):,} vocabulary pairs\nabove the printed 2ε(1−p): "
                 f"{env.get('paper_violations', 0):,}; above the corrected 2ε(1−p)e^(2ε): "
                 f"{env.get('corrected_violations', 0)}")
    elif measured.tokens.eps_max is not None:
        t = measured.tokens
        eps_max = measured.tokens.eps_max
        ok = t.mask & torch.isfinite(t.log_ratio)
        p, d, e = t.trainer_logp[ok].double().exp(), t.log_ratio[ok].double().abs(), eps_max[ok].double()
        label, title = "sampled tokens", "|Δ| vs p (sampled tokens) against the corrected Prop. 4.2 envelope"
    else:
        _no_data(ax, "no full logits: the envelope needs ε_max per position\n(run offpolicy inspect on the model)")
        ax.set_title("DVP Prop. 4.2 envelope", fontsize=9)
        return
    y = d / (2 * e * torch.exp(2 * e))
    keep = torch.isfinite(y) & (p > 0)
    p, y, e = p[keep], y[keep], e[keep]
    printed = y * torch.exp(2 * e) > (1 - p)  # above 2 ε (1 − p)
    ax.scatter(p[~printed], y[~printed], s=3, alpha=0.25, color="tab:blue", label=label, rasterized=True)
    ax.scatter(p[printed], y[printed], s=5, alpha=0.8, color="tab:red", label="above the printed 2ε(1−p)",
               rasterized=True)
    grid = torch.logspace(-12, 0, 200, dtype=torch.float64)
    ax.plot(grid, 1 - grid, color="k", linewidth=1.2, label="1 − p: the corrected envelope")
    ax.set_xscale("log")
    ax.set_xlim(1e-12, 1.5)
    ax.set_ylim(0, max(1.15, float(y.max()) * 1.05) if y.numel() else 1.15)
    ax.set_xlabel("p = π_train(a)")
    ax.set_ylabel("|Δ_a| / (2 ε_max e^(2 ε_max))")
    ax.set_title(title, fontsize=7.5)
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(alpha=0.3)


def plot_error_by_p(ax, measured: Measurements, summary: dict) -> None:
    """Mean |Δ| per probability decade: over the vocabulary when known, else over sampled tokens."""
    v = measured.vocab
    xs = _bin_centres()
    if v is not None:
        ys = [s / c if c else math.nan for s, c in zip(v.bin_abs_delta, v.bin_count)]
        label = "all (position, token) pairs"
    else:
        p, _, d = _sampled(measured)
        idx = _bin_index(p)
        ys = [float(d[idx == i].abs().mean()) if bool((idx == i).any()) else math.nan for i in range(N_P_BINS)]
        label = "sampled tokens"
    ax.plot(xs, ys, marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ratio = summary.get("tail_head_ratio")
    ax.set_title("mean |log π − log μ| by probability" + (f" — tail/head {ratio:.1f}×" if ratio else ""), fontsize=9)
    ax.axvspan(1e-12, TAIL_P, color="tab:red", alpha=0.06)
    ax.axvspan(HEAD_P, 1, color="tab:green", alpha=0.08)
    ax.set_xlabel("p = π_train(a)")
    ax.set_ylabel("mean |Δ|")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")


def plot_sign(ax, measured: Measurements, summary: dict) -> None:
    """DVP Prop. 4.3: mean Δ of sampled tokens and the fraction with Δ < 0, per decade of π."""
    p, _, d = _sampled(measured)
    idx = _bin_index(p)
    xs, lefts, widths, mean, neg = [], [], [], [], []
    for i, x in enumerate(_bin_centres()):
        sel = idx == i
        if bool(sel.any()):
            xs.append(x)
            lefts.append(10 ** P_BIN_EDGES[i] * 1.05)  # each bar spans its decade, a small gap on both sides
            widths.append(10 ** P_BIN_EDGES[i + 1] * 0.95 - lefts[-1])
            mean.append(float(d[sel].mean()))
            neg.append(float((d[sel] < 0).double().mean()))
    if not xs:
        _no_data(ax, "no sampled tokens")
        return
    ax.bar(lefts, mean, width=widths, align="edge", color=["tab:red" if m < 0 else "tab:blue" for m in mean],
           alpha=0.6)
    ax.axhline(0, color="k", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("p = π_train(sampled token)")
    ax.set_ylabel("mean Δ = log π − log μ")
    twin = ax.twinx()
    twin.plot(xs, neg, color="k", marker=".", label="fraction with Δ < 0")
    twin.set_ylim(0, 1)
    twin.set_ylabel("fraction Δ < 0", fontsize=8)
    twin.legend(fontsize=7, loc="lower right")
    tail = summary.get("sampled_tail") or {}
    note = "" if tail.get("frac_negative") is None else f" — π<1%: {tail['frac_negative']:.0%} negative"
    ax.set_title("sign of Δ on sampled tokens (Prop. 4.3)" + note, fontsize=9)
    ax.grid(alpha=0.3)


def plot_quantiles(ax, measured: Measurements, summary: dict) -> None:
    """Quantiles of log(π/μ) of sampled tokens per decade of π (the ALP quantile envelope)."""
    p, _, d = _sampled(measured)
    idx = _bin_index(p)
    qs = torch.tensor([0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99], dtype=torch.float64)
    xs, rows = [], []
    for i, x in enumerate(_bin_centres()):
        sel = idx == i
        if int(sel.sum()) >= 5:
            xs.append(x)
            rows.append(torch.quantile(d[sel], qs).tolist())
    if not xs:
        _no_data(ax, "too few sampled tokens per bin")
        return
    q = list(zip(*rows))
    ax.fill_between(xs, q[0], q[6], alpha=0.15, color="tab:blue", label="1–99 %")
    ax.fill_between(xs, q[1], q[5], alpha=0.25, color="tab:blue", label="5–95 %")
    ax.fill_between(xs, q[2], q[4], alpha=0.4, color="tab:blue", label="25–75 %")
    ax.plot(xs, q[3], color="k", linewidth=1, label="median")
    ax.axhline(0, color="0.3", linewidth=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("p = π_train(sampled token)")
    ax.set_ylabel("log π − log μ")
    ax.set_title("log-ratio quantile envelope per probability bin", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)


def plot_scatter(ax, measured: Measurements, summary: dict) -> None:
    """π_train against π_infer of sampled tokens, log-log, y = x, Pearson r."""
    p, q, _ = _sampled(measured)
    if p.numel() == 0:
        _no_data(ax, "no sampled tokens")
        return
    ax.scatter(p, q, s=3, alpha=0.3, rasterized=True)
    lo = max(1e-12, float(torch.minimum(p.min(), q.min())))
    ax.plot([lo, 1], [lo, 1], "r--", linewidth=1, label="y = x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("π_train (trainer)")
    ax.set_ylabel("π_infer (rollout engine)")
    r = summary.get("pearson_r")
    ax.set_title("sampled tokens: π_train vs π_infer" + (f" — Pearson r = {r:.4f}" if r is not None else ""), fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def trm_curves(measured: Measurements, deltas: torch.Tensor) -> tuple[list[float], list[float]]:
    """Acceptance of TRM-Max and TRM-Avg at each δ, through :func:`offpolicy.trust_region_mask`."""
    t = measured.tokens
    d_max, d_avg, _ = trm_divergence(t)
    rows = t.mask.any(-1)
    n = max(1, int(rows.sum()))
    acc_max = [float((op.trust_region_mask(d_max, t.mask, max_kl=float(x)).any(-1) & rows).sum()) / n for x in deltas]
    acc_avg = [float((op.trust_region_mask(d_avg, t.mask, avg_kl=float(x)).any(-1) & rows).sum()) / n for x in deltas]
    return acc_max, acc_avg


def plot_trm(ax_delta, ax_len, measured: Measurements, summary: dict) -> None:
    """TRM acceptance against δ, and against length at the recommended max δ with (1 − p)^T."""
    t = measured.tokens
    deltas = torch.logspace(-7, 1, 33, dtype=torch.float64)
    acc_max, acc_avg = trm_curves(measured, deltas)
    rec = summary["recommended"]
    ax_delta.plot(deltas, acc_max, label="TRM-Max (max_t KL ≤ δ)")
    ax_delta.plot(deltas, acc_avg, label="TRM-Avg (mean_t KL ≤ δ)")
    ax_delta.axhline(0.7, color="0.4", linestyle=":", linewidth=1)
    for delta, style, label in ((rec["trm_max"]["max_kl"], "-", "recommended max δ"), (0.05, "--", "paper max 0.05"),
                                (0.001, "-.", "paper avg 0.001")):
        if delta > 0:
            ax_delta.axvline(delta, color="tab:red" if style == "-" else "0.5", linestyle=style, linewidth=1,
                             label=label)
    ax_delta.set_xscale("log")
    ax_delta.set_ylim(-0.02, 1.02)
    ax_delta.set_xlabel("δ")
    ax_delta.set_ylabel("sequences accepted")
    ax_delta.set_title(f"TRM acceptance vs δ ({summary['recommended']['trm_max']['divergence']})", fontsize=9)
    ax_delta.legend(fontsize=6.5, loc="lower right")
    ax_delta.grid(alpha=0.3)
    if ax_len is None:
        return
    d_max, _, _ = trm_divergence(t)
    delta = rec["trm_max"]["max_kl"]
    lengths = t.mask.sum(-1)
    rows = lengths > 0
    violation = float(((d_max > delta) & t.mask).sum()) / max(1, int(t.mask.sum()))
    keep = op.trust_region_mask(d_max, t.mask, max_kl=delta).any(-1)
    edges = torch.unique(torch.quantile(lengths[rows].double(), torch.linspace(0, 1, 7, dtype=torch.float64)).round())
    xs, ys = [], []
    for lo, hi in zip(edges[:-1].tolist() or [float(lengths.max())], edges[1:].tolist() or [float(lengths.max())]):
        sel = rows & (lengths >= lo) & (lengths <= hi)
        if bool(sel.any()):
            xs.append(float(lengths[sel].double().mean()))
            ys.append(float(keep[sel].double().mean()))
    ax_len.plot(xs, ys, marker="o", label=f"accepted at δ = {delta:.3g}")
    grid = torch.linspace(1, max(2, int(lengths.max())), 100)
    ax_len.plot(grid, (1 - violation) ** grid, "k--", linewidth=1, label=f"(1 − p)^T, p = {violation:.2e}")
    ax_len.set_ylim(-0.02, 1.02)
    ax_len.set_xlabel("sequence length T")
    ax_len.set_ylabel("sequences accepted")
    ax_len.set_title("TRM-Max acceptance vs length", fontsize=9)
    ax_len.legend(fontsize=7)
    ax_len.grid(alpha=0.3)


def plot_layers(ax, measured: Measurements, summary: dict) -> None:
    """Relative error at each hooked point with the threshold and the first divergent layer."""
    layers = summary.get("layers")
    if not layers:
        _no_data(ax, "no per-layer data\n(needs the model: offpolicy inspect)")
        ax.set_title("per-layer relative error", fontsize=9)
        return
    names = [x["name"] for x in layers]
    errs = [max(x["rel_error"], 1e-12) for x in layers]
    first = summary.get("first_divergent_layer")
    ax.bar(range(len(names)), errs, color=["tab:red" if n == first else "tab:blue" for n in names])
    for i, x in enumerate(layers):
        if x["rel_error"] == 0:  # an exact match has no height on a log axis: say so
            ax.annotate("0", (i, 1e-12), ha="center", va="bottom", fontsize=8)
    ax.axhline(summary["layer_threshold"], color="k", linestyle="--", linewidth=1, label="threshold")
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=60, fontsize=7)
    ax.set_ylabel("‖h_μ − h_π‖ / ‖h_π‖")
    largest = summary.get("largest_share_layer")
    ax.set_title(f"per-layer relative error — enters at {first}, most added by {largest}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")


def write_figures(measured: Measurements, summary: dict, out_dir: Path) -> dict[str, Path]:
    """Every figure of the module docstring as a PNG in ``out_dir``; returns ``{name: path}``."""
    plt = _plt()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}

    def save(fig, name: str) -> None:
        paths[name] = out_dir / f"{name}.png"
        fig.savefig(paths[name], dpi=110)
        plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    plot_envelope(axes[0], measured, summary)
    plot_error_by_p(axes[1], measured, summary)
    save(fig, "envelope")
    for name, draw in (("prop43_sign", plot_sign), ("quantile_envelope", plot_quantiles), ("scatter", plot_scatter),
                       ("layers", plot_layers)):
        fig, ax = plt.subplots(figsize=(6, 4.2), layout="constrained")
        draw(ax, measured, summary)
        save(fig, name)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    plot_trm(axes[0], axes[1], measured, summary)
    save(fig, "trm_acceptance")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    plot_depth(axes[0], axes[1], summary)
    save(fig, "depth")
    fig, axes = plt.subplots(2, 3, figsize=(16, 9), layout="constrained")
    plot_envelope(axes[0, 0], measured, summary)
    plot_error_by_p(axes[0, 1], measured, summary)
    plot_scatter(axes[0, 2], measured, summary)
    plot_quantiles(axes[1, 0], measured, summary)
    plot_trm(axes[1, 1], None, measured, summary)
    plot_layers(axes[1, 2], measured, summary)
    fig.suptitle(_headline(summary), fontsize=11)
    save(fig, "overview")
    return {name: paths[name] for name in FIGURES if name in paths}


def _headline(summary: dict) -> str:
    meta = summary.get("meta") or {}
    if meta.get("formats"):  # a dump read by diagnose: no engines to name
        kl = summary.get("kl_mean")
        what = f"{'/'.join(sorted(set(meta['formats'])))} dump, {summary.get('positions')} tokens"
        return f"{what}:  mean KL(μ‖π) = {kl:.3g} ({summary.get('kl_source')})" if kl is not None else what
    roll = (meta.get("rollout") or {}).get("description", meta.get("source", "rollout"))
    train = (meta.get("trainer") or {}).get("description", "trainer")
    kl = summary.get("kl_mean")
    return f"rollout {roll}  vs  trainer {train}:  mean KL(μ‖π) = {kl:.3g}" if kl is not None else f"{roll} vs {train}"


# ---------------------------------------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------------------------------------


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
        f"<h1>offpolicy inspect</h1><p>{html.escape(_headline(summary))}</p>",
        _table(["side", "spec", "numerics"], specs) if specs else "",
        "<h2>Mismatch</h2>" + _table(["metric", "value"], key_rows),
        "<h2>Recommended thresholds (re-applied to this data)</h2>"
        + _table(["correction", "threshold", "target", "kept (verified)", "of"], rec_rows),
        "<h2>Each correction at its defaults</h2>"
        + _table(["correction", "setting", "tokens masked", "sequences dropped", "tokens truncated"], preset_rows),
        ("<h2>Per-layer relative error</h2>" + _table(["point", "relative error", "share"], layer_rows))
        if layer_rows else "<h2>Per-layer relative error</h2><p>not measured (no model)</p>",
        "<h2>Mismatch by position in the response</h2>" + _table(*depth_rows(summary)),
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

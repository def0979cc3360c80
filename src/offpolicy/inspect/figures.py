"""The inspection report's figures: each a PNG in the report folder, also embedded in ``report.html`` as base64.

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

import math
from pathlib import Path

import torch

import offpolicy as op
from offpolicy.inspect.depth import plot_depth
from offpolicy.inspect.measurements import HEAD_P, N_P_BINS, P_BIN_EDGES, TAIL_P, Measurements
from offpolicy.inspect.recommend import trm_divergence
from offpolicy.inspect.summary import headline
from offpolicy.lab.plots import pyplot

FIGURES = ("overview", "envelope", "prop43_sign", "quantile_envelope", "scatter", "trm_acceptance", "layers", "depth")


def _bin_index(p: torch.Tensor) -> torch.Tensor:
    """Probability decade of each p (0 … N_P_BINS − 1; p < 1e-12 in the first, p = 1 in the last)."""
    return torch.floor(torch.log10(p.clamp(min=1e-300))).add(N_P_BINS).clamp(0, N_P_BINS - 1).long()


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
    plt = pyplot()
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
    fig.suptitle(headline(summary), fontsize=11)
    save(fig, "overview")
    return {name: paths[name] for name in FIGURES if name in paths}

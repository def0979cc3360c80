"""The lab's figures (matplotlib, headless): curves over seeds per mismatch source, and last-quarter reward per run.

Every curve figure has one panel per mismatch source with the presets overlaid: the mean over seeds as a line and
the min–max over seeds as a band; each non-control panel also shows the control (naive on the fp32 engine, black
dashed) so the eye compares against the no-mismatch run. A preset has the same colour in every figure. Reward, k3 KL
and masked fraction are smoothed per seed by a trailing mean over ``window`` steps (N/20, at least 1) before
averaging; the gradient norm is not smoothed (its spikes are the finding). k3 KL and gradient norm are drawn on log
axes, values below a floor (k3: 1e-10, fp32 rounding; gradient norm: 1e-6) at the floor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from offpolicy.lab.mismatch import CONTROL
from offpolicy.lab.stats import K3_FLOOR, finite, median, series, trailing_mean

PRESET_COLORS = {"naive": "#d62728", "tis": "#ff7f0e", "mis": "#1f77b4", "geo_mask": "#17becf", "icepop": "#8c564b",
                 "opsm": "#e377c2", "trm": "#2ca02c", "dvp": "#bcbd22", "dvp_mis": "#9467bd", "alp": "#393b79",
                 # variants with a controller: the light shade of their preset's colour
                 "naive_lrguard": "#ff9896", "naive_lrstep": "#c49c94", "mis_band": "#9edae5", "trm_adaptive": "#98df8a",
                 "dvp_mis_adaptive": "#c5b0d5",
                 # the stale-rollout methods (M2PO, IPO, score centering) and their variants
                 "m2po": "#7b4173", "m2po_tau0p2": "#a55194", "m2po_areal": "#ce6dbd", "ipo": "#637939",
                 "score_centering": "#8c6d31", "score_centering_reinforce": "#e7ba52",
                 # the binary-KL rollout gates (gated_is): token level, sequence mean
                 "kl_gate": "#3182bd", "kl_gate_seq": "#08519c"}
# no grey here: grey is the control's band
_SPARE = ("#aec7e8", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#dbdb8d")

# (metric key, file stem, title, y label, log axis floor or None, smoothed)
CURVES: tuple[tuple[str, str, str, str, float | None, bool], ...] = (
    ("reward/mean", "reward", "Reward (mean over the batch)", "reward", None, True),
    ("rollout_correction/k3_kl", "k3_kl", "Mismatch: k3 KL(μ‖π_old) per token", "k3 KL, nats/token (log)",
     K3_FLOOR, True),
    ("loss/grad_norm", "grad_norm", "Gradient norm before clipping (not smoothed)", "gradient norm (log)", 1e-6, False),
    ("correction/masked_frac", "masked_frac", "Masked / dropped token fraction", "fraction of tokens", None, True),
)


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the headless Agg backend (a figure is written, never shown in a window)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt: Any, fig: Any, path: str | Path, *, dpi: int = 90, rect: tuple | None = None) -> Path:
    """Lay out (``tight_layout``, within ``rect`` when given), write ``path`` (creating its folder) and close."""
    fig.tight_layout(**({"rect": rect} if rect is not None else {}))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def preset_colors(presets: Sequence[str]) -> dict[str, str]:
    """A fixed colour per preset (known presets keep theirs whatever the plan holds)."""
    spare = iter(_SPARE * 4)
    return {p: PRESET_COLORS.get(p) or next(spare) for p in presets}


def band(runs: Sequence[Sequence[dict[str, Any]]], key: str, window: int = 1,
         floor: float | None = None) -> tuple[list[int], list[float], list[float], list[float]]:
    """``(steps, mean, min, max)`` over seeds at each logged step (seeds missing a step are left out there).

    >>> band([[{"step": 1, "x": 1.0}, {"step": 2, "x": 3.0}], [{"step": 1, "x": 3.0}]], "x")
    ([1, 2], [2.0, 3.0], [1.0, 3.0], [3.0, 3.0])
    """
    by_step: dict[int, list[float]] = {}
    for rows in runs:
        ys = trailing_mean(series(rows, key), window)
        for r, y in zip(rows, ys):
            if math.isfinite(y):
                by_step.setdefault(int(r["step"]), []).append(max(y, floor) if floor is not None else y)
    steps = sorted(by_step)
    return (steps, [sum(by_step[s]) / len(by_step[s]) for s in steps], [min(by_step[s]) for s in steps],
            [max(by_step[s]) for s in steps])


def _window(groups: dict[tuple[str, str], list[list[dict[str, Any]]]]) -> int:
    longest = max((len(rows) for runs in groups.values() for rows in runs), default=1)
    return max(1, round(longest / 20))


def _control_preset(presets: Sequence[str], groups: dict) -> str | None:
    for p in ("naive", *presets):
        if (p, CONTROL) in groups:
            return p
    return None


def _log_bottom(groups: dict, curve: tuple, window: int) -> float | None:
    """The lower edge of a log axis: a third of the smallest value outside the control (None: autoscale).

    The control's k3 is fp32 rounding (≈ 1e-14); drawn to scale it would squeeze the mismatch runs into two of
    twelve decades. It is drawn at the bottom edge instead, and its panel gives its value.
    """
    key, _, _, _, floor, smooth = curve
    lows = [min(band(runs, key, window if smooth else 1, floor)[2], default=math.inf)
            for (p, m), runs in groups.items() if m != CONTROL]
    lows = [x for x in lows if math.isfinite(x) and x > 0]
    return min(lows) / 3 if lows else None


def _panel(ax: Any, groups: dict, presets: Sequence[str], mismatch: str, curve: tuple, colors: dict[str, str],
           window: int, control: str | None, bottom: float | None) -> None:
    key, _, _, ylabel, floor, smooth = curve
    w = window if smooth else 1
    # just above the edge, so a clipped control stays visible as a line
    clip = max(floor or 0.0, 1.15 * (bottom or 0.0)) if floor is not None else None
    below = []
    if control is not None and mismatch != CONTROL:
        steps, mean_, lo, hi = band(groups[(control, CONTROL)], key, w, clip)
        ax.fill_between(steps, lo, hi, color="0.5", alpha=0.12, linewidth=0)
        ax.plot(steps, mean_, color="black", linestyle="--", linewidth=1.1)
        below += band(groups[(control, CONTROL)], key, 1)[3]
    for preset in presets:
        if (preset, mismatch) not in groups:
            continue
        steps, mean_, lo, hi = band(groups[(preset, mismatch)], key, w, clip)
        ax.fill_between(steps, lo, hi, color=colors[preset], alpha=0.18, linewidth=0)
        ax.plot(steps, mean_, color=colors[preset], linewidth=1.4)
        if mismatch == CONTROL:
            below += band(groups[(preset, mismatch)], key, 1)[3]
    if floor is not None:
        ax.set_yscale("log")
        if bottom is not None and clip is not None:
            ax.set_ylim(bottom=bottom)
            raw = [b for b in below if math.isfinite(b)]
            if raw and max(raw) < clip:
                value = "0" if max(raw) == 0 else f"≤ {max(raw):.0e}"
                ax.text(0.02, 0.09, f"control ({CONTROL}): {value}, off the scale",
                        transform=ax.transAxes, fontsize=7, color="0.25", va="bottom",
                        bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none", "pad": 1})
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, which="major")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _legend_handles(presets: Sequence[str], colors: dict[str, str], control: str | None, n_seeds: str) -> tuple:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Any] = [Line2D([], [], color=colors[p], linewidth=2, label=p) for p in presets]
    if control is not None:
        handles.append(Line2D([], [], color="black", linestyle="--", label=f"{control} on '{CONTROL}' (control)"))
    handles.append(Patch(color="0.6", alpha=0.3, label=f"band: min–max over {n_seeds} seeds; line: mean"))
    return tuple(handles)


def _legend_columns(handles: Sequence[Any], width_in: float) -> int:
    """As many legend columns as fit the figure's width (the longest label sets the column width at 8 pt)."""
    longest = max(len(h.get_label()) for h in handles)
    return max(1, min(len(handles), int(width_in // (0.45 + 0.075 * longest))))


def _seed_count(groups: dict) -> str:
    counts = sorted({len(runs) for runs in groups.values()})
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"


def drawn_curves(groups: dict[tuple[str, str], list[list[dict[str, Any]]]]) -> list[tuple]:
    """The :data:`CURVES` worth drawing: the masked fraction only when some run masked something (a panel of zeros
    says nothing the table does not).

    >>> [c[1] for c in drawn_curves({("naive", "none"): [[{"correction/masked_frac": 0.0}]]})]
    ['reward', 'k3_kl', 'grad_norm']
    """
    masked = any((row.get("correction/masked_frac") or 0.0) != 0.0
                 for runs in groups.values() for rows in runs for row in rows)
    return [c for c in CURVES if c[0] != "correction/masked_frac" or masked]


def plot_sweep(groups: dict[tuple[str, str], list[list[dict[str, Any]]]], presets: Sequence[str],
               mismatches: Sequence[str], last_rewards: dict[tuple[str, str], list[float]],
               out_dir: str | Path, seeds: dict[tuple[str, str], list[int]] | None = None) -> list[Path]:
    """Write ``overview.png`` (metrics × mismatch panels), one PNG per curve metric (:func:`drawn_curves`) and
    ``final_reward.png``.

    ``groups``: ``{(preset, mismatch): [rows of each seed]}``; ``last_rewards``: the last-quarter reward of each
    seed per group; ``seeds``: the seed of each of those values, given when the sweep compares seed by seed (the
    paired rule): ``final_reward.png`` then joins each seed's dots across the presets of a mismatch source. Returns
    the written paths, the overview first.
    """
    plt = pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    presets = [p for p in presets if any((p, m) in groups for m in mismatches)]
    mismatches = [m for m in mismatches if any((p, m) in groups for p in presets)]
    colors = preset_colors(presets)
    window = _window(groups)
    control = _control_preset(presets, groups)
    handles = _legend_handles(presets, colors, control, _seed_count(groups))
    curves = drawn_curves(groups)
    smoothed = ", ".join(c[1].replace("_", " ") for c in curves if c[5])  # reward, k3 kl[, masked frac]
    smooth_note = f"{smoothed}: trailing mean over {window} steps" if window > 1 else ""
    written = []

    ncols = len(mismatches)
    fig, axes = plt.subplots(len(curves), ncols, figsize=(3.6 * ncols + 0.6, 2.7 * len(curves) + 1.0),
                             squeeze=False, sharex=True)
    bottoms = {c[0]: _log_bottom(groups, c, window) if c[4] is not None else None for c in curves}
    for i, curve in enumerate(curves):
        for j, m in enumerate(mismatches):
            _panel(axes[i][j], groups, presets, m, curve, colors, window, control, bottoms[curve[0]])
            axes[i][j].set_title(f"{curve[2].split(' (')[0]} — {m}", fontsize=9)
            if j:
                axes[i][j].set_ylabel("")
        _share_y(axes[i])
    for ax in axes[-1]:
        ax.set_xlabel("step")
    ncol = _legend_columns(handles, fig.get_figwidth())
    fig.legend(handles=handles, loc="upper center", ncol=ncol, fontsize=8, frameon=False)
    fig.text(0.5, 0.003, smooth_note, ha="center", va="bottom", fontsize=7, color="0.35")
    top = 0.1 + 0.2 * math.ceil(len(handles) / ncol)  # inches the legend's rows take
    written.append(save_figure(plt, fig, out / "overview.png",
                               rect=(0, 0.2 / fig.get_figheight(), 1, 1 - top / fig.get_figheight())))

    for curve in curves:
        ncols_c = min(len(mismatches), 3)
        nrows = math.ceil(len(mismatches) / ncols_c)
        fig, axes = plt.subplots(nrows, ncols_c, figsize=(4.4 * ncols_c, 3.2 * nrows + 0.8), squeeze=False,
                                 sharex=True)
        flat = [ax for row in axes for ax in row]
        for ax, m in zip(flat, mismatches):
            _panel(ax, groups, presets, m, curve, colors, window, control, bottoms[curve[0]])
            ax.set_title(f"mismatch: {m}", fontsize=10)
        for ax in flat[len(mismatches):]:
            ax.set_visible(False)
        for ax in flat[max(0, len(mismatches) - ncols_c): len(mismatches)]:
            ax.set_xlabel("step")
        _share_y(flat[: len(mismatches)])
        h = fig.get_figheight()
        fig.suptitle(curve[2] + (f"  (trailing mean over {window} steps)" if curve[5] and window > 1 else ""),
                     fontsize=11, y=1 - 0.05 / h, va="top")
        ncol = _legend_columns(handles, fig.get_figwidth())
        fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.3 / h), ncol=ncol, fontsize=8,
                   frameon=False)
        written.append(save_figure(plt, fig, out / f"{curve[1]}.png",
                                   rect=(0, 0, 1, 1 - (0.4 + 0.2 * math.ceil(len(handles) / ncol)) / h)))

    written.append(_final_reward(plt, last_rewards, presets, mismatches, colors, out / "final_reward.png", seeds))
    controls = _controls(plt, groups, presets, mismatches, colors, out / "controls.png")
    pairs = _variant_pairs(plt, groups, presets, mismatches, colors, window, out / "variants.png")
    return written + [p for p in (controls, pairs) if p is not None]


# what each closed-loop controller logs (offpolicy.train.control), with the fixed threshold it starts from
CONTROL_TITLES = {"control/trm_max_kl": "TRM-Max δ", "control/trm_avg_kl": "TRM-Avg δ",
                  "control/is_upper": "IS band, upper", "control/is_lower": "IS band, lower",
                  "control/lr": "learning rate"}


def _controls(plt: Any, groups: dict[tuple[str, str], list[list[dict[str, Any]]]], presets: Sequence[str],
              mismatches: Sequence[str], colors: dict[str, str], path: Path) -> Path | None:
    """The thresholds the closed-loop controllers chose at each step, one panel per logged ``control/*`` key (mean
    and min–max over seeds per preset × mismatch, log axis); ``None`` when no run has a controller."""
    keys = sorted({k for runs in groups.values() for rows in runs for r in rows for k in r if k.startswith("control/")})
    if not keys:
        return None
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for m in mismatches:
            for p in presets:
                runs = groups.get((p, m))
                if not runs or not any(key in r for rows in runs for r in rows):
                    continue
                steps, mean_, lo, hi = band(runs, key)
                style = "--" if m == CONTROL else "-"
                ax.fill_between(steps, lo, hi, color=colors[p], alpha=0.18, linewidth=0)
                ax.plot(steps, mean_, color=colors[p], linestyle=style, linewidth=1.4, label=f"{p} · {m}")
        ax.set_yscale("log")
        ax.set_title(CONTROL_TITLES.get(key, key), fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3, which="major")
        ax.legend(fontsize=7, frameon=False, loc="best")
    fig.suptitle("Closed-loop control: the threshold used at each step (line: mean over seeds; band: min–max)",
                 fontsize=10)
    return save_figure(plt, fig, path)


def _variant_pairs(plt: Any, groups: dict[tuple[str, str], list[list[dict[str, Any]]]], presets: Sequence[str],
                   mismatches: Sequence[str], colors: dict[str, str], window: int, path: Path) -> Path | None:
    """Each variant (a preset with a controller, :data:`offpolicy.lab.settings.VARIANTS`) beside its preset: the
    reward of every seed as its own line (a band would hide which seed fell), one panel per pair and mismatch
    source; ``None`` when the sweep has no such pair."""
    from offpolicy.lab.settings import VARIANTS

    panels = [(variant, VARIANTS[variant][0], m) for variant in presets if variant in VARIANTS
              for m in mismatches if m != CONTROL and (variant, m) in groups and (VARIANTS[variant][0], m) in groups]
    if not panels:
        return None
    ncols = min(len(panels), 3)
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.4 * ncols, 3.0 * nrows + 0.6), squeeze=False, sharey=True)
    flat = [ax for row in axes for ax in row]
    for ax, (variant, preset, m) in zip(flat, panels):
        for name in (preset, variant):
            for i, rows in enumerate(groups[(name, m)]):
                ys = trailing_mean(series(rows, "reward/mean"), window)
                ax.plot([r["step"] for r in rows], ys, color=colors[name], linewidth=1.1, alpha=0.9,
                        label=name if i == 0 else None)
        ax.set_title(f"{variant} vs {preset} — {m}", fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, frameon=False, loc="lower right")
    for ax in flat[len(panels):]:
        ax.set_visible(False)
    for row in axes:
        row[0].set_ylabel("reward")
    smooth = f", trailing mean over {window} steps" if window > 1 else ""
    fig.suptitle(f"Each controller beside its fixed-threshold preset: reward, one line per seed{smooth}", fontsize=10)
    return save_figure(plt, fig, path)


def _share_y(axes: Sequence[Any]) -> None:
    """The same y range on every panel of a row (mismatch panels are compared by eye)."""
    lows, highs = zip(*(ax.get_ylim() for ax in axes))
    for ax in axes:
        ax.set_ylim(min(lows), max(highs))


def _final_reward(plt: Any, last_rewards: dict[tuple[str, str], list[float]], presets: Sequence[str],
                  mismatches: Sequence[str], colors: dict[str, str], path: Path,
                  seeds: dict[tuple[str, str], list[int]] | None = None) -> Path:
    """Each seed's last-quarter reward as a dot, the median as a bar, presets side by side per mismatch source; with
    ``seeds`` (the paired rule) a grey line joins each seed's dots within a mismatch source."""
    fig, ax = plt.subplots(figsize=(max(5.0, 1.0 + 0.45 * len(presets) * len(mismatches)), 3.8))
    width = 0.8 / max(1, len(presets))
    for j, m in enumerate(mismatches):
        by_seed: dict[int, list[tuple[float, float]]] = {}  # seed → its (x, reward) in preset order
        for i, p in enumerate(presets):
            x = j + (i - (len(presets) - 1) / 2) * width
            if seeds is not None:
                for seed, y in zip(seeds.get((p, m), []), last_rewards.get((p, m), [])):
                    if y is not None and math.isfinite(y):
                        by_seed.setdefault(seed, []).append((x, y))
            ys = finite(last_rewards.get((p, m), []))
            if not ys:
                continue
            ax.scatter([x] * len(ys), ys, color=colors[p], s=18, zorder=3)
            med = median(ys)
            ax.hlines(med, x - width * 0.4, x + width * 0.4, color=colors[p], linewidth=2.5, zorder=2)
        for points in by_seed.values():
            if len(points) > 1:
                ax.plot([x for x, _ in points], [y for _, y in points], color="0.6", linewidth=0.8, zorder=1)
        if j:
            ax.axvline(j - 0.5, color="0.85", linewidth=0.8)
    ax.set_xticks(range(len(mismatches)), [f"{m}" + (" (control)" if m == CONTROL else "") for m in mismatches])
    ax.set_xlabel("mismatch source")
    ax.set_ylabel("reward, mean over the last quarter")
    ax.set_title("Last-quarter reward per run (dots: seeds; bar: median)" if seeds is None else
                 "Last-quarter reward per seed (lines join a seed; bar: median)", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    from matplotlib.lines import Line2D

    ax.legend(handles=[Line2D([], [], color=colors[p], marker="o", linestyle="", label=p) for p in presets],
              fontsize=8, loc="best", frameon=False)
    return save_figure(plt, fig, path)

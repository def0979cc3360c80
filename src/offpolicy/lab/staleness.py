"""The staleness verdict of a lab sweep over lagging engines (setting ``stale``): per method and lag, the numbers as
median [min–max] over seeds, the largest lag whose last-quarter reward stays within noise of the fp32 on-policy
control, and a figure of final reward and worst drawdown against the lag.

"Within noise" is the lab's rule (:func:`offpolicy.lab.stats.compare`): the min–max ranges over seeds of the group's
and the control's last-quarter rewards overlap; with n and m seeds, two identical methods fail to overlap by chance
with probability 2 / C(n + m, n) (3 vs 3: 10 %). The control is ``naive`` on the ``none`` engine (μ = π_old).

    offpolicy lab --setting stale --out DIR --jobs 2
    python -m offpolicy.lab.staleness --evaluate DIR        # the trainer's final reward per run → eval.json
    python -m offpolicy.lab.staleness DIR docs/lab          # → staleness_table.md, staleness.png
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from offpolicy.lab.mismatch import CONTROL, mismatch_settings
from offpolicy.lab.stats import compare, mean, run_stats, series, spread
from offpolicy.lab.tables import fmt_spread

# per-run numbers of the table: (key, header, format)
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("final_eval", "trainer's final reward (eval)", "{:.3f}"),
    ("reward_first", "reward first ¼", "{:.3f}"),
    ("reward_last", "reward last ¼", "{:.3f}"),
    ("reward_drawdown", "worst drawdown", "{:.2f}"),
    ("grad_norm_max", "‖∇‖ max", "{:.3g}"),
    ("k3_median", "k3 KL median", "{:.2e}"),
    ("masked_frac_mean", "masked", "{:.3f}"),
    ("drift_tv", "drift ½‖q−p‖₁", "{:.3f}"),
    ("topk_gap_tv", "top-20 gap ½‖q−q̂‖₁", "{:.1e}"),
)


def lag_of(mismatch: str) -> int:
    """The engine's sync period in steps (1 for the control: synced every step).

    >>> lag_of("lag16"), lag_of("none"), lag_of("lag1")
    (16, 1, 2)
    """
    return int(mismatch_settings(mismatch)["rollout.sync_every"])


def lag_label(mismatch: str) -> str:
    """``"lag16"`` → ``"16"``; the control ``"0 (fp32)"``.

    >>> lag_label("lag4"), lag_label("none")
    ('4', '0 (fp32)')
    """
    m = re.fullmatch(r"lag(\d+)", mismatch)
    return m.group(1) if m else ("0 (fp32)" if mismatch == CONTROL else mismatch)


def group_numbers(rows_per_seed: Sequence[Sequence[dict[str, Any]]],
                  evals: Sequence[float | None] | None = None) -> dict[str, dict[str, Any]]:
    """Every :data:`COLUMNS` number of one preset × mismatch as :func:`~offpolicy.lab.stats.spread` over seeds; the
    score-centering drift and top-k gap are each run's mean over steps (absent — the gap on a server engine, which
    reports only q's head — : n = 0), ``final_eval`` the trainer's evaluated reward (:func:`evaluate_run`; absent: n = 0)."""
    per_seed = []
    for i, rows in enumerate(rows_per_seed):
        s = run_stats(rows)
        s["final_eval"] = evals[i] if evals is not None else None
        for key in ("drift_tv", "topk_gap_tv"):  # a run that did not log one (no preset, no full q) has no number
            s[key] = mean(series(rows, f"score_centering/{key}"))
        per_seed.append(s)
    return {key: spread([s[key] for s in per_seed]) for key, _, _ in COLUMNS}


def largest_lag_within_noise(verdicts: dict[str, dict[str, Any]], *, or_higher: bool = False) -> str | None:
    """The largest lag (by sync period) whose verdict against the control is *within noise* while every smaller lag's
    is too — where the method has not yet broken; None when even the smallest lag is separated. ``or_higher``: a lag
    separated *above* the control counts as holding too (the method is not below the control there). Missing lags
    are skipped.

    >>> largest_lag_within_noise({"lag1": {"within_noise": True}, "lag4": {"within_noise": True},
    ...                           "lag16": {"within_noise": False}, "lag64": {"within_noise": True}})
    'lag4'
    >>> above = {"lag1": {"within_noise": False, "verdict": "higher"}, "lag4": {"within_noise": True}}
    >>> largest_lag_within_noise(above), largest_lag_within_noise(above, or_higher=True)
    (None, 'lag4')
    """
    best = None
    for mismatch in sorted(verdicts, key=lag_of):
        v = verdicts[mismatch]
        if not (v.get("within_noise") or (or_higher and v.get("verdict") == "higher")):
            break
        best = mismatch
    return best


def staleness_report(out: str | Path) -> dict[str, Any]:
    """Numbers, verdicts and the largest lag within noise per preset, from a sweep folder (``summary.json`` and each
    run's ``metrics.jsonl``). Only complete groups (all of the plan's seeds finished) are reported."""
    from offpolicy.lab.stats import load_sweep

    summary, rows = load_sweep(out)
    runs = [r for r in summary["runs"] if rows.get(r["dir"])]
    n_seeds = len(summary["plan"]["seeds"]) if "plan" in summary else max(r["seed"] for r in runs) + 1
    groups: dict[tuple[str, str], list[list[dict[str, Any]]]] = {}
    evals: dict[tuple[str, str], list[float | None]] = {}
    for r in runs:
        if len(rows[r["dir"]]) == r.get("steps", len(rows[r["dir"]])):
            groups.setdefault((r["preset"], r["mismatch"]), []).append(rows[r["dir"]])
            path = Path(out) / r["dir"] / EVAL_FILE
            evals.setdefault((r["preset"], r["mismatch"]), []).append(
                json.loads(path.read_text())["reward"] if path.is_file() else None)
    groups = {k: v for k, v in groups.items() if len(v) >= min(n_seeds, 3)}
    control = [run_stats(x)["reward_last"] for x in groups.get(("naive", CONTROL), [])]
    control_eval = evals.get(("naive", CONTROL), [])
    presets = list(dict.fromkeys(p for p, _ in groups))
    mismatches = sorted({m for _, m in groups}, key=lag_of)
    table: dict[str, dict[str, Any]] = {}
    for (preset, mismatch), per_seed in groups.items():
        entry = {"numbers": group_numbers(per_seed, evals[(preset, mismatch)]), "seeds": len(per_seed)}
        if mismatch != CONTROL or preset != "naive":
            entry["vs_control"] = compare([run_stats(x)["reward_last"] for x in per_seed], control, "naive, none")
            entry["eval_vs_control"] = compare(evals[(preset, mismatch)], control_eval, "naive, none")
        table[f"{preset}|{mismatch}"] = entry
    largest: dict[str, dict[str, str | None]] = {name: {} for name in (
        "largest_within_noise", "largest_within_noise_eval", "largest_not_below", "largest_not_below_eval")}
    for preset in presets:
        for key, suffix in (("vs_control", ""), ("eval_vs_control", "_eval")):
            verdicts = {m: table[f"{preset}|{m}"][key] for m in mismatches if m != CONTROL and f"{preset}|{m}" in table}
            largest["largest_within_noise" + suffix][preset] = largest_lag_within_noise(verdicts) if verdicts else None
            largest["largest_not_below" + suffix][preset] = \
                largest_lag_within_noise(verdicts, or_higher=True) if verdicts else None
    return {"presets": presets, "mismatches": mismatches, "table": table, **largest,
            "steps": summary["plan"]["steps"] if "plan" in summary else None}


def markdown_table(report: dict[str, Any]) -> str:
    """The report's table as markdown: one row per preset × lag, then the verdict columns."""
    head = ["preset", "lag (steps)", "seeds", *[h for _, h, _ in COLUMNS], "eval vs control", "last ¼ vs control"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for preset in report["presets"]:
        for mismatch in report["mismatches"]:
            entry = report["table"].get(f"{preset}|{mismatch}")
            if entry is None:
                continue
            cells = [fmt_spread(entry["numbers"][k], fmt) for k, _, fmt in COLUMNS]
            verdicts = [_verdict(entry.get("eval_vs_control")), _verdict(entry.get("vs_control"))]
            lines.append("| " + " | ".join([preset, lag_label(mismatch), str(entry["seeds"]), *cells, *verdicts]) + " |")
    return "\n".join(lines)


def verdict_table(report: dict[str, Any]) -> str:
    """Per preset, the largest lag that holds against the control: within noise, and within noise or above it (a
    separation upwards is not a break), for the trainer's evaluated reward and the lab's last-quarter reward."""
    lines = ["| method | within noise: final reward (eval) | within noise: last ¼ | not below: final reward (eval) "
             "| not below: last ¼ |", "|---|---|---|---|---|"]
    for p in report["presets"]:
        cells = [report[k][p] or "none" for k in ("largest_within_noise_eval", "largest_within_noise",
                                                   "largest_not_below_eval", "largest_not_below")]
        lines.append("| " + " | ".join([p, *cells]) + " |")
    return "Largest lag that holds against the fp32 on-policy control (every smaller lag holding too):\n\n" + \
        "\n".join(lines)


def _verdict(v: dict[str, Any] | None) -> str:
    if v is None:
        return "(control)"
    return f"{v['diff']:+.3f} {v['verdict']}" if v["diff"] is not None else v["verdict"]


# The figure's two panels: the five methods, then the variants beside their base method (naive as the reference)
MAIN_PRESETS = ("naive", "tis", "m2po", "ipo", "score_centering")
VARIANT_PRESETS = ("naive", "m2po", "m2po_tau0p2", "m2po_areal", "score_centering", "score_centering_reinforce")
# the rollout gates on the same engines: the ratio masks and the binary-KL gates (gated_is), naive as the reference
GATE_PRESETS = ("naive", "tis", "mis", "icepop", "kl_gate", "kl_gate_seq")


def plot_staleness(report: dict[str, Any], path: str | Path, presets: Sequence[str] | None = None) -> Path:
    """Two panels against the lag (log axis, sync period in steps): last-quarter reward and worst drawdown, median
    over seeds with min–max bars, one line per preset (``presets``: only these, in the report's order); the control's
    range as a grey band."""
    from offpolicy.lab.plots import preset_colors, pyplot, save_figure

    plt = pyplot()

    colors = preset_colors(report["presets"])
    shown = [p for p in report["presets"] if presets is None or p in presets]
    lags = [m for m in report["mismatches"] if m != CONTROL]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    control = report["table"].get(f"naive|{CONTROL}")
    final = "final_eval" if any(e["numbers"]["final_eval"]["n"] for e in report["table"].values()) else "reward_last"
    final_title = "Trainer's final reward (evaluated, synced fp32 engine)" if final == "final_eval" else \
        "Reward, last quarter of the run"
    for ax, key, title in ((axes[0], final, final_title),
                           (axes[1], "reward_drawdown", "Worst drawdown of the 3-step mean reward")):
        if control is not None and control["numbers"][key]["n"]:
            c = control["numbers"][key]
            ax.axhspan(c["min"], c["max"], color="0.85", label="control (naive, fp32 engine): min–max")
        for i, preset in enumerate(shown):
            pts = [(lag_of(m) * (1 + 0.04 * (i - len(shown) / 2)), report["table"][f"{preset}|{m}"]["numbers"][key]) for m in lags
                   if f"{preset}|{m}" in report["table"]]
            pts = [(x, s) for x, s in pts if s["n"]]
            if not pts:
                continue
            xs = [x for x, _ in pts]
            med = [s["median"] for _, s in pts]
            err = [[s["median"] - s["min"] for _, s in pts], [s["max"] - s["median"] for _, s in pts]]
            ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, color=colors[preset], label=preset)
        ax.set_xscale("log", base=2)
        ax.set_xticks([lag_of(m) for m in lags], [f"{lag_label(m)}\n(sync /{lag_of(m)})" for m in lags])
        ax.set_xlabel("engine lag: sync period in steps (4 optimiser updates per step)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("reward (median over seeds, min–max bars)")
    axes[1].set_ylabel("drawdown (reward units)")
    axes[0].legend(fontsize=8, loc="lower left")
    return save_figure(plt, fig, path)


EVAL_SEED = 1_000_003  # the evaluation prompts: the same for every run, drawn from no training step's seed
EVAL_FILE = "eval.json"


def evaluate_run(run_dir: str | Path, *, prompts: int = 8, seed: int = EVAL_SEED) -> dict[str, float]:
    """The reward of a finished run's *trainer* weights (its latest checkpoint), sampled by a synced fp32 engine on
    ``prompts`` fixed prompts × the run's group size; written to ``run_dir/eval.json`` and returned.

    Why: the lab's reward is the rollout engine's, and a lagging engine samples with old weights — with ``lag64`` in
    a 20-step run every rollout comes from the initial policy, so the logged reward says nothing about what the
    trainer learned. This measures the trainer itself, on the same prompts for every run.
    """
    import json

    from offpolicy.train.build import step_seed
    from offpolicy.train.checkpoint import latest_checkpoint, load_checkpoint
    from offpolicy.train.config import load_config
    from offpolicy.train.steps import build_state, rollout_step

    run = Path(run_dir)
    checkpoint = latest_checkpoint(run / "checkpoints")
    if checkpoint is None:
        raise ValueError(f"{str(run)!r} has no checkpoint to evaluate")
    cfg = load_config(run / "config.yaml", [f"task.prompts_per_step={prompts}", "rollout.dtype=float32",
                                            "rollout.kv_cache_bits=null", "rollout.weight_bits=null",
                                            "rollout.logit_noise=0.0", "rollout.sync_every=1",
                                            "rollout.sampler=multinomial"])
    state = build_state(cfg)
    info = load_checkpoint(checkpoint, model=state.model, restore_rng=False)
    rollout = rollout_step(state, step_seed(seed, 0), sync_weights=True)
    result = {"step": float(info["step"]), "reward": float(rollout.rewards.mean()), "samples": float(rollout.rewards.numel())}
    (run / EVAL_FILE).write_text(json.dumps(result) + "\n")
    return result


def topk_gap_table(trainer_logits: Any, sampler_logits: Any, mask: Any, ks: Sequence[int], *,
                   temperature: float = 1.0) -> list[dict[str, float]]:
    """What the top-k proportional tail costs against exact score centering, over the valid positions of ``[B, T, V]``
    logits: per k, the mean drift ½‖q − p‖₁ (the term centering removes), the mean error ½‖q − q̂‖₁ of the top-k
    centring's logit gradient, their ratio (the error relative to the drift), the largest per-position error, and the
    sampler mass outside the head, 1 − m_q.

    >>> import torch
    >>> p = torch.tensor([[[0.5, 0.3, 0.2]]]).log(); q = torch.tensor([[[0.4, 0.1, 0.5]]]).log()
    >>> topk_gap_table(p, q, torch.ones(1, 1, dtype=torch.bool), [1])[0]["gap_mean"]  # q̂ = (0.3125, 0.1875, 0.5)
    0.0875
    """
    import torch

    from offpolicy.objectives.score_centering import topk_tail_gap

    m = torch.as_tensor(mask).bool()
    out = []
    for k in ks:
        drift, gap, head_mass = topk_tail_gap(trainer_logits, sampler_logits, k, temperature=temperature)
        tail = 1.0 - head_mass
        d, g = drift[m], gap[m]
        row = {"drift_mean": d.mean(), "gap_mean": g.mean(), "gap_over_drift": g.sum() / d.sum().clamp(min=1e-30),
               "gap_max": g.max(), "tail_mass_mean": tail[m].clamp(min=0).mean()}
        out.append({"k": k, **{name: float(f"{float(v):.4g}") for name, v in row.items()}})
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m offpolicy.lab.staleness SWEEP_DIR DOCS_DIR``: write ``staleness_table.md`` and ``staleness.png``
    (and ``staleness_variants.png`` / ``staleness_gates.png`` when the sweep has those presets)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--evaluate"]:  # evaluate every finished run that has no eval.json yet
        from offpolicy.lab.stats import load_sweep

        summary, _ = load_sweep(args[1])
        for r in summary["runs"]:
            if not (Path(args[1]) / r["dir"] / EVAL_FILE).is_file():
                print(r["dir"], evaluate_run(Path(args[1]) / r["dir"]), flush=True)
        return
    if len(args) != 2:
        raise SystemExit("usage: python -m offpolicy.lab.staleness [--evaluate] SWEEP_DIR [OUT_DIR]")
    report = staleness_report(args[0])
    out = Path(args[1])
    out.mkdir(parents=True, exist_ok=True)
    text = markdown_table(report) + "\n\n" + verdict_table(report)
    (out / "staleness_table.md").write_text(text + "\n")
    plot_staleness(report, out / "staleness.png", MAIN_PRESETS)
    for name, shown in (("staleness_variants", VARIANT_PRESETS), ("staleness_gates", GATE_PRESETS)):
        if any(p in shown and p not in MAIN_PRESETS for p in report["presets"]):
            plot_staleness(report, out / f"{name}.png", shown)
    print(text)


if __name__ == "__main__":
    main()

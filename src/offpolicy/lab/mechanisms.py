"""Mechanism experiments of the lab: one rollout batch, several off-policy updates, the log-ratio per probability bin.

The ALP paper's Fig. 2 (arXiv 2603.19470 §3) shows *where* the training–inference log-ratio log π_θ − log μ spreads
when a policy is updated on samples of an engine that disagrees with it: per bin of the sampled token's probability,
the quantile envelope after each update. This module reproduces that experiment for any presets of the trainer: from
one checkpoint (the lab model) and one rollout batch of a mismatching engine, ``updates`` optimiser steps on the
same batch (each one more update off-policy), the envelope measured before the first and after every update — with
the preset's own scoring (DVP's constrained log-probs for DVP presets), without ALP's noise (π_θ, not π_{θ,σ}).

Deterministic: the same rollout batch for every preset (same weights, same engine, same seed), the same update
order. The other two mechanism figures of the lab — the sign of Δ on sampled tail tokens (DVP Prop. 4.3) and TRM
acceptance against length beside (1 − p)^T — come from ``offpolicy inspect`` on the same model and engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from offpolicy.lab.plots import pyplot, save_figure

# Bins of the sampled token's probability under μ: decades from 1e-6 up, the last one [0.1, 1].
BIN_EDGES = (0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0 + 1e-9)
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def bin_labels() -> list[str]:
    """Human labels of :data:`BIN_EDGES` (``"<1e-06"``, ``"1e-06–1e-05"``, …, ``"0.1–1"``).

    >>> bin_labels()[0], bin_labels()[-1]
    ('<1e-06', '0.1–1')
    """
    labels = [f"<{BIN_EDGES[1]:.0e}"]
    for lo, hi in zip(BIN_EDGES[1:-1], BIN_EDGES[2:]):
        labels.append(f"{lo:.0e}–{hi:.0e}" if hi < 0.5 else f"{lo:g}–1")
    return labels


def binned_quantiles(log_ratio: Tensor, prob: Tensor, mask: Tensor) -> dict[str, list[Any]]:
    """Per probability bin of ``prob``: the :data:`QUANTILES` of ``log_ratio`` over valid tokens, and the count.

    ``log_ratio``, ``prob``, ``mask``: ``[B, T]``. A bin without tokens has ``None`` quantiles.

    >>> lr = torch.tensor([[0.0, 1.0, -1.0, 2.0]])
    >>> p = torch.tensor([[0.5, 0.5, 1e-3, 0.9]])
    >>> out = binned_quantiles(lr, p, torch.ones(1, 4, dtype=torch.bool))
    >>> out["count"][-1], out["quantiles"][-1][2]   # bin [0.1, 1]: log-ratios (0, 1, 2), median 1
    (3, 1.0)
    >>> out["count"][4], out["quantiles"][4][2]      # bin [1e-3, 1e-2): one token
    (1, -1.0)
    """
    valid = mask.bool() & torch.isfinite(log_ratio)
    x, p = log_ratio[valid].double(), prob[valid].double()
    edges = torch.tensor(BIN_EDGES, dtype=torch.float64)
    which = torch.bucketize(p, edges, right=True) - 1
    q = torch.tensor(QUANTILES, dtype=torch.float64)
    quantiles: list[list[float] | None] = []
    counts: list[int] = []
    for b in range(len(BIN_EDGES) - 1):
        sel = x[which == b]
        counts.append(int(sel.numel()))
        quantiles.append([float(v) for v in torch.quantile(sel, q)] if sel.numel() else None)
    return {"quantiles": quantiles, "count": counts}


def update_envelopes(overrides: Sequence[str], presets: Sequence[str] | Mapping[str, Sequence[str]], *,
                     updates: int = 8, seed: int = 0,
                     out_dir: str | Path | None = None, task: Any = None,
                     checkpoint: str | Path | None = None) -> dict[str, Any]:
    """Run the experiment for each preset; returns ``{"bins": labels, "quantiles": QUANTILES, "presets": {preset:
    {"envelopes": [binned_quantiles after 0 … updates updates], "tail_spread": [...], "head_spread": [...]}}}``.

    ``overrides``: trainer ``key=value`` overrides shared by all presets (model, task, engine, learning rate); each
    preset runs with ``optim.minibatches=1`` (one optimiser step per update). ``presets``: preset names, or a mapping
    label → extra overrides (``{"bypass": ["algorithm.preset=naive", "algorithm.objective=bypass"]}``) for
    variants. ``tail_spread`` / ``head_spread``: the
    width between the 5 % and 95 % quantiles of the log-ratio over tokens with μ-probability below 1e-2 / in
    [0.1, 1], after each update — the two numbers the figure shows at a glance. ``checkpoint``: a trainer
    checkpoint (``.safetensors`` of a run's ``checkpoints/``) to start from instead of the config's model (the
    paper starts from a trained checkpoint); with a lagging mismatch source (``rollout.sync_every > 1``) the engine
    samples with the config's model, not the checkpoint (the batch is as old as the checkpoint's updates); ``task``
    replaces the config's (tests).
    """
    from offpolicy.train.build import DTYPES
    from offpolicy.train.checkpoint import load_checkpoint
    from offpolicy.train.config import load_config
    from offpolicy.train.presets import PRESETS
    from offpolicy.train.scoring import score_policy
    from offpolicy.train.steps import build_state, rollout_step, score_step
    from offpolicy.train.update import update_step

    if isinstance(updates, bool) or not isinstance(updates, int) or updates < 1:
        raise ValueError(f"updates must be an int >= 1, got {updates!r}")
    out_dir = Path(out_dir) if out_dir is not None else Path("offpolicy-mechanisms")
    results: dict[str, Any] = {"bins": bin_labels(), "quantiles": list(QUANTILES), "presets": {}}
    runs = dict(presets) if isinstance(presets, Mapping) else {
        p: [f"algorithm.preset={p}", *(["alp.enabled=true"] if p in PRESETS and PRESETS[p].alp else [])] for p in presets}
    for preset, extra in runs.items():
        cfg = load_config(None, [*overrides, *extra, "optim.minibatches=1", "optim.epochs=1",
                                 f"run.out_dir={out_dir / preset}"])
        torch.manual_seed(seed)
        state = build_state(cfg, task=task)
        if checkpoint is not None:
            load_checkpoint(checkpoint, model=state.model, restore_rng=False)  # the engine copies them at the rollout
        # with a lagging engine (rollout.sync_every > 1) the engine keeps the weights it was built with — the config's
        # model — while π_old is the checkpoint: a batch sampled some updates ago, as in an asynchronous pipeline
        rollout = rollout_step(state, seed, sync_weights=cfg.rollout.sync_every == 1)
        scored = score_step(state, rollout)
        mu, mask = scored.rollout_logp, scored.mask
        dvp_rho = cfg.algorithm.dvp_rho if state.preset.minp else None
        envelopes, tail, head = [], [], []
        for k in range(updates + 1):
            with torch.no_grad():
                logp, _, _, _ = score_policy(state.model, rollout.prompt_ids, rollout.completions, state.sampling,
                                             dtype=DTYPES[cfg.model.dtype], dvp_rho=dvp_rho)
            log_ratio = logp - mu
            envelopes.append(binned_quantiles(log_ratio, mu.exp(), mask))
            tail.append(_spread(log_ratio, mu.exp() < 1e-2, mask))
            head.append(_spread(log_ratio, mu.exp() >= 0.1, mask))
            if k < updates:
                update_step(state, rollout, scored, seed + 1 + k)
        results["presets"][preset] = {"envelopes": envelopes, "tail_spread": tail, "head_spread": head}
    return results


def _spread(log_ratio: Tensor, where: Tensor, mask: Tensor) -> float | None:
    sel = log_ratio[mask.bool() & where & torch.isfinite(log_ratio)].double()
    if sel.numel() < 2:
        return None
    return float(torch.quantile(sel, 0.95) - torch.quantile(sel, 0.05))


def plot_envelopes(results: dict[str, Any], path: str | Path) -> Path:
    """One panel per preset: the 5–95 % band of log π_θ − log μ per μ-probability bin, before the first update
    (light) and after the last (dark), with the medians; the token count per bin under the axis labels."""
    plt = pyplot()
    presets = list(results["presets"])
    labels = results["bins"]
    # only the probability bins that hold tokens (a sharp policy samples nothing below 1e-3)
    used = [i for i in range(len(labels))
            if any(results["presets"][p]["envelopes"][0]["count"][i] for p in presets)]
    cols = min(3, len(presets))
    rows_n = (len(presets) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.4 * cols, 3.2 * rows_n), sharey=True, squeeze=False)
    for ax in axes.flat[len(presets):]:
        ax.axis("off")
    x = list(range(len(used)))
    for ax, preset in zip(axes.flat, presets):
        envelopes = results["presets"][preset]["envelopes"]
        last = len(envelopes) - 1
        for k, color, name in ((0, "#9ecae1", "before"), (last, "#08519c", f"after {last} updates")):
            rows = [envelopes[k]["quantiles"][i] for i in used]
            xs = [j for j in x if rows[j] is not None]
            ax.fill_between(xs, [rows[j][0] for j in xs], [rows[j][-1] for j in xs], color=color,
                            alpha=0.45 if k else 0.6, lw=0, label=f"5–95 %, {name}")
            ax.plot(xs, [rows[j][2] for j in xs], color=color, lw=1.5, marker="o", ms=3)
        counts = envelopes[0]["count"]
        ax.set_xticks(x, [f"{labels[i]}\n(n={counts[i]})" for i in used], fontsize=7)
        ax.axhline(0.0, color="k", lw=0.5)
        ax.set_title(preset, fontsize=10)
        ax.set_xlabel("μ(sampled token)", fontsize=8)
    for row in axes:
        row[0].set_ylabel("log π_θ − log μ", fontsize=9)
    axes[0][0].legend(fontsize=7, loc="lower left")
    return save_figure(plt, fig, path, dpi=100)



def acceptance_vs_length(token_kl: Tensor, mask: Tensor, delta: float, lengths: Sequence[int]) -> list[dict[str, Any]]:
    """TRM-Max acceptance of answers cut to each length T, beside the i.i.d. prediction (1 − p)^T (arXiv 2512.23075,
    §4: a sequence of T tokens each violating δ with probability p is accepted with probability (1 − p)^T).

    ``token_kl`` ``[B, L]``: per-position KL(μ‖π) of the same sequences; for each T the first T positions of every
    sequence with at least T valid tokens; p = the fraction of all valid tokens with KL > δ.

    >>> kl = torch.tensor([[0.0, 0.2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.3]])   # 2 of 8 tokens violate δ = 0.1: p = 0.25
    >>> rows = acceptance_vs_length(kl, torch.ones(2, 4), 0.1, [1, 2, 4])
    >>> [(r["length"], r["accepted"], round(r["iid"], 4)) for r in rows]  # T=2: the first row violates at t=2
    [(1, 1.0, 0.75), (2, 0.5, 0.5625), (4, 0.0, 0.3164)]
    """
    m = mask.bool()
    kl = token_kl.double()
    valid = m & torch.isfinite(kl)
    p = float(((kl > delta) & valid).sum()) / max(int(valid.sum()), 1)
    n_valid = m.sum(-1)
    out = []
    for length in lengths:
        rows = n_valid >= length
        if not bool(rows.any()):
            continue
        head = torch.where(valid[rows, :length], kl[rows, :length], torch.zeros_like(kl[rows, :length]))
        violated = (head > delta) | ~torch.isfinite(kl[rows, :length]) & m[rows, :length]
        accepted = float((~violated.any(-1)).double().mean())
        out.append({"length": int(length), "accepted": accepted, "iid": (1 - p) ** length, "n": int(rows.sum()),
                    "p": p})
    return out


def plot_acceptance(rows_by_delta: Mapping[float, list[dict[str, Any]]], path: str | Path, title: str) -> Path:
    """Measured TRM-Max acceptance against length (points) beside (1 − p)^T (dashed), one colour per δ."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    for (delta, rows), color in zip(rows_by_delta.items(), ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")):
        ts = [r["length"] for r in rows]
        ax.plot(ts, [r["accepted"] for r in rows], "o-", color=color, ms=4, label=f"measured, δ = {delta:g}")
        ax.plot(ts, [r["iid"] for r in rows], "--", color=color, lw=1, label=f"(1 − p)^T, p = {rows[0]['p']:.2g}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("answer length T (tokens)")
    ax.set_ylabel("sequences accepted by TRM-Max")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    return save_figure(plt, fig, path, dpi=100)

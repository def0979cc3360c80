"""Vocabulary-wide statistics of two sides' logits at the same positions, and DVP's safe sets on a grid of ρ.

:func:`vocabulary_stats` walks row chunks of ``[N, V]`` logits (:func:`offpolicy.kernels.chunk_rows`) and returns the
aggregates of :class:`~offpolicy.inspect.measurements.VocabStats` (|Δ_a| against p_a with DVP Prop. 4.2's envelope)
plus per-position extras (ε_max, top-k overlap and log-probs, DVP's retained mass and membership at every ρ).
:func:`dvp_check` re-applies one ρ through the correction's own kernel (:func:`offpolicy.constrained_logp`).
:func:`offpolicy.inspect.compare.compare_engines` calls them per micro-batch.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

import offpolicy as op
from offpolicy.inspect.measurements import HEAD_P, N_P_BINS, TAIL_P, VocabStats
from offpolicy.kernels import chunk_rows, row_chunks

DEFAULT_MEMORY_BUDGET_BYTES = 2 << 30


def vocabulary_stats(rollout_logits: Tensor, trainer_logits: Tensor, *, temperature: float = 1.0, topk: int = 20,
                     dvp_rhos: tuple[float, ...] = (), targets: Tensor | None = None, scatter_from_pi: int = 2,
                     scatter_uniform: int = 2, generator: torch.Generator | None = None,
                     memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> tuple[VocabStats, dict[str, Tensor]]:
    """Vocabulary-wide aggregates and per-position extras for ``N`` positions of both sides' logits ``[N, V]``.

    Returns ``(stats, extras)``: ``stats`` a :class:`VocabStats` over all N·V (position, token) pairs; ``extras`` holds
    ``[N]`` tensors ``eps_max`` and ``topk_overlap``, ``[N, k]`` tensors ``topk_ids`` (the rollout's top-k),
    ``rollout_topk_logp``, ``trainer_topk_logp`` and, for a non-empty ``dvp_rhos`` grid with ``targets`` [N] (the
    sampled ids), ``[N, G]`` tensors ``dvp_mass``, ``dvp_inside_trainer``, ``dvp_inside_rollout``.

    With ε = z_μ/τ − z_π/τ and ε_max = ½ (max ε − min ε), Δ_a = −ε_a + log E_π[e^ε] (the normalisers' difference,
    summed in float64, so Δ keeps the precision of ε itself). Every pair must satisfy DVP Prop. 4.2 in its corrected
    form |Δ_a| ≤ 2 ε_max (1 − p_a) e^{2 ε_max} (``corrected_violations`` counts failures beyond 1e-6 nats of float32
    rounding: any is a bug, not a finding); the printed 2 ε_max (1 − p_a) can fail.

    DVP's safe set at ρ is {a : z_a ≥ z_max + log ρ} (Def. 5.1), so with d_a = z_max − z_a the retained mass at every ρ
    of the grid is one bucketing of d (checked against :func:`offpolicy.constrained_logp` in the tests).

    >>> z = torch.tensor([[0.0, 0.0]]); zr = torch.tensor([[0.1, -0.1]])   # ε_max = 0.1, p = (½, ½)
    >>> s, x = vocabulary_stats(zr, z, topk=1)
    >>> s.pairs, s.paper_violations, round(x["eps_max"].item(), 4)   # |Δ| = log(½(1 + e^{±0.2})) ≈ 0.1003, 0.0997 vs 0.1
    (2, 1, 0.1)
    """
    n, vocab = trainer_logits.shape
    k = min(topk, vocab)
    stats = VocabStats()
    extras: dict[str, list[Tensor]] = {}
    rows = chunk_rows(n, vocab, buffers=8, itemsize=4, memory_budget_bytes=memory_budget_bytes)
    log_rho = torch.tensor([-math.log(r) for r in dvp_rhos], dtype=torch.float32)  # −log ρ, ascending for e^-k grids
    slack = 1e-6  # float32 rounding of ε (1 ulp of the logits) — far below any mismatch worth reporting
    for a, b in row_chunks(n, rows):
        zr = rollout_logits[a:b].float() / temperature
        zt = trainer_logits[a:b].float() / temperature
        # A row with a non-finite logit (an fp16 overflow) has no envelope: left out of the aggregates, counted, and
        # its per-position extras are NaN (its KL is non-finite too, which the report and the gate flag).
        bad = ~(torch.isfinite(zr).all(-1) & torch.isfinite(zt).all(-1))
        if bool(bad.any()):
            stats.skipped_rows += int(bad.sum())
            zr, zt = zr.masked_fill(bad[:, None], 0.0), zt.masked_fill(bad[:, None], 0.0)
        eps = zr - zt
        eps_max = (eps.amax(-1) - eps.amin(-1)) / 2
        lse_t = zt.logsumexp(-1, keepdim=True)
        lt = zt - lse_t  # log π
        p = lt.exp()
        # log E_π[e^ε] = lse_μ − lse_π, summed in float64 from e^ε − 1 so that it is exact to float32's ε
        shift = (p * torch.expm1(eps)).double().sum(-1, keepdim=True).log1p().float()
        abs_delta = (shift - eps).abs_()  # |Δ| = |log π − log μ|
        bound = 2 * eps_max[:, None] * (-torch.expm1(lt))  # 2 ε_max (1 − p), 1 − p accurate near p = 1
        good = ~bad[:, None]
        stats.paper_violations += int(((abs_delta > bound + slack) & good).sum())
        stats.corrected_violations += int(((abs_delta > bound * torch.exp(2 * eps_max)[:, None] + slack) & good).sum())
        stats.pairs += int(good.sum()) * vocab
        bins = torch.floor(lt / math.log(10)).add_(N_P_BINS).clamp_(0, N_P_BINS - 1).long()[~bad].flatten()
        stats.bin_abs_delta = [s + float(v) for s, v in zip(
            stats.bin_abs_delta, torch.bincount(bins, abs_delta[~bad].flatten().double(), N_P_BINS))]
        stats.bin_count = [s + int(v) for s, v in zip(stats.bin_count, torch.bincount(bins, minlength=N_P_BINS))]
        head, tail = (p > HEAD_P) & good, (p < TAIL_P) & good
        stats.head_abs_delta += float(abs_delta[head].double().sum())
        stats.head_count += int(head.sum())
        stats.tail_abs_delta += float(abs_delta[tail].double().sum())
        stats.tail_count += int(tail.sum())
        picks = [torch.multinomial(p, scatter_from_pi, replacement=True, generator=generator)] if scatter_from_pi else []
        if scatter_uniform:
            picks.append(torch.randint(vocab, (b - a, scatter_uniform), generator=generator))
        if picks:
            ids = torch.cat(picks, dim=1)[~bad]
            stats.scatter_p += p[~bad].gather(1, ids).flatten().tolist()
            stats.scatter_abs_delta += abs_delta[~bad].gather(1, ids).flatten().tolist()
            stats.scatter_eps_max += eps_max[~bad, None].expand_as(ids).flatten().tolist()
        eps_max = eps_max.masked_fill(bad, math.nan)
        ids_r = zr.topk(k, dim=-1).indices
        ids_t = zt.topk(k, dim=-1).indices
        lse_r = zr.logsumexp(-1, keepdim=True)
        got = {
            "eps_max": eps_max,
            "topk_overlap": (ids_r[:, :, None] == ids_t[:, None, :]).any(-1).float().mean(-1),
            "topk_ids": ids_r,
            "rollout_topk_logp": zr.gather(1, ids_r) - lse_r,
            "trainer_topk_logp": lt.gather(1, ids_r),
        }
        if len(dvp_rhos) and targets is not None:
            got.update(_dvp_chunk(zr, zt, p, targets[a:b], log_rho))
        for name, value in got.items():
            extras.setdefault(name, []).append(value)
    out = {name: torch.cat(parts) for name, parts in extras.items()}
    return stats, out


def _dvp_chunk(zr: Tensor, zt: Tensor, p: Tensor, targets: Tensor, neg_log_rho: Tensor) -> dict[str, Tensor]:
    """Retained mass and sampled-token membership of DVP's safe sets at every ρ (``neg_log_rho`` [G] = −log ρ).

    a ∈ V_S(ρ) ⇔ z_a ≥ z_max + log ρ ⇔ d_a = z_max − z_a ≤ −log ρ: mass = Σ_a p_a 1[d_a ≤ −log ρ], one pass per ρ-free
    bucketing (searchsorted on the sorted grid), then a cumulative sum over buckets."""
    order = torch.argsort(neg_log_rho)
    grid = neg_log_rho[order]
    d_t = zt.amax(-1, keepdim=True) - zt
    bucket = torch.searchsorted(grid, d_t.contiguous(), right=False)  # first grid value ≥ d, G if none
    per_bucket = torch.zeros(zt.shape[0], grid.numel() + 1, dtype=torch.float64)
    per_bucket.scatter_add_(1, bucket, p.double())
    mass_sorted = per_bucket.cumsum(-1)[:, :-1].float()
    inv = torch.argsort(order)
    d_target_t = d_t.gather(1, targets[:, None])
    d_target_r = (zr.amax(-1, keepdim=True) - zr).gather(1, targets[:, None])
    return {
        "dvp_mass": mass_sorted[:, inv],
        "dvp_inside_trainer": d_target_t <= neg_log_rho[None, :],
        "dvp_inside_rollout": d_target_r <= neg_log_rho[None, :],
    }


def dvp_check(rollout_logits: Tensor | None, trainer_logits: Tensor, targets: Tensor, rho: float, *,
              temperature: float = 1.0, memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> dict[str, Tensor]:
    """DVP at one ρ through the correction's own kernel (:func:`offpolicy.constrained_logp`) for ``N`` positions:
    ``mass`` [N] (the trainer's retained mass), ``inside_trainer`` / ``inside_rollout`` [N] bool."""
    c = op.constrained_logp(trainer_logits, targets, rho, temperature=temperature,
                            memory_budget_bytes=memory_budget_bytes)
    out = {"mass": c.mass.float(), "inside_trainer": c.inside}
    if rollout_logits is not None:
        out["inside_rollout"] = op.constrained_logp(rollout_logits, targets, rho, temperature=temperature,
                                                    memory_budget_bytes=memory_budget_bytes).inside
    return out


def dvp_grid_from_logits(trainer_logits: Tensor, targets: Tensor, rhos: tuple[float, ...], *,
                         temperature: float = 1.0) -> dict[str, Tensor]:
    """The trainer's side of the DVP grid alone (top-k view: the rollout's safe sets are unknown)."""
    n, vocab = trainer_logits.shape
    out: dict[str, list[Tensor]] = {}
    neg_log_rho = torch.tensor([-math.log(r) for r in rhos], dtype=torch.float32)
    for a, b in row_chunks(n, chunk_rows(n, vocab, buffers=4)):
        zt = trainer_logits[a:b].float() / temperature
        got = _dvp_chunk(zt, zt, torch.softmax(zt, -1), targets[a:b], neg_log_rho)
        got.pop("dvp_inside_rollout")
        for name, v in got.items():
            out.setdefault(name, []).append(v)
    return {name: torch.cat(v) for name, v in out.items()}


def _dvp_summary(choice: dict, checks: list[dict[str, Tensor]], coverage: float) -> dict:
    """What the correction kept at the chosen ρ, from :func:`dvp_check` on every micro-batch."""
    mass = torch.cat([c["mass"] for c in checks])
    inside = torch.cat([c["inside_trainer"] & c.get("inside_rollout", c["inside_trainer"]) for c in checks])
    n = max(1, mass.numel())
    return {
        "rho": choice["rho"], "log_rho": math.log(choice["rho"]), "coverage_target": coverage,
        "met": bool(choice["met"]), "mass_min": float(mass.min()) if mass.numel() else 1.0,
        "mass_mean": float(mass.mean()) if mass.numel() else 1.0,
        "positions_at_coverage": float((mass >= coverage).sum()) / n,
        "kept_fraction": float(inside.sum()) / n,
        "kept_unit": "sampled tokens inside both safe sets" if "inside_rollout" in checks[0] else
                     "sampled tokens inside the trainer's safe set",
    }

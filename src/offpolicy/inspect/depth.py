"""The mismatch by depth in an inspection: per position bin of the response, k3, ½r², |Δ log p| and the per-token KL
from the full distributions (exact; the top-k lower bound for an engine that reports only its top-k, as vLLM),
with a figure and a table for the report (:mod:`offpolicy.inspect.report`).

The numbers come from :class:`~offpolicy.inspect.measurements.TokenData` alone, so every engine ``offpolicy inspect``
compares — the transformers engines, llama.cpp, a llama.cpp or vLLM server, a vLLM engine in-process — and every dump
``offpolicy diagnose`` reads gets the same profile, under ``by_position`` in ``report.json``. To put engines side by
side, inspect each with the same task and ``--ignore-eos --max-new-tokens N`` (every answer N tokens long) and print
their profiles as one table::

    offpolicy inspect --model lab --task pattern --ignore-eos --max-new-tokens 200 --rollout bf16 --out depth/bf16
    offpolicy inspect --model lab --task pattern --ignore-eos --max-new-tokens 200 \\
        --rollout backend=llamacpp,weights=q8_0 --out depth/q8_0
    python -m offpolicy.inspect.depth_table depth/*/report.json      # one Markdown table, a row per engine and bin
"""

from __future__ import annotations

from typing import Any

import torch

from offpolicy.inspect.measurements import Measurements
from offpolicy.position import mismatch_by_position

MIN_TOKENS = 20  # a bin with fewer tokens is reported but not used for the deepest-over-first ratio
TABLE_STATS = (("k3_kl", "k3 KL", "{:.2e}"), ("token_kl", "KL(μ‖π)", "{:.2e}"), ("k2_kl", "½ r² (Tinker v2)", "{:.2e}"),
               ("kl", "mean μ − π (Tinker v1)", "{:+.2e}"), ("logp_abs_diff_mean", "mean |Δ log p|", "{:.2e}"),
               ("nll", "−log π", "{:.3f}"))


def depth_summary(measured: Measurements) -> dict[str, Any]:
    """The ``by_position`` part of ``report.json``: ``edges`` and ``bins`` (labels), per bin ``tokens``, ``kl``
    (mean log μ − log π), ``k2_kl``, ``k3_kl``, ``logp_abs_diff_mean`` and ``token_kl`` (the per-token KL(μ‖π) of
    the full distributions, ``token_kl_source`` "exact" or "topk lower bound"; null without logits), ``nll`` (mean
    −log π of the sampled tokens: the policy's uncertainty, which the mismatch follows), the mean prompt length, and ``deepest_over_first``: each statistic in the deepest bin with ≥ 20 tokens over its value in the first
    bin (> 1: the mismatch grows with depth; null when a value is 0 or there is one such bin)."""
    t = measured.tokens
    profile = mismatch_by_position(t.trainer_logp, t.rollout_logp, t.mask, token_kl=t.kl)
    stats = {name: [float(v) for v in values.tolist()] for name, values in profile.stats.items()}
    # the policy's own uncertainty per bin, mean −log π (the mismatch follows it: a confident token has little to lose)
    stats["nll"] = _per_bin_mean(-t.trainer_logp.double(), t.mask & torch.isfinite(t.log_ratio), profile.edges)
    token_kl = stats.pop("kl_exact", None)
    out: dict[str, Any] = {
        "unit": "response position (0 = the first generated token)", "edges": profile.edges,
        "bins": profile.labels(), "tokens": [int(n) for n in stats.pop("tokens")], **stats,
        "token_kl": token_kl,
        "token_kl_source": None if t.kl is None else ("exact" if t.kl_kind == "exact" else "topk lower bound"),
        "prompt_length_mean": (sum(len(p) for p in t.prompt_ids) / len(t.prompt_ids)) if t.prompt_ids else None,
    }
    enough = [i for i, n in enumerate(out["tokens"]) if n >= MIN_TOKENS]
    ratios: dict[str, float | None] = {}
    for name in ("k3_kl", "token_kl", "k2_kl", "logp_abs_diff_mean"):
        values = out[name]
        if values is None or len(enough) < 2 or not values[enough[0]] > 0:
            ratios[name] = None
        else:
            ratios[name] = values[enough[-1]] / values[enough[0]]
    out["deepest_over_first"] = ratios
    return out


def _per_bin_mean(x: torch.Tensor, valid: torch.Tensor, edges: list[int]) -> list[float]:
    """Mean of ``x`` [B, T] over the ``valid`` positions of each response-position bin (0 where empty)."""
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = valid[:, lo:hi]
        out.append(float(x[:, lo:hi][sel].mean()) if bool(sel.any()) else 0.0)
    return out


def _centres(summary: dict[str, Any]) -> list[float]:
    edges = summary["edges"]
    return [(lo + hi - 1) / 2 for lo, hi in zip(edges[:-1], edges[1:])]


def plot_depth(ax_kl, ax_abs, summary: dict[str, Any]) -> None:
    """Left: k3, the per-token KL and ½r² per position bin (log axes); right: mean |Δ log p| and the signed mean
    log μ − log π, with the token count of each bin."""
    depth = summary.get("by_position")
    if not depth or not any(depth["tokens"]):
        for ax in (ax_kl, ax_abs):
            ax.text(0.5, 0.5, "no tokens", ha="center", va="center", transform=ax.transAxes, color="0.4")
        return
    keep = [i for i, n in enumerate(depth["tokens"]) if n > 0]
    x = [_centres(depth)[i] + 1 for i in keep]  # +1: position 0's bin sits on a log axis

    def series(name: str) -> list[float]:
        return [depth[name][i] for i in keep]

    for name, label, style in (("k3_kl", "k3 of the sampled token", "o-"), ("k2_kl", "½ r² (Tinker v2)", "s--"),
                               ("token_kl", f"KL(μ‖π), {depth.get('token_kl_source')}", "^-")):
        if depth.get(name) is None:
            continue
        ys = [max(y, 1e-30) for y in series(name)]
        ax_kl.plot(x, ys, style, label=label, markersize=4)
    ax_kl.set_xscale("log")
    ax_kl.set_yscale("log")
    ax_kl.set_xlabel("position in the response (bin centre + 1)")
    ax_kl.set_ylabel("nats per token")
    ratio = (depth.get("deepest_over_first") or {}).get("k3_kl")
    note = f" — deepest/first bin ×{ratio:.2g}" if ratio is not None else ""
    ax_kl.set_title("mismatch by depth: KL per position bin" + note, fontsize=9)
    ax_kl.legend(fontsize=7)
    ax_kl.grid(alpha=0.3, which="both")
    ax_abs.plot(x, series("logp_abs_diff_mean"), "o-", label="mean |log π − log μ|", markersize=4)
    ax_abs.plot(x, series("kl"), "s--", label="mean log μ − log π (Tinker v1)", markersize=4)
    ax_abs.axhline(0, color="k", linewidth=0.6)
    for xi, n in zip(x, [depth["tokens"][i] for i in keep]):  # token counts along the bottom edge
        ax_abs.annotate(f"{n}", (xi, 0.02), xycoords=ax_abs.get_xaxis_transform(), ha="center", fontsize=6,
                        color="0.4")
    ax_abs.set_xscale("log")
    ax_abs.set_xlabel("position in the response (bin centre + 1); grey: tokens per bin")
    ax_abs.set_ylabel("nats")
    ax_abs.set_title("sampled-token log-prob difference by depth", fontsize=9)
    ax_abs.legend(fontsize=7)
    ax_abs.grid(alpha=0.3)


def depth_rows(summary: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """The report's HTML table: headers and one row per bin."""
    depth = summary.get("by_position") or {}
    headers = ["positions", "tokens"] + [label for name, label, _ in TABLE_STATS if depth.get(name) is not None]
    rows = []
    for i, (lo, hi) in enumerate(zip(depth.get("edges", [])[:-1], depth.get("edges", [])[1:])):
        row: list[Any] = [f"{lo}–{hi - 1}", depth["tokens"][i]]
        row += [depth[name][i] for name, _, _ in TABLE_STATS if depth.get(name) is not None]
        rows.append(row)
    return headers, rows

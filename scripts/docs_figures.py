"""Draw the docs' explanatory figures (a few seconds, no model):

    python scripts/docs_figures.py [--out docs]

* ``methods/is_weights.png`` — the weight each importance-sampling correction gives a token (left) and a 32-token
  sequence (right) as a function of the ratio ρ = π_old/μ, computed by the library's own ``tis``, ``mis``,
  ``icepop`` and ``geo_mask`` at their defaults (cap 2; IcePop's band [0.5, 5]; the geometric mask's [0.999, 1.001]);
* ``frameworks/verl_dataflow.png`` — where the verl plug-in's parts act in one step of verl's v1 trainer.

The demo's figure (``lab/demo_overview.png``) is drawn by ``offpolicy demo`` itself.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

import offpolicy as op  # noqa: E402

COLORS = {"TIS": "#1f77b4", "MIS": "#d62728", "IcePop": "#2ca02c", "geometric": "#9467bd", "product": "#ff7f0e",
          "none": "#7f7f7f"}


def weights(correction: op.Correction, rho: torch.Tensor, length: int) -> torch.Tensor:
    """The weight of the first token of ``len(rho)`` sequences of ``length`` tokens, every token with ratio ρ."""
    log_rho = rho.log()[:, None].expand(-1, length).contiguous()
    batch = op.LogProbBatch(logp=log_rho.clone(), old_logp=log_rho, rollout_logp=torch.zeros_like(log_rho),
                            mask=torch.ones_like(log_rho), advantages=torch.ones(len(rho)))
    result = correction(batch)
    return (result.weights * result.keep)[:, 0]


def draw_is_weights(path: Path) -> None:
    rho = torch.logspace(-1.3, 1.3, 801)
    fig, (tok, seq) = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    tok.plot(rho, rho, color=COLORS["none"], lw=1, ls=":", label="no correction: w = ρ")
    for name, corr, style, label in (("TIS", op.tis(upper=2.0), "-", "TIS: min(ρ, 2)"),
                                     ("MIS", op.mis(upper=2.0), "--", "MIS: ρ · 1[ρ ≤ 2]"),
                                     ("IcePop", op.icepop(), "-.", "IcePop: ρ · 1[0.5 ≤ ρ ≤ 5]")):
        tok.plot(rho, weights(corr, rho, 1), color=COLORS[name], lw=2, ls=style, label=label)
    tok.set_title("one token, ratio ρ = π_old/μ", fontsize=10)
    seq_rho = torch.logspace(-0.1, 0.1, 801)
    for name, corr, style, label in (
            ("product", op.tis(upper=2.0, level="sequence"), "-", "TIS, sequence level: min(ρ³², 2)"),
            ("geometric", op.tis(upper=2.0, level="geometric"), "--", "TIS, geometric level: min(ρ, 2)"),
            ("IcePop", op.geo_mask(), "-", "geometric mask: ρ · 1[0.999 ≤ ρ_geo ≤ 1.001]")):
        seq.plot(seq_rho, weights(corr, seq_rho, 32), color=COLORS[name] if name != "IcePop" else "#8c564b", lw=2,
                 ls=style, label=label)
    seq.set_title("a 32-token sequence, every token with ratio ρ", fontsize=10)
    for ax in (tok, seq):
        ax.set_xscale("log")
        ax.set_xlabel("ρ = π_old / μ per token")
        ax.axhline(1.0, color="0.85", lw=0.8, zorder=0)
        ax.axvline(1.0, color="0.85", lw=0.8, zorder=0)
        ax.legend(fontsize=8, loc="upper left", frameon=False)
        ax.grid(alpha=0.2)
    tok.set_ylabel("weight w (0 = dropped)")
    tok.set_ylim(-0.1, 5.5)
    seq.set_xticks([0.8, 0.9, 1.0, 1.1, 1.25], ["0.8", "0.9", "1", "1.1", "1.25"])
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _box(ax, xy, w, h, title, lines, color):
    x, y = xy
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.03", fc=color, ec="0.3", lw=1))
    ax.text(x + w / 2, y + h - 0.05, title, ha="center", va="top", fontsize=10, weight="bold")
    for i, line in enumerate(lines):
        ax.text(x + 0.03, y + h - 0.17 - 0.1 * i, line, ha="left", va="top", fontsize=7.6,
                color="#7a1f1f" if line.startswith("+") else "0.15")


def _arrow(ax, a, b, text="", dy=0.03):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=12, lw=1.2, color="0.3"))
    if text:
        ax.text((a[0] + b[0]) / 2, (a[1] + b[1]) / 2 + dy, text, ha="center", va="bottom", fontsize=7.4, color="0.2")


def draw_verl_dataflow(path: Path) -> None:
    fig, ax = plt.subplots(figsize=(11, 4.2))
    ax.set_xlim(0, 4.3)
    ax.set_ylim(0, 1.75)
    ax.axis("off")
    top, h = 1.05, 0.65
    _box(ax, (0.05, top), 1.0, h, "driver (verl's trainer)",
         ["verl: schedules the step, rewards,", "   _compute_advantage (GRPO, GAE, …)",
          "+ the correction after the advantages", "+ rollout_is_weights, response_mask"], "#e8eef7")
    _box(ax, (1.6, top), 1.1, h, "TransferQueue (a row per sample)",
         ["prompt, response, response_mask", "rollout_log_probs (μ), old_log_probs (π_old)",
          "advantages, rollout_is_weights", "+ offpolicy_topk_ids / _logp (the top-K)"], "#f3f3f3")
    _box(ax, (3.2, top), 1.05, h, "agent loop + rollout server",
         ["vLLM / SGLang samples and reports μ", "+ offpolicy_agent: min_p / top_k / top_p",
          "+ asks the server for the top-K", "   (prompt_logprobs = K)"], "#eef6ea")
    _box(ax, (1.6, 0.05), 1.1, h, "training workers (FSDP engine)",
         ["infer_batch: π_old", "+ DVP / replay scoring, top-K KL bounds",
          "train_mini_batch: π_θ, the policy loss", "+ ALP noise, score centering, μ to the loss"], "#fbefe4")
    _arrow(ax, (3.2, 1.42), (2.7, 1.42), "1. samples, μ, top-K")
    _arrow(ax, (1.75, top), (1.75, 0.7))
    ax.text(1.72, 0.88, "2. π_old\nforward", ha="right", va="center", fontsize=7.4, color="0.2")
    _arrow(ax, (2.0, 0.7), (2.0, top))
    ax.text(2.03, 0.88, "π_old,\nKL bounds", ha="left", va="center", fontsize=7.4, color="0.2")
    _arrow(ax, (1.6, 1.5), (1.05, 1.5), "3. advantages")
    _arrow(ax, (1.05, 1.25), (1.6, 1.25), "weights, mask")
    _arrow(ax, (2.45, top), (2.45, 0.7))
    ax.text(2.48, 0.88, "4. update: weights,\nμ, top-K", ha="left", va="center", fontsize=7.4, color="0.2")
    _arrow(ax, (2.7, 0.35), (3.6, top))
    ax.text(3.2, 0.55, "5. weight sync", ha="left", fontsize=7.4, color="0.2")
    ax.text(0.55, 0.4, "red (+): what the offpolicy plug-in adds;\nthe rest is verl 0.9's own v1 trainer",
            ha="center", va="center", fontsize=8, color="#7a1f1f")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs")
    out = parser.parse_args().out
    (out / "methods").mkdir(parents=True, exist_ok=True)
    (out / "frameworks").mkdir(parents=True, exist_ok=True)
    draw_is_weights(out / "methods" / "is_weights.png")
    draw_verl_dataflow(out / "frameworks" / "verl_dataflow.png")
    print(f"wrote {out / 'methods' / 'is_weights.png'} and {out / 'frameworks' / 'verl_dataflow.png'}")


if __name__ == "__main__":
    main()

"""Draw the docs' explanatory figures (a few seconds, no model):

    python scripts/docs_figures.py [--out docs]

* ``methods/is_weights.png`` — the weight each importance-sampling correction gives a token (left) and a 32-token
  sequence (right) as a function of the ratio ρ = π_old/μ, computed by the library's own ``tis``, ``mis``,
  ``icepop`` and ``geo_mask`` at their defaults (cap 2; IcePop's band [0.5, 5]; the geometric mask's [0.999, 1.001]);
* ``frameworks/verl_dataflow.png`` — where the verl plug-in's parts act in one step of verl's v1 trainer;
* ``frameworks/trl_dataflow.png`` — the same for the TRL trainer: vLLM samples and reports μ, TRL scores π_old, the
  correction weighs each token, the loss reads π_θ, the weights go back to vLLM (and the sync is checked);
* ``img/choosing_flowchart.png`` — from the symptom in the logs to the method (the picture atop choosing.md);
* ``img/three_policies.png`` — π_θ, π_old and μ: where each comes from and which ratio compares which.

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


def draw_trl_dataflow(path: Path) -> None:
    fig, ax = plt.subplots(figsize=(11, 4.2))
    ax.set_xlim(0, 4.3)
    ax.set_ylim(0, 1.75)
    ax.axis("off")
    top, h = 1.05, 0.65
    _box(ax, (3.2, top), 1.05, h, "vLLM (colocated or a server)",
         ["samples the completions", "reports μ: the log-prob of each", "   sampled token (processed_logprobs)",
          "+ top-K log-probs (topk_logprobs=K)"], "#eef6ea")
    _box(ax, (1.6, top), 1.1, h, "OffPolicyGRPOTrainer: scoring",
         ["TRL: rewards, group advantages", "TRL: π_old, the trainer's forward", "+ the mismatch metrics (sampling/…)",
          "+ the correction's weights w, mask"], "#e8eef7")
    _box(ax, (0.05, top), 1.0, h, "correction (per token)",
         ["+ TIS: w = min(π_old/μ, C)", "+ MIS, IcePop: drop outliers", "+ TRM, OPSM, veto: drop sequences",
          "+ DVP / replay: the same support"], "#fbefe4")
    _box(ax, (1.6, 0.05), 1.1, h, "loss and update",
         ["π_θ: the trainer's forward with grad", "TRL's clipped loss on π_θ/π_old",
          "+ × w; M2PO, IPO, ALP read μ", "optimizer step, TRL's grad_norm"], "#f3f3f3")
    _arrow(ax, (3.2, 1.42), (2.7, 1.42), "1. completions, μ")
    _arrow(ax, (1.6, 1.42), (1.05, 1.42), "2. π_old, μ, A")
    _arrow(ax, (0.55, top), (1.6, 0.45))
    ax.text(0.95, 0.72, "3. w, mask", ha="right", va="center", fontsize=7.4, color="0.2")
    _arrow(ax, (2.7, 0.35), (3.6, top))
    ax.text(3.2, 0.52, "4. weight sync\n+ sync check (probe scored\n   by vLLM and the trainer)", ha="left",
            fontsize=7.4, color="0.2")
    ax.text(0.55, 0.4, "red (+): what offpolicy adds;\nthe rest is TRL 1.16's own GRPOTrainer",
            ha="center", va="center", fontsize=8, color="#7a1f1f")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _node(ax, x, y, text, color, w=1.5, h=0.32, size=8.0):
    """A box centred on (x, y): a question (blue), a symptom (grey) or an action (orange)."""
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.04",
                                fc=color, ec="0.35", lw=1))
    ax.text(x, y, text, ha="center", va="center", fontsize=size)


def draw_choosing_flowchart(path: Path) -> None:
    """Symptom (left) → the key to read (middle) → the method to start with (right); one row per symptom."""
    rows = [
        ("NaN loss or a non-finite log-prob", "sampling/nonfinite_tokens > 0\nrollout_corr/nonfinite_tokens > 0",
         "IcePop (band [0.5, 5]);\nfind the engine bug"),
        ("gradient-norm spikes", "grad_norm · actor/grad_norm\n> 10× its median over the run", "token TIS, cap 2"),
        ("k3 climbing over the run", "sampling/k3_kl · rollout_corr/k3_kl\ngrows over the run, or > 0.1",
         "token TIS, cap 2;\nfind the source (inspect)"),
        ("k3 high right after a sync", "sync/ok = 0 (TRL, verl)\nsync/stale_fraction > 0.5",
         "a sync that did not land:\nfix the sync, not the loss"),
        ("reward collapses after N steps", "k3 and ratio max\nin the steps before it", "TIS or MIS, cap 2;\n"
         "with top-p / top-k: replay"),
        ("entropy collapses", "entropy · actor/entropy\nand the clipped share", "token TIS;\nsampling replay or DVP"),
        ("response length blows up", "completions/mean_length ·\nresponse_length/mean, k3 vs length",
         "a length-neutral test:\nLN-TRM, TRM-Avg, geo. IS"),
        ("sequence test drops most\nsequences", "offpolicy/trm/masked_seq_frac ·\nrollout_corr/trm/masked_seq_frac > 0.3",
         "TRM-Avg, LN-TRM, or\noffpolicy inspect's δ"),
    ]
    fig, ax = plt.subplots(figsize=(10, 6.6))
    n = len(rows)
    ax.set_xlim(0, 6.2)
    ax.set_ylim(-0.3, n * 0.5 + 0.35)
    ax.axis("off")
    head = n * 0.5 + 0.12
    for x, title in ((0.95, "what you see"), (3.05, "the key to read (TRL · verl)"), (5.25, "start with")):
        ax.text(x, head, title, ha="center", va="center", fontsize=11, weight="bold")
    for i, (symptom, key, action) in enumerate(rows):
        y = (n - 1 - i) * 0.5 + 0.1
        _node(ax, 0.95, y, symptom, "#eeeeee", w=1.8, h=0.38, size=9.5)
        _node(ax, 3.05, y, key, "#e8eef7", w=2.1, h=0.38, size=8.8)
        _node(ax, 5.25, y, action, "#fbefe4", w=1.8, h=0.38, size=9.5)
        _arrow(ax, (1.86, y), (1.99, y))
        _arrow(ax, (4.11, y), (4.34, y))
    ax.text(3.1, -0.22, "Thresholds, and where each comes from (this project's 5 M lab model, peers' runs at scale, or "
            "unknown at scale): the table below", ha="center", va="center", fontsize=8.5, color="0.3")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def draw_three_policies(path: Path) -> None:
    """Left: where π_θ, π_old and μ come from. Right: the three over a toy vocabulary, with the sampled token's ratios."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.9), gridspec_kw={"width_ratios": [1.25, 1]})
    left.set_xlim(0, 3.0)
    left.set_ylim(0, 1.6)
    left.axis("off")
    _node(left, 0.6, 1.3, "weights θ_old\n(at rollout time)", "#eeeeee", w=1.0, h=0.36)
    _node(left, 2.3, 1.3, "μ: the inference engine\n(vLLM: bf16 / fp8, KV cache,\nmaybe older weights)",
          "#eef6ea", w=1.35, h=0.42, size=7.6)
    _node(left, 2.3, 0.75, "π_old: the training engine\n(FSDP: fp32 / mixed)", "#e8eef7", w=1.35, h=0.36,
          size=7.6)
    _node(left, 2.3, 0.2, "π_θ: the training engine\nafter k updates (has grad)", "#fbefe4", w=1.35, h=0.36,
          size=7.6)
    _arrow(left, (1.1, 1.36), (1.62, 1.36))
    left.text(1.36, 1.42, "samples,\nreports μ", ha="center", va="bottom", fontsize=7.2, color="0.2")
    _arrow(left, (1.1, 1.22), (1.62, 0.8))
    left.text(1.25, 0.86, "scores the\nsame tokens", ha="right", fontsize=7.2, color="0.2")
    _arrow(left, (2.3, 0.57), (2.3, 0.38))
    left.text(0.2, 0.45, "ρ = π_old/μ: the engines' mismatch\n  (what TIS, MIS, IcePop correct)\n"
              "r = π_θ/π_old: the policy's own step\n  (what PPO clips)", ha="left", va="center", fontsize=7.6,
              color="#7a1f1f")
    tokens = ["the", "a", "an", "one", "this", "tail"]
    mu = torch.tensor([0.50, 0.26, 0.12, 0.07, 0.04, 0.01])
    old = torch.tensor([0.46, 0.29, 0.12, 0.07, 0.045, 0.015])
    theta = torch.tensor([0.55, 0.25, 0.10, 0.05, 0.04, 0.01])
    x = torch.arange(len(tokens)).float()
    for off, probs, name, color in ((-0.27, mu, "μ (engine)", "#2ca02c"), (0.0, old, "π_old (trainer)", "#1f77b4"),
                                    (0.27, theta, "π_θ (after updates)", "#ff7f0e")):
        right.bar(x + off, probs, width=0.26, color=color, label=name)
    right.set_xticks(x.tolist(), tokens)
    right.set_ylabel("probability of the next token")
    right.annotate(f"sampled 'the':  ρ = {old[0] / mu[0]:.2f},  r = {theta[0] / old[0]:.2f}", xy=(0.27, 0.555),
                   xytext=(1.2, 0.5), fontsize=8, arrowprops={"arrowstyle": "->", "color": "0.3"})
    right.legend(fontsize=8, frameon=False, loc="center right")
    right.set_title("one position, a toy vocabulary (illustration)", fontsize=9)
    right.grid(alpha=0.2, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs")
    out = parser.parse_args().out
    (out / "methods").mkdir(parents=True, exist_ok=True)
    (out / "frameworks").mkdir(parents=True, exist_ok=True)
    (out / "img").mkdir(parents=True, exist_ok=True)
    figures = {"methods/is_weights.png": draw_is_weights, "frameworks/verl_dataflow.png": draw_verl_dataflow,
               "frameworks/trl_dataflow.png": draw_trl_dataflow, "img/choosing_flowchart.png": draw_choosing_flowchart,
               "img/three_policies.png": draw_three_policies}
    for name, draw in figures.items():
        draw(out / name)
    print("wrote " + ", ".join(str(out / name) for name in figures))


if __name__ == "__main__":
    main()

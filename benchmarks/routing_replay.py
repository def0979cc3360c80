"""Rollout–trainer mismatch of a tiny mixture-of-experts model without routing replay, with R2 and with R3.

    python benchmarks/routing_replay.py [--family qwen3_moe] [--prompts 32] [--new-tokens 24] [--seed 0]

A tiny random MoE (4 layers, 8 experts, top-2; built locally from its transformers config) samples with the bf16
KV-cached HF engine, which records its routes. The trainer scores the same tokens with an fp32 full forward:

* ``none``: π_old and π_θ route natively;
* ``R2``: π_old routes natively and records; π_θ replays π_old's routes;
* ``R3``: π_old and π_θ replay the engine's routes.

Columns: the fraction of (position, layer) routes whose expert set differs between the engine's rollout and the
trainer's π_old forward; the token KL(μ‖π_old) between the engine's and the trainer's processed next-token distributions (mean
and max over completion tokens; μ's distribution from the engine's own bf16 forward, which reproduces its generated
log-probs exactly); |log μ − log π_old| of the sampled tokens (mean, max); then after one AdamW step of a
REINFORCE-style loss (lr 1e-4, every mode from the same weights) the routes that differ between π_θ and π_old and
|log π_θ − log π_old| of the sampled tokens (mean, max) — what routing changes during the update add to the ratio.
"""

from __future__ import annotations

import argparse
import copy

import torch


def build_tiny_moe(family: str, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, pad_token_id=0,
                  initializer_range=0.05)
    configs = {
        "qwen2_moe": lambda: Qwen2MoeConfig(**common, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                            num_experts=8, num_experts_per_tok=2),
        "qwen3_moe": lambda: Qwen3MoeConfig(**common, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                            head_dim=16, norm_topk_prob=True),
        "mixtral": lambda: MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2),
        "olmoe": lambda: OlmoeConfig(**common, num_experts=8, num_experts_per_tok=2),
    }
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(configs[family]()).eval()


def _scored(model, prompts, completions, cfg, routes, *, grad=False):
    """(log-probs of the sampled tokens [B, T], mask, processed next-token log-probs [B, T, V], routes recorded)."""
    from offpolicy.rollout.routing import RouteRecorder, replay_routes
    from offpolicy.rollout.sampling import process_logits
    from offpolicy.rollout.scoring import sequence_logprobs

    lengths = [len(p) + len(c) - 1 for p, c in zip(prompts, completions)]
    replay = replay_routes(model, routes) if routes is not None else _Null()
    with torch.set_grad_enabled(grad), replay, RouteRecorder(model, batch_size=len(prompts)) as rec:
        logp, mask, logits = sequence_logprobs(model, prompts, completions, cfg, return_logits=True)
    return logp, mask, process_logits(logits.detach(), cfg), rec.pop_rows(lengths)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _differ(routes_a: list[torch.Tensor], routes_b: list[torch.Tensor]) -> float:
    """Fraction of (position, layer) pairs whose expert sets differ between two route records."""
    a = torch.cat([r.long().sort(-1).values for r in routes_a])
    b = torch.cat([r.long().sort(-1).values for r in routes_b])
    return (a != b).any(-1).float().mean().item()


def run(family: str, n_prompts: int, new_tokens: int, seed: int) -> list[dict]:
    from offpolicy.rollout.hf import HFRolloutEngine
    from offpolicy.rollout.sampling import SamplingConfig

    model = build_tiny_moe(family, seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 256, (int(n),), generator=g).tolist() for n in torch.randint(4, 12, (n_prompts,), generator=g)]
    cfg = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0)
    engine = HFRolloutEngine(model, dtype="bfloat16", record_routes=True, pad_token_id=0)
    out = engine.generate(prompts, cfg, seed=seed)
    completions = out.completion_ids
    with torch.no_grad():  # μ's full next-token distributions: the engine's bf16 forward, no cache (eager attention)
        mu_logp, mask, mu_logits = engine.score(prompts, completions, cfg, return_logits=True)
    assert torch.equal(mu_logp[mask], out.logp[mask]), "the engine's forward must reproduce its generated log-probs"
    from offpolicy.rollout.sampling import process_logits

    mu_all = process_logits(mu_logits, cfg)
    advantages = torch.randn(len(prompts), generator=g)

    rows = []
    for mode in ("none", "R2", "R3"):
        trainer = copy.deepcopy(model)
        old_routes_in = out.routed_experts if mode == "R3" else None
        old_logp, _, old_all, old_used = _scored(trainer, prompts, completions, cfg, old_routes_in)
        theta_routes = {"none": None, "R2": old_used, "R3": out.routed_experts}[mode]

        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
        logp, _, _, _ = _scored(trainer, prompts, completions, cfg, theta_routes, grad=True)
        loss = -(advantages[:, None] * logp * mask).sum() / mask.sum()
        loss.backward()
        opt.step()
        new_logp, _, _, new_used = _scored(trainer, prompts, completions, cfg, theta_routes)

        p_mu = mu_all.exp()
        kl = (p_mu * (mu_all - old_all)).nan_to_num(0.0).sum(-1)[mask]  # 0·log 0 = 0 where μ truncated nothing here
        delta = (out.logp - old_logp).abs()[mask]
        step = (new_logp - old_logp).abs()[mask]
        rows.append({"mode": mode, "flips_old": _differ(out.routed_experts, old_used),
                     "flips_step": _differ(old_used, new_used), "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
                     "delta_mean": delta.mean().item(), "delta_max": delta.max().item(),
                     "step_mean": step.mean().item(), "step_max": step.max().item()})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen3_moe", choices=["qwen2_moe", "qwen3_moe", "mixtral", "olmoe"])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = run(args.family, args.prompts, args.new_tokens, args.seed)
    print(f"{args.family}, 4 layers × 8 experts (top-2), bf16 KV-cache engine vs fp32 trainer, "
          f"{args.prompts} prompts × {args.new_tokens} tokens, seed {args.seed}")
    print("| replay | routes μ ≠ π_old | KL(μ‖π_old) mean | max | \\|Δ log p\\| mean | max "
          "| after one step: routes π_θ ≠ π_old | \\|log π_θ − log π_old\\| mean | max |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['flips_old']:.3f} | {r['kl_mean']:.2e} | {r['kl_max']:.2e} "
              f"| {r['delta_mean']:.2e} | {r['delta_max']:.2e} | {r['flips_step']:.3f} | {r['step_mean']:.2e} "
              f"| {r['step_max']:.2e} |")


if __name__ == "__main__":
    main()

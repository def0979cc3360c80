"""TRM's top-K bounds against the exact full-vocabulary KL, from one live vLLM engine (CPU build, bf16) and the fp32
trainer, on the embedded models.

    python benchmarks/topk_bounds_vllm.py --model tiny --out tiny.json      # one model per process (≈ 1–5 min)
    python benchmarks/topk_bounds_vllm.py --report tiny.json lab.json       # the markdown table

vLLM started with ``max_logprobs=-1`` and asked for ``logprobs=-1`` returns its whole processed distribution μ
(T = 1, no truncation) at every sampled position; the trainer scores the same tokens (π, fp32). Per position: the
exact KL(μ‖π), and from μ's top-K (the K largest entries of that same distribution — what the engine returns for
``logprobs=K``) the coarse-grained lower bound, the certified upper bound (:func:`offpolicy.topk_kl_upper_bound`:
the tail capped at the K-th probability) and the uncapped upper bound it replaced (all tail mass on π's least
likely token). Per sequence: TRM's test at the paper's thresholds (max 0.05 and average 0.001) and the max test
alone, on the exact KL and on each bound. Seeds change the prompts and the sampling; the table shows the mean and
the range over seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

KS = (1, 5, 8, 20, 100)
MAX_KL, AVG_KL = 0.05, 0.001


def _uncapped_upper(lq_k, ids, z):
    """The bound before the cap: the head's terms + q_R · log(q_R / π_min) over the tail (float64)."""
    import torch

    lp = torch.log_softmax(z.double(), -1)
    head = (lq_k.exp() * (lq_k - lp.gather(-1, ids))).sum(-1)
    q_rest = (1 - lq_k.exp().sum(-1)).clamp(min=0)
    p_min = lp.scatter(-1, ids, math.inf).amin(-1)
    tail = torch.where(q_rest > 0, q_rest * (q_rest.clamp(min=1e-300).log() - p_min), torch.zeros_like(q_rest))
    return head + tail


def _accept(div, lengths, max_kl, avg_kl):
    """TRM's keep rate over sequences: max_t ≤ max_kl and (avg_kl given) mean_t ≤ avg_kl."""
    keep, start = [], 0
    for n in lengths:
        d = div[start:start + n]
        start += n
        keep.append(bool(d.max() <= max_kl) and (avg_kl is None or bool(d.mean() <= avg_kl)))
    return sum(keep) / len(keep)


def measure(model_name: str, seed: int, prompts: int, tokens: int, llm) -> dict:
    import torch

    from offpolicy.divergence import token_kl, topk_kl_lower_bound, topk_kl_upper_bound
    from offpolicy.inspect.run import load_model, task_prompts
    from offpolicy.rollout.scoring import sequence_logprobs
    from vllm import SamplingParams

    model, tok = load_model(model_name)
    ids = task_prompts(tok, "pattern" if model_name == "lab" else "arithmetic", prompts, seed=seed)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in ids],
                        [SamplingParams(max_tokens=tokens, temperature=1.0, logprobs=-1, seed=1000 * seed + i)
                         for i in range(len(ids))], use_tqdm=False)
    seconds = time.perf_counter() - start
    completions = [list(o.outputs[0].token_ids) for o in outs]
    keep = [i for i, c in enumerate(completions) if c]
    ids, completions, outs = [ids[i] for i in keep], [completions[i] for i in keep], [outs[i] for i in keep]
    with torch.no_grad():
        _, mask, logits = sequence_logprobs(model, ids, completions, return_logits=True)
    mu = torch.full(logits.shape, -math.inf, dtype=torch.float64)
    for i, o in enumerate(outs):
        for j, step in enumerate(o.outputs[0].logprobs):
            mu[i, j, list(step.keys())] = torch.tensor([v.logprob for v in step.values()], dtype=torch.float64)
    lmu, z = mu[mask], logits[mask].double()
    lengths = mask.sum(-1).tolist()
    exact = token_kl(lmu, z)
    top = lmu.sort(-1, descending=True)
    row: dict = {"model": model_name, "seed": seed, "tokens": int(mask.sum()), "sequences": len(lengths),
                 "generate_seconds": seconds, "exact_mean": float(exact.mean()),
                 "exact_accept": _accept(exact, lengths, MAX_KL, AVG_KL),
                 "exact_accept_max_only": _accept(exact, lengths, MAX_KL, None), "k": {}}
    for k in KS:
        lq, idx = top.values[:, :k].float(), top.indices[:, :k]
        lower = topk_kl_lower_bound(lq, idx, z.float()).double()
        upper = topk_kl_upper_bound(lq, idx, z.float()).double()
        old = _uncapped_upper(top.values[:, :k], idx, z)
        assert bool((lower <= exact + 1e-5).all()) and bool((upper >= exact - 1e-5).all()), "a bound failed"
        row["k"][k] = {
            "head_mass": float(lq.double().exp().sum(-1).mean()),
            "lower_mean": float(lower.mean()), "upper_mean": float(upper.mean()), "uncapped_mean": float(old.mean()),
            "token_pass_upper": float((upper <= MAX_KL).double().mean()),
            "token_pass_uncapped": float((old <= MAX_KL).double().mean()),
            "accept_upper": _accept(upper, lengths, MAX_KL, AVG_KL),
            "accept_uncapped": _accept(old, lengths, MAX_KL, AVG_KL),
            "accept_lower": _accept(lower, lengths, MAX_KL, AVG_KL),
            "accept_upper_max_only": _accept(upper, lengths, MAX_KL, None),
            "accept_uncapped_max_only": _accept(old, lengths, MAX_KL, None),
        }
    return row


def report(paths: list[str]) -> None:
    rows = [r for p in paths for r in json.load(open(p))]
    models = sorted({r["model"] for r in rows}, key=lambda m: (m != "tiny", m))

    def cell(values, fmt):
        mean = statistics.fmean(values)
        return f"{fmt(mean)} ({fmt(min(values))}–{fmt(max(values))})" if len(values) > 1 else fmt(mean)

    sci = lambda x: f"{x:.2g}"  # noqa: E731
    pct = lambda x: f"{100 * x:.0f} %"  # noqa: E731
    print("| model | K | head mass | mean exact KL | mean lower | mean upper (capped) | mean upper (uncapped) | "
          "TRM accepts: exact | upper | uncapped | max test alone: upper | uncapped |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m in models:
        rs = [r for r in rows if r["model"] == m]
        for k in KS:
            ks = [r["k"][str(k)] for r in rs]
            print(f"| {m} ({sum(r['tokens'] for r in rs)} tokens, {len(rs)} seeds) | {k} | "
                  f"{cell([x['head_mass'] for x in ks], lambda v: f'{v:.4f}')} | "
                  f"{cell([r['exact_mean'] for r in rs], sci)} | {cell([x['lower_mean'] for x in ks], sci)} | "
                  f"{cell([x['upper_mean'] for x in ks], sci)} | {cell([x['uncapped_mean'] for x in ks], sci)} | "
                  f"{cell([r['exact_accept'] for r in rs], pct)} | {cell([x['accept_upper'] for x in ks], pct)} | "
                  f"{cell([x['accept_uncapped'] for x in ks], pct)} | "
                  f"{cell([x['accept_upper_max_only'] for x in ks], pct)} | "
                  f"{cell([x['accept_uncapped_max_only'] for x in ks], pct)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", choices=("tiny", "lab"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--prompts", type=int, default=None, help="default: 64 (tiny), 16 (lab)")
    parser.add_argument("--tokens", type=int, default=None, help="default: 16 (tiny), 32 (lab)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--report", nargs="+", default=None, help="print the table from these JSON files")
    args = parser.parse_args()
    if args.report:
        report(args.report)
        return
    from offpolicy.rollout.vllm_server import vllm_cpu_env

    for key, value in vllm_cpu_env().items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from offpolicy.models import model_path
    from vllm import LLM

    prompts = args.prompts or (16 if args.model == "lab" else 64)
    tokens = args.tokens or (32 if args.model == "lab" else 16)
    llm = LLM(model=str(model_path(args.model)), dtype="bfloat16", max_logprobs=-1,
              logprobs_mode="processed_logprobs", enforce_eager=True, seed=0, max_model_len=256)
    rows = [measure(args.model, seed, prompts, tokens, llm) for seed in args.seeds]
    text = json.dumps(rows, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()

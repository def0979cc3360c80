"""One GPU run, ready to go: the fused kernels against the naive path, TRL's and verl's own chunked heads and Liger
(each if importable) at V = 151,936, and the bf16 HF engine's mismatch against fp32 on the lab model; one JSON.

    bash benchmarks/gpu.sh                                   # on a CUDA machine: ≤ 8 minutes, writes gpu.json
    python benchmarks/gpu.py --device cpu --quick --out x.json   # the same code on a tiny shape (what the test runs)

Kernels (forward + backward of ``Σ c_n · out_n`` with a random c, hidden states and lm_head in ``--dtype``, both
trained): per arm the best of ``--reps`` timed runs after a warm-up (CUDA-synchronised wall clock) and the peak of
``torch.cuda.max_memory_allocated`` above what the inputs hold (None off CUDA); ``max_abs_diff``: the arm's log-probs
against exact ones (float32 logits of the up-cast inputs, row block by row block) — a check that every arm computes
the log-prob, and how much a head that rounds its logits to the input dtype (the naive path, TRL's) loses.

* ``naive``          z = h Wᵀ in the input dtype, up-cast, log_softmax, gather (+ entropy): the full [N, V] path
* ``op_logp``        ``offpolicy.fused_logp``
* ``op_logp_entropy`` ``offpolicy.fused_token_stats`` (log-prob, entropy)
* ``op_dvp``         ``fused_token_stats`` (DVP's min-p log-prob and mass, ρ = 1e-3)
* ``trl_head``       TRL's ``ChunkedLogProbFunction`` (log-prob, entropy; Triton on CUDA), if TRL imports
* ``verl_fused``     verl's ``FusedLinearForPPO`` (torch backend), if verl imports
* ``liger``          Liger-Kernel's chunked selective log-prob, if it imports

Mismatch: the lab model (``--quick``: the tiny random model) samples ``--prompts`` completions in bfloat16 with a KV
cache (offpolicy's HF engine) and the fp32 model re-scores them on the same device: mean and max |Δ log p|, mean
k3 KL (μ/π − 1 − log μ/π per token), the share of tokens with |Δ log p| > 0.1.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

RHO = 1e-3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _arms(device: torch.device) -> dict[str, Callable[..., Any]]:
    """name → fn(h, w, y) returning the log-probs [N] (plus an extra differentiable term where the arm has one)."""
    from offpolicy.kernels import fused_logp, fused_token_stats

    def naive(h, w, y):
        lp = torch.log_softmax((h @ w.T).float(), -1)
        return lp.gather(1, y[:, None])[:, 0], -(lp.exp() * lp).sum(-1)

    def op_logp(h, w, y):
        return fused_logp(h, w, y), None

    def op_logp_entropy(h, w, y):
        s = fused_token_stats(h, w, y, want=("logp", "entropy"))
        return s.logp, s.entropy

    def op_dvp(h, w, y):
        s = fused_token_stats(h, w, y, want=("minp_logp", "minp_mass"), min_p_rho=RHO)
        return s.minp_logp, s.minp_mass

    arms: dict[str, Callable[..., Any]] = {"naive": naive, "op_logp": op_logp, "op_logp_entropy": op_logp_entropy,
                                           "op_dvp": op_dvp}
    try:
        from trl.kernels import ChunkedLogProbFunction

        # the vocabulary width of TRL's tiles as TRL's own trainer passes it (trl/trainer/utils.py)
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as TRL_VOCAB_TILE

        def trl_head(h, w, y):
            logp, entropy, *_ = ChunkedLogProbFunction.apply(h, w, None, y, 1.0, TRL_VOCAB_TILE, None, 1.0,
                                                             ("log_probs", "entropy"))
            return logp, entropy

        arms["trl_head"] = trl_head
    except ImportError:
        pass
    try:
        from verl.utils.experimental.torch_functional import FusedLinearForPPO

        def verl_fused(h, w, y):
            return FusedLinearForPPO(chunk_size=512)(h, w, y)

        arms["verl_fused"] = verl_fused
    except ImportError:
        pass
    try:
        from liger_kernel.chunked_loss.fused_linear_ppo import _ChunkedSelectiveLogProbFunction as Liger

        def liger(h, w, y):
            return Liger.apply(h, w, y, None, 1.0, 4096), None

        arms["liger"] = liger
    except ImportError:
        pass
    return arms


def bench_kernels(device: torch.device, n: int, hidden: int, vocab: int, dtype: torch.dtype, reps: int) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(n, hidden, generator=g).to(device=device, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * (2 / math.sqrt(hidden))).to(device=device, dtype=dtype)
    w.requires_grad_()
    y = torch.randint(0, vocab, (n,), generator=g).to(device)
    coef = torch.randn(n, generator=g).to(device)
    with torch.no_grad():  # exact log-probs: float32 logits of the up-cast inputs, 1024 rows at a time
        reference = torch.cat([torch.log_softmax(h[a:a + 1024].float() @ w.float().T, -1)
                               .gather(1, y[a:a + 1024, None])[:, 0] for a in range(0, n, 1024)])
    out: dict[str, dict] = {}
    for name, fn in _arms(device).items():
        row: dict[str, Any] = {}
        try:
            times = []
            for i in range(reps + 1):
                h.grad = w.grad = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                    base = torch.cuda.memory_allocated(device)
                _sync(device)
                t0 = time.perf_counter()
                logp, extra = fn(h, w, y)
                loss = (logp.float() * coef).sum() + (0 if extra is None else 1e-3 * extra.float().sum())
                loss.backward()
                _sync(device)
                if i:  # the first run warms up (compilation, autotuning, allocator)
                    times.append(time.perf_counter() - t0)
                if device.type == "cuda":
                    row["peak_mib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
            row["time_s"] = min(times)
            if name != "op_dvp":  # DVP's log-prob is renormalised on the min-p set: another quantity
                row["max_abs_diff"] = float((logp.detach().float() - reference).abs().max())
            row.setdefault("peak_mib", None)
        except Exception as err:  # an arm that cannot run here (OOM, a kernel without this dtype) is reported
            row = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
        h.grad = w.grad = None
        out[name] = row
        print(f"  {name:16s} {json.dumps(row)}", flush=True)
    base = out.get("naive", {})
    for row in out.values():
        if "time_s" in row and "time_s" in base:
            row["time_vs_naive"] = row["time_s"] / base["time_s"]
            if row.get("peak_mib") is not None and base.get("peak_mib"):
                row["peak_vs_naive"] = row["peak_mib"] / base["peak_mib"]
    return out


def bench_mismatch(device: torch.device, model_name: str, prompts: int, new_tokens: int) -> dict:
    from offpolicy.models import build_tiny_model, load_model
    from offpolicy.rollout.hf import HFRolloutEngine
    from offpolicy.rollout.sampling import SamplingConfig
    from offpolicy.rollout.scoring import sequence_logprobs

    model, tok = build_tiny_model(0) if model_name == "tiny-random" else load_model(model_name)
    model = model.to(device)
    engine = HFRolloutEngine(model, tokenizer=tok)  # bfloat16 copy, KV cache
    ids = [tok(f"{i}+{2 * i}=")["input_ids"] for i in range(prompts)]
    cfg = SamplingConfig(max_new_tokens=new_tokens)
    t0 = time.perf_counter()
    ro = engine.generate(ids, cfg, seed=0)
    with torch.no_grad():
        trainer_logp, mask = sequence_logprobs(model, ids, ro.completion_ids, cfg)
    mu = ro.logp.to(trainer_logp.device)[:, : trainer_logp.shape[1]]
    m = mask.bool() & ro.mask.to(mask.device)[:, : mask.shape[1]].bool()
    d = (mu - trainer_logp)[m].double()
    k3 = (d.exp() - 1 - d)  # log r = log μ − log π: r − 1 − log r ≥ 0
    return {"model": model_name, "tokens": int(m.sum()), "mean_abs_dlogp": float(d.abs().mean()),
            "max_abs_dlogp": float(d.abs().max()), "mean_k3": float(k3.mean()),
            "frac_abs_dlogp_gt_0.1": float((d.abs() > 0.1).double().mean()), "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="N=64, H=32, V=1000; the tiny random model")
    ap.add_argument("--n", type=int, default=8192, help="tokens")
    ap.add_argument("--hidden", type=int, nargs="*", default=[2048, 4096])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default="lab", help="the mismatch's model (lab, tiny-random)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default="gpu.json")
    a = ap.parse_args(argv)
    if a.quick:
        a.n, a.hidden, a.vocab, a.model, a.prompts, a.new_tokens, a.reps = 64, [32], 1000, "tiny-random", 4, 8, 1
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; pass --device cpu (with --quick) to test the script")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "python": platform.python_version(),
        "shape": {"n": a.n, "vocab": a.vocab, "hidden": a.hidden, "dtype": a.dtype, "reps": a.reps},
        "kernels": {}, "mismatch": None,
    }
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    for hidden in a.hidden:
        print(f"kernels: N={a.n} H={hidden} V={a.vocab} {a.dtype} on {result['device']}", flush=True)
        result["kernels"][str(hidden)] = bench_kernels(device, a.n, hidden, a.vocab, dtype, a.reps)
    print(f"mismatch: {a.model}, {a.prompts} prompts × {a.new_tokens} tokens, bf16 engine vs fp32", flush=True)
    try:
        result["mismatch"] = bench_mismatch(device, a.model, a.prompts, a.new_tokens)
    except Exception as err:
        result["mismatch"] = {"error": f"{type(err).__name__}: {err}"}
    print(f"  {json.dumps(result['mismatch'])}")
    result["elapsed_s"] = time.perf_counter() - t0
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {a.out} ({result['elapsed_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()

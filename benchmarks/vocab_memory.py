"""Peak memory and time of each method's vocabulary-wide pass at a real vocabulary, against TRL's and verl's own
log-prob computation on the same shapes (CPU, forward + backward, one fresh subprocess per arm).

    python benchmarks/vocab_memory.py                       # N=2048, H=2048, V=151936, bfloat16 (tens of minutes)
    python benchmarks/vocab_memory.py --n 8192 --only trl_head op_dvp
    python benchmarks/vocab_memory.py --quick               # N=256, H=128, V=32000 (seconds; what the test runs)

What each arm runs (h [N, H] hidden states and the lm_head W [V, H], both trained; y [N] the sampled tokens; the
engine's top-K (K = --topk) log-probs and ids for the top-K arms; a random upstream gradient into every output that
the loss reads):

TRL side — the head TRL 1.16's ``GRPOTrainer`` puts on the model (``trl.kernels.ChunkedLogProbFunction``, outputs
log-probs and entropy, as ``add_fused_lm_head(outputs=("log_probs", "entropy"))``; on CPU its torch tile fallback,
on CUDA a Triton kernel on the same tiles), and what ``OffPolicyGRPOTrainer`` adds to or puts in place of it:

* ``trl_head``        TRL's head (the baseline of this side)
* ``op_logp``         offpolicy's fused log-prob kernel (``fused_logp``), for reference
* ``op_entropy``      offpolicy's fused log-prob + entropy (``fused_token_stats``)
* ``op_dvp``          DVP's min-p log-prob over the trainer's safe set (``token_scores`` from hidden states, min-p only:
                      the fused kernel); the adapter runs it *instead of* TRL's head (TRL's head then scores no label)
* ``op_replay``       sampling replay with top-k 50 / top-p 0.95 in vLLM's order (``token_scores``: checkpointed row
                      chunks), instead of TRL's head
* ``op_topk_bound``   TRL's head + the top-K TRM bounds (``token_scores(bounds=True)``, no gradient)
* ``op_center``       score centering as the adapter's update forward runs it with the engine's top-K (no TRM), in
                      place of TRL's head: one ``token_scores`` pass for the log-prob, the entropy, the centre
                      (differentiable) and its drift

verl side — verl 0.9.1's FSDP engine without fused kernels (its default): the model's lm_head gives the logits
[N, V] (in the parameter dtype), ``logprobs_from_logits`` (``logprobs_from_logits_v2`` without flash-attn) and, in
the old-log-prob forward, ``entropy_from_logits``; and the plug-in's engine on those logits:

* ``verl_update``     verl's update forward: logits → log-probs, with gradient (baseline of the update arms)
* ``verl_old``        verl's old-log-prob forward: logits → log-probs + entropy, no gradient (baseline of the bound)
* ``verl_fused``      verl's ``use_fused_kernels`` torch backend (``FusedLinearForPPO``, 512-row chunks), for reference
* ``verl_dvp``        ``verl_update`` + the plug-in's DVP log-prob (``token_scores`` on the logits, min-p) in its place
* ``verl_replay``     ``verl_update`` + the plug-in's sampling replay (top-k 50 / top-p 0.95)
* ``verl_center``     ``verl_update`` + score centering's top-K centre and drift on the logits (``token_scores(
  center=True, drift=True, logp=False)``): verl's own log-prob, centred
* ``verl_topk_bound`` ``verl_old`` + the top-K TRM bounds (``token_scores(bounds=True, logp=False)`` on the logits)

Memory: after the inputs are built (chunk by chunk, no transient peak) and every module is imported, the child
resets the kernel's RSS high-water mark (``/proc/self/clear_refs``), reads its RSS as the baseline, runs forward +
backward once and reports ``VmHWM − baseline``: the extra memory at the peak, gradients ∂h, ∂W included (every
arm must produce them; ``∂W`` alone is V·H·itemsize). Time: wall and process CPU seconds of that run (``--reps R``:
the best of R runs after a warm-up). ``--repeat`` (default 3) runs every arm that many times, alternating, the order
rotated by one each repeat; each arm's ratio is to its side's baseline in the same repeat, reported as the median
and range over repeats (with the load average of each run). The committed results:
``docs/data/benchmarks/vocab_memory.json`` (its ``shape`` says the settings), which ``benchmarks/projection.py``
reads by default.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

TRL_ARMS = ("trl_head", "op_logp", "op_entropy", "op_dvp", "op_replay", "op_topk_bound", "op_center")
VERL_ARMS = ("verl_update", "verl_old", "verl_fused", "verl_dvp", "verl_replay", "verl_center", "verl_topk_bound")
ARMS = TRL_ARMS + VERL_ARMS
BASELINE = {**{a: "trl_head" for a in TRL_ARMS}, **{a: "verl_update" for a in VERL_ARMS},
            "verl_old": "verl_old", "verl_topk_bound": "verl_old"}
MIN_P = 1e-3  # DVP's ρ
TOP_K, TOP_P = 50, 0.95  # the sampling-replay recipe


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Reset the RSS high-water mark (VmHWM) so that building the inputs does not count."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _topk_inputs(n: int, v: int, k: int, gen):
    """K distinct ids per row and sorted log-probs holding ~90 % of the mass (the rest is the tail)."""
    import torch

    ids = torch.empty(n, k, dtype=torch.long)
    for a in range(0, n, 256):  # chunked: no [N, V] transient
        b = min(a + 256, n)
        ids[a:b] = torch.rand(b - a, v, generator=gen).topk(k, -1).indices
    q = torch.softmax(torch.linspace(3.0, 0.0, k), 0) * 0.9
    return q.log().expand(n, k).contiguous(), ids


def _child(arm: str, n: int, h: int, v: int, k: int, dtype_name: str, reps: int, budget: int) -> dict:
    import torch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    gen = torch.Generator().manual_seed(0)
    hid = torch.randn(n, h, generator=gen).to(dtype).requires_grad_()
    w = torch.empty(v, h, dtype=dtype)
    for a in range(0, v, 8192):  # in place, chunked: no transient [V, H] float32 copy
        w[a:a + 8192] = torch.randn(min(8192, v - a), h, generator=gen) * (2 / math.sqrt(h))
    w.requires_grad_()
    y = torch.randint(0, v, (n,), generator=gen)
    coef = torch.randn(n, generator=gen)
    tk_lp = tk_ids = None
    if arm.endswith(("topk_bound", "center")):
        tk_lp, tk_ids = _topk_inputs(n, v, k, gen)
    temperature = torch.ones(n)  # verl hands the engine a per-token temperature; TRL a float

    # every import before the baseline, so that module memory does not count as the arm's (one side's modules only)
    from offpolicy.kernels import fused_logp, fused_token_stats
    from offpolicy.objectives.score_centering import centered_logp

    if arm in TRL_ARMS:
        # TRL_VOCAB_TILE: the vocabulary width of TRL's tiles, as add_fused_lm_head passes it to the function
        # (trl/trainer/utils.py in TRL 1.16.0: _CHUNKED_LOGPROB_CHUNK_SIZE = 32768)
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as TRL_VOCAB_TILE

        from offpolicy.forward_scores import token_scores
        from offpolicy.rollout.sampling import SamplingConfig
    else:
        from verl.utils.experimental.torch_functional import FusedLinearForPPO
        from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits
        from verl.workers.engine.fsdp.transformer_impl import _scale_logits_by_temperature

        from offpolicy.forward_scores import token_scores
        from offpolicy.integrations.verl.settings import parse_settings

        dvp = parse_settings({"sampling": {"min_p": MIN_P}}).sampling.config
        replay = parse_settings({"sampling": {"top_k": TOP_K, "top_p": TOP_P}}).sampling.config

    def trl_head():
        logp, _entropy, *_ = ChunkedLogProbFunction.apply(hid, w, None, y, 1.0, TRL_VOCAB_TILE, None, 1.0,
                                                           ("log_probs", "entropy"))
        return logp

    def verl_logits():
        logits = hid @ w.T  # the HF lm_head in the parameter dtype: verl's output.logits, [N, V]
        return _scale_logits_by_temperature(logits, temperature.unsqueeze(-1), is_unit_temperature=True)

    def forward():
        """The arm's differentiable output [N] (None: no gradient, as the old-log-prob forward)."""
        if arm == "trl_head":
            return trl_head()
        if arm == "op_logp":
            return fused_logp(hid, w, y, memory_budget_bytes=budget)
        if arm == "op_entropy":
            s = fused_token_stats(hid, w, y, want=("logp", "entropy"), memory_budget_bytes=budget)
            return s.logp + s.entropy
        if arm == "op_dvp":
            return token_scores(y, hidden=hid, weight=w, recipe=SamplingConfig(min_p=MIN_P),
                                memory_budget_bytes=budget).logp
        if arm == "op_replay":
            return token_scores(y, hidden=hid, weight=w, recipe=SamplingConfig(top_k=TOP_K, top_p=TOP_P),
                                memory_budget_bytes=budget).logp
        if arm == "op_topk_bound":
            logp = trl_head()
            with torch.no_grad():
                token_scores(y, hidden=hid.detach(), weight=w.detach(), topk=(tk_lp, tk_ids), bounds=True,
                             memory_budget_bytes=budget)
            return logp
        if arm == "op_center":  # the adapter's update forward with the engine's top-K: one pass, no TRL head
            s = token_scores(y, hidden=hid, weight=w, entropy=True, topk=(tk_lp, tk_ids), center=True, drift=True,
                             memory_budget_bytes=budget)
            return centered_logp(s.logp, s.center)
        if arm == "verl_update":
            return logprobs_from_logits(verl_logits(), y)
        if arm in ("verl_old", "verl_topk_bound"):
            with torch.no_grad():
                logits = verl_logits()
                entropy_from_logits(logits)
                logprobs_from_logits(logits, y)
                if arm == "verl_topk_bound":
                    token_scores(y, logits=logits, temperature=temperature, topk=(tk_lp, tk_ids), bounds=True,
                                 logp=False, memory_budget_bytes=budget)
            return None
        if arm == "verl_fused":
            logp, entropy = FusedLinearForPPO(chunk_size=512)(hid, w, y)
            return logp
        if arm in ("verl_dvp", "verl_replay"):
            logits = verl_logits()
            ours = token_scores(y, logits=logits, temperature=temperature, recipe=dvp if arm == "verl_dvp" else replay,
                                memory_budget_bytes=budget).logp
            logprobs_from_logits(logits, y)  # verl's own, computed and then replaced by the plug-in's
            return ours
        if arm == "verl_center":  # as the engine runs it: verl's own log-prob, centred
            logits = verl_logits()
            centre = token_scores(y, logits=logits, temperature=temperature, topk=(tk_lp, tk_ids), center=True,
                                  drift=True, logp=False, memory_budget_bytes=budget).center
            return centered_logp(logprobs_from_logits(logits, y), centre.to(torch.float32))
        raise ValueError(f"unknown arm {arm!r}")

    def step():
        hid.grad = w.grad = None
        out = forward()
        if out is not None:
            (out.float() * coef).sum().backward()

    runs = reps + 1 if reps > 1 else 1  # with several reps, the first is a warm-up
    _reset_peak()
    base = _status_kib("VmRSS")
    walls, cpus = [], []
    for i in range(runs):
        t0, c0 = time.perf_counter(), _cpu_seconds()
        step()
        if runs == 1 or i:
            walls.append(time.perf_counter() - t0)
            cpus.append(_cpu_seconds() - c0)
    peak = _status_kib("VmHWM")
    return {"arm": arm, "extra_mib": (peak - base) / 1024, "wall_s": min(walls), "cpu_s": min(cpus),
            "load": os.getloadavg()[0]}


def _run_child(arm: str, n: int, h: int, v: int, k: int, dtype: str, reps: int, budget_mib: float,
               threads: int) -> dict:
    """One arm in a fresh subprocess: its result, or ``{"arm", "error": reason}``."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", arm, "--n", str(n), "--h", str(h), "--v", str(v),
           "--topk", str(k), "--dtype", dtype, "--reps", str(reps), "--budget-mib", str(budget_mib),
           "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"arm": arm, "error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_arms(arms, n: int, h: int, v: int, k: int, dtype: str, reps: int, budget_mib: float, threads: int,
             repeat: int = 3, echo=print) -> dict[str, dict]:
    """Every arm once per repeat, each in a fresh subprocess, the order rotated by one every repeat; each arm's
    ratios to its side's baseline taken in the same repeat. Returns {arm: summary}: the medians of ``extra_mib``,
    ``wall_s``, ``cpu_s`` (and of ``mem_ratio``, ``wall_ratio``, ``cpu_ratio`` for a non-baseline arm), each with its
    range (``<key>_range`` [min, max]) and the per-repeat results under ``runs``; an arm that failed in any repeat:
    {"arm", "error": reason}."""
    arms = list(arms)
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    errors: dict[str, str] = {}
    for rep in range(repeat):
        order = arms[rep % len(arms):] + arms[:rep % len(arms)]
        done: dict[str, dict] = {}
        for arm in order:
            r = _run_child(arm, n, h, v, k, dtype, reps, budget_mib, threads)
            done[arm] = r
            if "error" in r:
                errors.setdefault(arm, r["error"])
                echo(f"repeat {rep + 1} {arm:16s} not run: {r['error']}")
                continue
            echo(f"repeat {rep + 1} {arm:16s} extra {r['extra_mib']:8.0f} MiB   wall {r['wall_s']:7.2f} s   "
                 f"cpu {r['cpu_s']:7.2f} s   load {r['load']:4.1f}")
        for arm in arms:  # ratios once the whole repeat ran (the baseline may come later in a rotated order)
            r, ref = done[arm], done.get(BASELINE[arm])
            if "error" in r:
                continue
            if ref is not None and "error" not in ref and ref is not r:
                r["mem_ratio"] = r["extra_mib"] / max(ref["extra_mib"], 1e-9)
                r["wall_ratio"] = r["wall_s"] / ref["wall_s"]
                r["cpu_ratio"] = r["cpu_s"] / ref["cpu_s"]
            runs[arm].append(r)
    results: dict[str, dict] = {}
    for arm in arms:
        if arm in errors:
            results[arm] = {"arm": arm, "error": errors[arm]}
            continue
        rs = runs[arm]
        summary: dict = {"arm": arm, "repeats": len(rs), "load": [min(r["load"] for r in rs), max(r["load"] for r in rs)]}
        for key in ("extra_mib", "wall_s", "cpu_s", "mem_ratio", "wall_ratio", "cpu_ratio"):
            if all(key in r for r in rs):
                values = [r[key] for r in rs]
                summary[key] = statistics.median(values)
                summary[f"{key}_range"] = [min(values), max(values)]
        summary["runs"] = rs
        results[arm] = summary
        rel = "" if "mem_ratio" not in summary else (
            f"   vs {BASELINE[arm]}: mem {summary['mem_ratio']:5.2f}x  wall {summary['wall_ratio']:5.2f}x "
            f"[{summary['wall_ratio_range'][0]:.2f}–{summary['wall_ratio_range'][1]:.2f}]  cpu "
            f"{summary['cpu_ratio']:5.2f}x [{summary['cpu_ratio_range'][0]:.2f}–{summary['cpu_ratio_range'][1]:.2f}]")
        echo(f"median of {len(rs)}: {arm:16s} extra {summary['extra_mib']:8.0f} MiB   wall {summary['wall_s']:7.2f} s"
             f"   cpu {summary['cpu_s']:7.2f} s{rel}")
    return results


def main(argv: list[str] | None = None) -> dict[str, dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2048, help="tokens")
    ap.add_argument("--h", type=int, default=2048, help="hidden size")
    ap.add_argument("--v", type=int, default=151936, help="vocabulary")
    ap.add_argument("--quick", action="store_true", help="N=256, H=128, V=32000")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="hidden states and lm_head")
    ap.add_argument("--topk", type=int, default=20, help="K of the engine's top-K log-probs")
    ap.add_argument("--reps", type=int, default=1, help="R > 1 within each child: a warm-up, then the best of R")
    ap.add_argument("--repeat", type=int, default=3, help="repeats of every arm, the order rotated each repeat")
    ap.add_argument("--budget-mib", type=float, default=256.0, help="offpolicy's memory_budget_bytes (MiB)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in each child (0: torch's default)")
    ap.add_argument("--only", nargs="*", default=None, help=f"a subset of {', '.join(ARMS)}")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.h, args.v = 256, 128, 32000
    budget = int(args.budget_mib * 2**20)
    if args.child:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps(_child(args.child, args.n, args.h, args.v, args.topk, args.dtype, args.reps, budget)))
        return {}
    unknown = sorted(set(args.only or ()) - set(ARMS))
    if unknown:
        raise SystemExit(f"--only: unknown arms {unknown}; choose from {', '.join(ARMS)}")
    itemsize = 2 if args.dtype == "bf16" else 4
    print(f"N={args.n} H={args.h} V={args.v} {args.dtype}, forward+backward, top-K={args.topk}, offpolicy budget "
          f"{args.budget_mib:g} MiB, one subprocess per arm, load {os.getloadavg()[0]:.1f}")
    print(f"[N, V] logits in {args.dtype}: {args.n * args.v * itemsize / 2**20:.0f} MiB (float32 "
          f"{args.n * args.v * 4 / 2**20:.0f}); ∂W [V, H]: {args.v * args.h * itemsize / 2**20:.0f} MiB "
          "(in every arm with a gradient)")
    arms = args.only or ARMS
    if args.repeat < 1:
        raise SystemExit("--repeat: at least 1")
    results = run_arms(arms, args.n, args.h, args.v, args.topk, args.dtype, args.reps, args.budget_mib, args.threads,
                       repeat=args.repeat)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": {"n": args.n, "h": args.h, "v": args.v, "dtype": args.dtype, "topk": args.topk,
                                 "budget_mib": args.budget_mib, "threads": args.threads, "repeat": args.repeat,
                                 "reps": args.reps}, "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()

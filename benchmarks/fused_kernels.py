"""Peak memory and time of the chunked fused kernels vs the naive full-logits computation (CPU, forward + backward).

    python benchmarks/fused_kernels.py            # N=2048, H=512, V=151936, float32 (several minutes on 2 cores)
    python benchmarks/fused_kernels.py --quick    # N=256, H=128, V=32000

Each variant runs in its own subprocess so that peak memory is honest: after the inputs are built (without
transient peaks: the stored rollout logits are filled chunk by chunk, and the high-water mark is then reset through
/proc/self/clear_refs) the child reads its current RSS as the baseline, runs forward + backward, and reports
``ru_maxrss − baseline`` — extra memory beyond the inputs. That includes the gradients ∂h, ∂W, which every
variant must produce (``∂W`` alone is V·H·4 bytes); the "beyond grads" column subtracts them. Time: one warm-up, then the best of ``--reps`` runs;
wall time and process CPU time (user + sys; less sensitive to other jobs on a shared machine) are both shown.

Variants: (a) log-prob only — naive, fused (:func:`offpolicy.kernels.fused_logp`), Liger-Kernel's chunked
selective-log-prob path if it imports; (b) log-prob + entropy + DVP (constrained log-prob and retained mass) +
KL(μ‖π) against stored rollout logits [N, V] (exact) or against stored top-k log-probs (lower bound).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time

VARIANTS = ("a_naive", "a_fused", "a_liger", "b_exact_naive", "b_exact_fused", "b_topk_naive", "b_topk_fused")
RHO = math.exp(-13)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    """Reset the kernel's RSS high-water mark (and with it ru_maxrss) so building the inputs does not count."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux / not permitted: inputs are built without transient peaks anyway
        pass


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _child(variant: str, n: int, h: int, v: int, k: int, reps: int, budget: int) -> dict:
    import torch

    torch.manual_seed(0)
    hid = torch.randn(n, h).requires_grad_()
    w = torch.randn(v, h).mul_(2 / math.sqrt(h)).requires_grad_()  # in place: no transient [V, H] copies
    y = torch.randint(0, v, (n,))
    coef = torch.randn(n)
    roll = tk_logp = tk_ids = None
    with torch.no_grad():
        if variant.startswith("b_exact"):
            roll = torch.empty(n, v)
            for a in range(0, n, 64):  # chunked, so building the stored logits leaves no transient peak
                roll[a:a + 64] = hid[a:a + 64] @ w.T + 0.3 * torch.randn(min(64, n - a), v)
        if variant.startswith("b_topk"):
            tk_logp, tk_ids = torch.empty(n, k), torch.empty(n, k, dtype=torch.long)
            for a in range(0, n, 64):
                t = torch.log_softmax(hid[a:a + 64] @ w.T + 0.3 * torch.randn(min(64, n - a), v), -1).topk(k, -1)
                tk_logp[a:a + 64], tk_ids[a:a + 64] = t.values, t.indices

    # Imports before the baseline, so that module memory does not count as the kernel's.
    from offpolicy.kernels import fused_logp, fused_token_stats

    if variant == "a_liger":
        from liger_kernel.chunked_loss.fused_linear_ppo import _ChunkedSelectiveLogProbFunction as Liger

    def naive_b():
        z = hid @ w.T
        lp_all = torch.log_softmax(z, -1)
        p = lp_all.exp()
        logp = lp_all.gather(1, y[:, None])[:, 0]
        entropy = -(p * lp_all).sum(-1)
        safe = (z >= z.detach().amax(-1, keepdim=True) + math.log(RHO)).detach()
        zs = torch.where(safe, z, torch.tensor(float("-inf")))
        minp_logp = z.gather(1, y[:, None])[:, 0] - zs.logsumexp(-1)
        mass = (p * safe).sum(-1)
        if roll is not None:
            lq = torch.log_softmax(roll, -1)
            kl = (lq.exp() * (lq - lp_all)).sum(-1)
        else:
            q = tk_logp.exp()
            q_rest = (1 - q.sum(-1)).clamp(min=0)
            in_ids = torch.zeros_like(safe).scatter(1, tk_ids, True)
            lp_rest = torch.where(in_ids, torch.tensor(float("-inf")), lp_all).logsumexp(-1)
            kl = (q * (tk_logp - lp_all.gather(1, tk_ids))).sum(-1) + q_rest * (q_rest.clamp(min=1e-30).log() - lp_rest)
        return logp + entropy + minp_logp + mass + kl

    def step():
        hid.grad = w.grad = None
        if variant == "a_naive":
            out = torch.log_softmax(hid @ w.T, -1).gather(1, y[:, None])[:, 0]
        elif variant == "a_fused":
            out = fused_logp(hid, w, y, memory_budget_bytes=budget)
        elif variant == "a_liger":
            out = Liger.apply(hid, w, y, None, 1.0, 4096)
        elif variant.endswith("naive"):
            out = naive_b()
        else:
            s = fused_token_stats(hid, w, y, want=("logp", "entropy", "minp", "kl"), min_p_rho=RHO,
                                  rollout_logits=roll, rollout_topk_logp=tk_logp, rollout_topk_ids=tk_ids,
                                  memory_budget_bytes=budget)
            out = s.logp + s.entropy + s.minp_logp + s.minp_mass + s.kl
        (out * coef).sum().backward()

    _reset_peak()
    base = _rss_bytes()
    walls, cpus = [], []
    for i in range(reps + 1):
        t0, c0 = time.perf_counter(), _cpu_seconds()
        step()
        if i:  # the first run is a warm-up
            walls.append(time.perf_counter() - t0)
            cpus.append(_cpu_seconds() - c0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"variant": variant, "extra_mb": (peak - base) / 2**20, "wall_s": min(walls), "cpu_s": min(cpus)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N=256, H=128, V=32000")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--topk", type=int, default=20)
    ap.add_argument("--budget-mib", type=float, default=32.0, help="memory_budget_bytes of the fused kernels (MiB)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in each child (0: torch default)")
    ap.add_argument("--only", nargs="*", default=None, help="subset of variants")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    n, h, v = (256, 128, 32000) if args.quick else (2048, 512, 151936)
    budget = int(args.budget_mib * 2**20)
    if args.child:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps(_child(args.child, n, h, v, args.topk, args.reps, budget)))
        return

    print(f"N={n} H={h} V={v} float32, forward+backward, top-k K={args.topk}, fused budget {args.budget_mib:g} MiB, "
          f"reps={args.reps} (best), one subprocess per variant")
    print(f"naive [N,V] fp32 logits alone: {n * v * 4 / 2**20:.0f} MiB; grad of W [V,H]: {v * h * 4 / 2**20:.0f} MiB "
          "(counted in every variant)")
    results = {}
    for variant in args.only or VARIANTS:
        cmd = [sys.executable, __file__, "--child", variant, "--reps", str(args.reps), "--topk", str(args.topk),
               "--budget-mib", str(args.budget_mib), "--threads", str(args.threads)] + (["--quick"] if args.quick else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            reason = (proc.stderr.strip().splitlines() or ["unknown error"])[-1]
            print(f"{variant:15s} not run: {reason}")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results[variant] = r
        ref = results.get(variant.replace("fused", "naive").replace("liger", "naive"))
        rel = ""
        if ref and ref is not r:
            rel = (f"  mem {r['extra_mb'] / max(ref['extra_mb'], 1e-9):6.1%} of naive   "
                   f"wall {r['wall_s'] / ref['wall_s']:.2f}x   cpu {r['cpu_s'] / ref['cpu_s']:.2f}x")
        grads = (v * h + n * h) * 4 / 2**20
        print(f"{variant:15s} extra {r['extra_mb']:7.0f} MiB (beyond grads {r['extra_mb'] - grads:6.0f})   "
              f"wall {r['wall_s']:6.2f} s   cpu {r['cpu_s']:6.2f} s{rel}", flush=True)


if __name__ == "__main__":
    main()

"""Core-path cost: offpolicy against verl's rollout-correction helper (same work) and, compiled, against the figure the
README gave before the one-implementation-per-method refactor; a plain hand-written PPO loss as context.

    python benchmarks/core.py                    # B=64, T=8192, eager, one thread: the verl comparison and the parts
    python benchmarks/core.py --compile          # + the compiled paths
    python benchmarks/core.py --quick            # B=8, T=1024

1. **Against verl** (eager; skipped with a note when verl is not installed): verl 0.9's
   ``compute_rollout_correction_and_rejection_mask`` with token TIS at 2 (``rollout_is="token"``) and a two-sided
   geometric rejection (``rollout_rs="seq_mean_k1"``, ``"0.5_2.0"``), which also computes verl's mismatch metrics and
   returns every metric as a float; against ``chain(tis(upper=2), geo_mask(lower=0.5, upper=2))`` + every
   ``offpolicy_metrics`` under verl's names, synced to floats the same way. The kept tokens are checked equal first.
   Target: ≤ 0.7× verl's time.
2. **Compiled** (``--compile``): the full path — a chain of six corrections (tis, geometric mis, icepop, opsm, veto,
   trm on k-estimators) + every ``offpolicy_metrics`` + ``policy_loss`` forward and backward — compiled, as a
   multiple of the eager plain PPO loss measured in the same run (a ratio travels between machines, milliseconds do
   not). Target: ≤ 1.2× the ratio the README gave before the refactor (1.27–1.40×, so ≤ 1.68×).
3. **Context**: plain PPO-clip (eager and compiled) and the eager full path and its parts, as multiples of it; no
   target. ``--count`` also counts the kernels an eager step launches (what an eager GPU step pays at this size).

Timings are medians of process CPU time over interleaved repeats (A B C A B C …), so drift and other jobs on a shared
machine hit every step alike; compare ratios from one run, not times across runs. glibc is told to keep freed memory
(:func:`keep_freed_memory`, the regime of a caching allocator) unless ``--system-malloc``.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import statistics
import time

import torch

from offpolicy import (
    LogProbBatch,
    chain,
    geo_mask,
    icepop,
    mis,
    offpolicy_metrics,
    opsm,
    policy_loss,
    tis,
    trm,
    veto,
)

README_COMPILED_VS_EAGER_PLAIN = (1.27, 1.40)  # the README's compiled full path / eager plain PPO before the refactor
COMPILED_TARGET = 1.2 * README_COMPILED_VS_EAGER_PLAIN[1]
VERL_TARGET = 0.7


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory instead of returning it to the OS (mallopt; Linux/glibc only).

    Why: with glibc's defaults every fresh 2 MiB [B, T] buffer is page-faulted in again, which costs about as much as
    the arithmetic and varies 2–3× run to run on a shared VM — in every path alike. A caching allocator (PyTorch's
    CUDA allocator, jemalloc/tcmalloc) does not pay it; this puts glibc in the same regime.
    """
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return False
    libc = ctypes.CDLL(libc_name)
    if not hasattr(libc, "mallopt"):
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    return bool(
        libc.mallopt(m_mmap_threshold, 32 * 2**20)  # glibc's maximum: [B, T] buffers come from the heap
        and libc.mallopt(m_trim_threshold, 2**30)  # and freed heap memory is not handed back
        and libc.mallopt(m_top_pad, 64 * 2**20)
    )


def make_inputs(B: int, T: int, device: str):
    g = torch.Generator(device="cpu").manual_seed(0)
    old = -torch.rand(B, T, generator=g) * 4
    rollout = old + 0.05 * torch.randn(B, T, generator=g)
    logp = old + 0.01 * torch.randn(B, T, generator=g)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.randn(B, generator=g)
    return [x.to(device) for x in (logp, old, rollout, adv, mask)]


# -- the paths -----------------------------------------------------------------------------------------------------


def plain_ppo(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Context: PPO clip (ε = 0.2), token mean, no robustness, no metrics."""
    ratio = torch.exp(logp - old)
    a = adv.unsqueeze(-1)
    per_token = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
    m = mask.float()
    return (per_token * m).sum() / m.sum()


PARTS = {
    "tis": tis(upper=2.0),
    "mis": mis(level="geometric", lower=0.5, upper=2.0),
    "icepop": icepop(),
    "opsm": opsm(delta=1e-4),
    "veto": veto(),
    "trm": trm(),
}
CORRECTION = chain(*PARTS.values())
TWO = chain(PARTS["icepop"], PARTS["opsm"])  # a typical production chain
VERL_LIKE = chain(tis(upper=2.0), geo_mask(lower=0.5, upper=2.0))  # verl: rollout_is=token, rollout_rs=seq_mean_k1


def _full_path(correction, logp, old, rollout, adv, mask):
    batch = LogProbBatch(logp=logp, mask=mask, old_logp=old, rollout_logp=rollout, advantages=adv)
    result = correction(batch)
    metrics = offpolicy_metrics(old, rollout, mask, result)
    loss, loss_metrics = policy_loss(batch, correction=result)
    return loss, {**metrics, **loss_metrics}


def full_path(logp, old, rollout, adv, mask):
    return _full_path(CORRECTION, logp, old, rollout, adv, mask)


def full_path_two(logp, old, rollout, adv, mask):
    return _full_path(TWO, logp, old, rollout, adv, mask)


def ours_as_verl(old, rollout, adv, mask):
    """verl's rollout correction done by offpolicy: weights, keep, and every metric as a Python float."""
    batch = LogProbBatch(logp=old, mask=mask, old_logp=old, rollout_logp=rollout, advantages=adv)
    result = VERL_LIKE(batch)
    metrics = {f"rollout_corr/{k}": v for k, v in result.metrics.items()}
    metrics.update(offpolicy_metrics(old, rollout, mask, result, naming="verl"))
    return result.weights, result.keep, {k: float(v) for k, v in metrics.items()}


def verl_rollout_correction(old, rollout, mask_float):
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    return compute_rollout_correction_and_rejection_mask(
        old, rollout, mask_float, rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1",
        rollout_rs_threshold="0.5_2.0")


# -- timing --------------------------------------------------------------------------------------------------------


def measure(steps: dict, repeats: int, warmup: int, device: str) -> dict[str, float]:
    """Median process-CPU seconds per step (or wall seconds on a GPU), the steps run interleaved."""

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    clock = time.perf_counter if device.startswith("cuda") else time.process_time
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            sync()
            t0 = clock()
            step()
            sync()
            times[name].append(clock() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


_VIEW_OPS = frozenset({
    "view", "_unsafe_view", "as_strided", "expand", "unsqueeze", "squeeze", "detach", "alias", "t", "select", "slice",
    "reshape", "_reshape_alias",
})  # metadata-only: no kernel runs


def count_kernels(step, full_shape: torch.Size) -> tuple[int, int]:
    """(operations that run a kernel, of which with a ``full_shape`` [B, T] output) in one eager ``step()``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = self.full = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ not in _VIEW_OPS:
                self.ops += 1
                self.full += isinstance(out, torch.Tensor) and out.shape == full_shape
            return out

    with Counter() as counter:
        step()
    return counter.ops, counter.full


def backward_step(fn, logp0, *inputs):
    """A step: ``fn(logp, *inputs)`` on a fresh leaf logp, then backward of its loss (the first item it returns)."""

    def step():
        out = fn(logp0.detach().requires_grad_(True), *inputs)
        (out[0] if isinstance(out, tuple) else out).backward()

    return step


def verl_installed() -> bool:
    try:
        import verl.trainer.ppo.rollout_corr_helper  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (B=8, T=1024)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--compile", action="store_true", help="also time the compiled paths (default backend)")
    p.add_argument("--count", action="store_true", help="count the kernels each eager step launches")
    p.add_argument("--system-malloc", action="store_true", help="keep glibc's defaults (fresh buffers page-fault)")
    args = p.parse_args()
    malloc = "glibc defaults" if args.system_malloc else ("caching (mallopt)" if keep_freed_memory() else "system")
    torch.set_num_threads(args.threads)
    B = args.batch or (8 if args.quick else 64)
    T = args.tokens or (1024 if args.quick else 8192)
    repeats = args.repeats or (30 if args.quick else 11)
    logp0, old, rollout, adv, mask = make_inputs(B, T, args.device)
    print(f"device={args.device} threads={torch.get_num_threads()} B={B} T={T} repeats={repeats} malloc={malloc}")

    # 1. the same work as verl's helper
    if verl_installed():
        import verl

        mask_float = mask.float()
        _, verl_mask, _ = verl_rollout_correction(old, rollout, mask_float)
        _, keep, _ = ours_as_verl(old, rollout, adv, mask)
        assert torch.equal(keep, verl_mask.bool()), "the kept tokens differ from verl's"
        t = measure({"verl": lambda: verl_rollout_correction(old, rollout, mask_float),
                     "ours": lambda: ours_as_verl(old, rollout, adv, mask)}, repeats, 2, args.device)
        ratio = t["ours"] / t["verl"]
        print(f"\nrollout correction (token TIS + geometric two-sided rejection + mismatch metrics, as floats):\n"
              f"  verl {verl.__version__} compute_rollout_correction_and_rejection_mask {t['verl'] * 1e3:8.2f} ms\n"
              f"  offpolicy (same kept tokens, same metrics)               {t['ours'] * 1e3:8.2f} ms\n"
              f"  ratio offpolicy / verl: {ratio:.2f}x (target <= {VERL_TARGET}x: {'met' if ratio <= VERL_TARGET else 'NOT met'})")
    else:
        print("\nverl is not installed: the comparison with its rollout-correction helper is skipped "
              "(pip install --no-deps verl==0.9.1 plus ray, tensordict, omegaconf, codetiming, orjson)")

    # 2. + 3. the full path, compiled and eager, as multiples of the eager plain PPO loss
    steps = {
        "plain": backward_step(plain_ppo, logp0, old, adv, mask),
        "full": backward_step(full_path, logp0, old, rollout, adv, mask),
        "full2": backward_step(full_path_two, logp0, old, rollout, adv, mask),
    }
    fixed = CORRECTION(LogProbBatch(logp=logp0, mask=mask, old_logp=old, rollout_logp=rollout, advantages=adv))
    steps["chain"] = lambda: CORRECTION(LogProbBatch(logp=logp0, mask=mask, old_logp=old, rollout_logp=rollout,
                                                     advantages=adv))
    steps["metrics"] = lambda: offpolicy_metrics(old, rollout, mask, fixed)

    def loss_step():
        logp = logp0.detach().requires_grad_(True)
        batch = LogProbBatch(logp=logp, mask=mask, old_logp=old, rollout_logp=rollout, advantages=adv)
        policy_loss(batch, correction=fixed)[0].backward()

    steps["loss"] = loss_step
    if args.compile:
        steps["plain_c"] = backward_step(torch.compile(plain_ppo), logp0, old, adv, mask)
        steps["full_c"] = backward_step(torch.compile(full_path), logp0, old, rollout, adv, mask)
        steps["full2_c"] = backward_step(torch.compile(full_path_two), logp0, old, rollout, adv, mask)
    t = measure(steps, repeats, warmup=2, device=args.device)
    labels = {
        "plain": "plain PPO, eager (fwd+bwd): the unit",
        "full": "full path, eager (6 corrections + metrics + loss)",
        "chain": "  of which: 6-correction chain",
        "metrics": "  of which: offpolicy_metrics",
        "loss": "  of which: policy_loss (fwd+bwd)",
        "full2": "icepop + opsm path, eager",
        "plain_c": "plain PPO, compiled",
        "full_c": "full path, compiled",
        "full2_c": "icepop + opsm path, compiled",
    }
    unit = t["plain"]
    print(f"\n{'':52s} {'ms':>8s} {'x eager plain PPO':>18s}")
    for k, v in t.items():
        print(f"{labels[k]:52s} {v * 1e3:8.2f} {v / unit:17.2f}x")
    if args.compile:
        ratio = t["full_c"] / unit
        low, high = README_COMPILED_VS_EAGER_PLAIN
        print(f"\ncompiled full path / eager plain PPO: {ratio:.2f}x; the README before the refactor: {low}–{high}x; "
              f"target <= {COMPILED_TARGET:.2f}x (1.2 x {high}): {'met' if ratio <= COMPILED_TARGET else 'NOT met'}")
    if args.count:
        (n0, f0), (n1, f1), (n2, f2) = (count_kernels(step, logp0.shape) for step in (
            steps["plain"], steps["full"], steps["full2"]))
        print(f"kernels per eager step (of which on [B, T]): plain {n0} ({f0}), full path {n1} ({f1}), "
              f"icepop + opsm {n2} ({f2})")


if __name__ == "__main__":
    main()

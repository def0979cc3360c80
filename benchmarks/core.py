"""Core-path overhead: the full offpolicy step vs a minimal hand-written PPO loss, forward + backward.

    python benchmarks/core.py            # B=64, T=8192
    python benchmarks/core.py --quick    # B=8,  T=1024
    python benchmarks/core.py --device cuda --compile

Baseline: PPO-clip, token mean, written out by hand in eight lines (what a training loop does without offpolicy).
Full path: a chain of every correction (tis, geometric mis, icepop, opsm, veto, trm on k-estimators) + all
``offpolicy_metrics`` (given the ``CorrectionResult``, as the README recommends, so they reuse its cleaned
log-ratio) + ``policy_loss`` forward and backward, on the same tensors (float32 logp with grad).

Also times the same full path with a typical two-correction chain (icepop + opsm), and (eager) each part and each
correction on its own. Every step builds a fresh ``LogProbBatch``: corrections memoise shared terms on the batch, so
re-using one batch would time a cache hit.

Prints the median time of each over several repeats after warm-up, and the ratio (target ≤ 1.5×). Timings on a
shared machine are noisy: compare ratios from one run, not absolute times across runs. By default glibc is told to
keep freed memory (see :func:`keep_freed_memory`): otherwise every fresh [B, T] buffer — the baseline's too — is
page-faulted in again, which costs about as much as the arithmetic and varies 2–3× run to run on a shared VM.
``--system-malloc`` measures with glibc's defaults. ``--compile`` compiles both paths and also times the eager
baseline (what a user who compiles only the offpolicy part compares against).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import statistics
import time

import torch

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import chain
from offpolicy.corrections.importance import icepop, mis, tis
from offpolicy.corrections.sequence_masks import opsm, veto
from offpolicy.corrections.trust_region import trm
from offpolicy.losses import policy_loss
from offpolicy.metrics import offpolicy_metrics


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory instead of returning it to the OS (mallopt; Linux/glibc only).

    Why: with glibc's defaults every fresh 2 MiB [B, T] buffer is page-faulted in again, which costs about as much as
    the arithmetic and varies run to run by 2–3× on a shared VM — in the baseline and in the full path alike. A
    caching allocator (PyTorch's CUDA allocator, jemalloc/tcmalloc on CPU) does not pay it; this puts glibc in the
    same regime so the ratio measures the computation. ``--system-malloc`` measures with glibc's defaults instead.
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


def plain_ppo(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The baseline: PPO clip (ε = 0.2), token mean, no robustness, no metrics."""
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


def _full_path(correction, logp, old, rollout, adv, mask):
    batch = LogProbBatch(logp=logp, mask=mask, old_logp=old, rollout_logp=rollout, advantages=adv)
    result = correction(batch)
    metrics = offpolicy_metrics(old, rollout, mask, result)
    loss, loss_metrics = policy_loss(batch, correction=result)
    return loss, {**metrics, **loss_metrics}


def full_path(logp: torch.Tensor, old: torch.Tensor, rollout: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor):
    return _full_path(CORRECTION, logp, old, rollout, adv, mask)


def full_path_two(logp: torch.Tensor, old: torch.Tensor, rollout: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor):
    return _full_path(TWO, logp, old, rollout, adv, mask)


def make_inputs(B: int, T: int, device: str):
    g = torch.Generator(device="cpu").manual_seed(0)
    old = -torch.rand(B, T, generator=g) * 4
    rollout = old + 0.05 * torch.randn(B, T, generator=g)
    logp = old + 0.01 * torch.randn(B, T, generator=g)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.randn(B, generator=g)
    return [x.to(device) for x in (logp, old, rollout, adv, mask)]


def measure(steps: dict, repeats: int, warmup: int, device: str) -> dict[str, tuple[float, float]]:
    """Median (wall, process-CPU) seconds per step. Steps run interleaved (A B C A B C …) so that drift and other
    jobs on a shared machine hit every step alike; process CPU time is also robust to other processes stealing cores."""

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    for _ in range(warmup):
        for step in steps.values():
            step()
    wall: dict[str, list[float]] = {k: [] for k in steps}
    cpu: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            sync()
            w0, c0 = time.perf_counter(), time.process_time()
            step()
            sync()
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in steps}


_VIEW_OPS = frozenset({
    "view", "_unsafe_view", "as_strided", "expand", "unsqueeze", "squeeze", "detach", "alias", "t", "select", "slice",
    "reshape", "_reshape_alias",
})  # metadata-only: no kernel runs


def count_kernels(step, full_shape: torch.Size) -> tuple[int, int]:
    """(operations that run a kernel, of which with a ``full_shape`` [B, T] output) in one eager ``step()``, forward
    and backward.

    Why: on a GPU, eager PyTorch launches one kernel per operation, and at these sizes a launch (~5 µs) costs more than
    the arithmetic of a [64, 8192] pass, so the launch count — not the CPU time — is what an eager GPU step pays.
    This count does not depend on the machine; ``torch.compile`` (CUDA graphs, fused Triton kernels) removes it.
    """
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (B=8, T=1024)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile both paths (default backend)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--per-correction", action="store_true", help="also time each correction alone (eager)")
    p.add_argument("--system-malloc", action="store_true", help="keep glibc's defaults (fresh buffers page-fault)")
    p.add_argument("--no-count", action="store_true", help="skip counting the kernels each step launches")
    args = p.parse_args()
    malloc = "glibc defaults" if args.system_malloc else ("caching (mallopt)" if keep_freed_memory() else "system")
    if args.threads:
        torch.set_num_threads(args.threads)

    B = args.batch or (8 if args.quick else 64)
    T = args.tokens or (1024 if args.quick else 8192)
    repeats = args.repeats or (30 if args.quick else 11)
    logp0, old, rollout, adv, mask = make_inputs(B, T, args.device)

    base_fn = torch.compile(plain_ppo) if args.compile else plain_ppo
    full_fn = torch.compile(full_path) if args.compile else full_path
    two_fn = torch.compile(full_path_two) if args.compile else full_path_two

    def backward_step(fn, *inputs):
        """A step: ``fn(logp, *inputs)`` on a fresh leaf logp, then backward of its loss (the first item it returns)."""

        def step():
            out = fn(logp0.detach().requires_grad_(True), *inputs)
            (out[0] if isinstance(out, tuple) else out).backward()

        return step

    base_step = backward_step(base_fn, old, adv, mask)
    full_step = backward_step(full_fn, old, rollout, adv, mask)
    two_step = backward_step(two_fn, old, rollout, adv, mask)

    # the parts of the full path, each timed on its own (eager), to show where the time goes
    def fresh_batch() -> LogProbBatch:  # a new batch each call: the corrections' memo must not carry over
        return LogProbBatch(logp=logp0.detach().requires_grad_(True), mask=mask, old_logp=old, rollout_logp=rollout, advantages=adv)

    fixed_result = CORRECTION(fresh_batch())

    def chain_step():
        CORRECTION(fresh_batch())

    def two_chain_step():
        TWO(fresh_batch())

    def metrics_step():
        offpolicy_metrics(old, rollout, mask, fixed_result)

    def loss_step():
        logp = logp0.detach().requires_grad_(True)
        batch = LogProbBatch(logp=logp, mask=mask, old_logp=old, rollout_logp=rollout, advantages=adv)
        policy_loss(batch, correction=fixed_result)[0].backward()

    eager_base_step = backward_step(plain_ppo, old, adv, mask)

    steps = {"plain": base_step, "full": full_step, "full2": two_step}
    if args.compile:  # what a user who compiles only the offpolicy part compares against: their eager PPO loss
        steps["plain_eager"] = eager_base_step
    else:
        steps.update({"chain": chain_step, "metrics": metrics_step, "loss": loss_step, "chain2": two_chain_step})
        if args.per_correction:
            for name, c in PARTS.items():
                steps[name] = lambda c=c: c(fresh_batch())
    t = measure(steps, repeats, warmup=2, device=args.device)

    print(f"device={args.device} threads={torch.get_num_threads()} B={B} T={T} compile={args.compile} repeats={repeats} "
          f"malloc={malloc}")
    print(f"{'':44s} {'wall ms':>9s} {'cpu ms':>9s} {'x plain (wall)':>15s} {'x plain (cpu)':>14s}")
    labels = {
        "plain": "plain PPO (fwd+bwd, baseline)",
        "plain_eager": "plain PPO, eager (not compiled)",
        "full": "offpolicy full path (fwd+bwd)",
        "chain": "  of which: 6-correction chain",
        "metrics": "  of which: offpolicy_metrics",
        "loss": "  of which: policy_loss (fwd+bwd)",
        "full2": "offpolicy path, icepop+opsm chain (fwd+bwd)",
        "chain2": "  of which: icepop+opsm chain",
        **{name: f"  correction alone: {name}" for name in PARTS},
    }
    wb, cb = t["plain"]
    for k, (w, c) in t.items():
        print(f"{labels[k]:44s} {w * 1e3:9.2f} {c * 1e3:9.2f} {w / wb:14.2f}x {c / max(cb, 1e-9):13.2f}x")
    print(
        f"ratio full / plain: {t['full'][0] / wb:.2f}x wall, {t['full'][1] / max(cb, 1e-9):.2f}x cpu (target <= 1.5x); "
        f"with the icepop+opsm chain: {t['full2'][0] / wb:.2f}x wall, {t['full2'][1] / max(cb, 1e-9):.2f}x cpu; "
        "shared machines are noisy: compare within one run"
    )
    if "plain_eager" in t:
        we, ce = t["plain_eager"]
        print(f"compiled full path / eager plain PPO: {t['full'][0] / we:.2f}x wall, {t['full'][1] / max(ce, 1e-9):.2f}x cpu")
    if not args.no_count:  # eager launches per step: what an eager GPU step pays (see count_kernels)
        (n0, f0), (n1, f1), (n2, f2) = (
            count_kernels(step, logp0.shape) for step in (
                eager_base_step,
                backward_step(full_path, old, rollout, adv, mask),
                backward_step(full_path_two, old, rollout, adv, mask),
            )
        )
        print(f"kernels per eager step (of which on [B, T]): plain {n0} ({f0}), full path {n1} ({f1}) = {n1 / n0:.1f}x, "
              f"icepop+opsm {n2} ({f2}) = {n2 / n0:.1f}x; an eager GPU step is launch-bound at these sizes")


if __name__ == "__main__":
    main()

"""Core-path overhead: the full offpolicy step vs a minimal hand-written PPO loss, forward + backward.

    python benchmarks/core.py            # B=64, T=8192
    python benchmarks/core.py --quick    # B=8,  T=1024
    python benchmarks/core.py --device cuda --compile

Baseline: PPO-clip, token mean, written out by hand in eight lines (what a training loop does without offpolicy).
Full path: a chain of every correction (tis, geometric mis, icepop, opsm, veto, trm on k-estimators) + all
``offpolicy_metrics`` + ``policy_loss`` forward and backward, on the same tensors (float32 logp with grad).

Prints the median time of each over several repeats after warm-up, and the ratio (target ≤ 1.5×). Timings on a
shared machine are noisy: compare ratios from one run, not absolute times across runs.
"""

from __future__ import annotations

import argparse
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


def plain_ppo(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The baseline: PPO clip (ε = 0.2), token mean, no robustness, no metrics."""
    ratio = torch.exp(logp - old)
    a = adv.unsqueeze(-1)
    per_token = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
    m = mask.float()
    return (per_token * m).sum() / m.sum()


CORRECTION = chain(
    tis(upper=2.0),
    mis(level="geometric", lower=0.5, upper=2.0),
    icepop(),
    opsm(delta=1e-4),
    veto(),
    trm(),
)


def full_path(logp: torch.Tensor, old: torch.Tensor, rollout: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor):
    batch = LogProbBatch(logp=logp, mask=mask, old_logp=old, rollout_logp=rollout, advantages=adv)
    result = CORRECTION(batch)
    metrics = offpolicy_metrics(old, rollout, mask, result.coefficient)
    loss, loss_metrics = policy_loss(batch, correction=result)
    return loss, {**metrics, **loss_metrics}


def make_inputs(B: int, T: int, device: str):
    g = torch.Generator(device="cpu").manual_seed(0)
    old = -torch.rand(B, T, generator=g) * 4
    rollout = old + 0.05 * torch.randn(B, T, generator=g)
    logp = old + 0.01 * torch.randn(B, T, generator=g)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.randn(B, generator=g)
    return [x.to(device) for x in (logp, old, rollout, adv, mask)]


def timeit(step, repeats: int, warmup: int, device: str) -> float:
    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (B=8, T=1024)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile both paths (default backend)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    B = args.batch or (8 if args.quick else 64)
    T = args.tokens or (1024 if args.quick else 8192)
    repeats = args.repeats or (20 if args.quick else 7)
    logp0, old, rollout, adv, mask = make_inputs(B, T, args.device)

    base_fn = torch.compile(plain_ppo) if args.compile else plain_ppo
    full_fn = torch.compile(full_path) if args.compile else full_path

    def base_step():
        logp = logp0.detach().requires_grad_(True)
        base_fn(logp, old, adv, mask).backward()

    def full_step():
        logp = logp0.detach().requires_grad_(True)
        loss, metrics = full_fn(logp, old, rollout, adv, mask)
        loss.backward()

    # sanity: with no correction dropping anything, both losses agree on what they share
    t_base = timeit(base_step, repeats, warmup=2, device=args.device)
    t_full = timeit(full_step, repeats, warmup=2, device=args.device)
    # second round, interleaved order, to average out drift on a shared machine
    t_full2 = timeit(full_step, repeats, warmup=0, device=args.device)
    t_base2 = timeit(base_step, repeats, warmup=0, device=args.device)
    t_base, t_full = min(t_base, t_base2), min(t_full, t_full2)

    print(f"device={args.device} threads={torch.get_num_threads()} B={B} T={T} compile={args.compile} repeats={repeats}")
    print(f"plain PPO (fwd+bwd)                    {t_base * 1e3:9.2f} ms")
    print(f"offpolicy full path (6 corr + metrics)  {t_full * 1e3:9.2f} ms")
    print(f"ratio full / plain                      {t_full / t_base:9.2f}x   (target <= 1.5x)")


if __name__ == "__main__":
    main()

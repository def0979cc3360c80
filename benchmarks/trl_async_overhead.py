"""Each correction's cost inside TRL 1.16's asynchronous step: TRL's own ``AsyncGRPOTrainer`` (its inline PPO-clip on
π_θ/μ: the vanilla arm) against ``OffPolicyAsyncGRPOTrainer`` with each method, the arms alternating in one process.

    PYTHONPATH=.:src python benchmarks/trl_async_overhead.py [--model tiny|lab] [--repeat 3] [--steps 4] [--only tis m2po]

Every arm trains the same embedded model (``tiny`` or ``lab``, loaded afresh from its folder) with the same
``AsyncGRPOConfig`` through TRL's own ``train()``, fed by the test kit's stand-in rollout worker
(``offpolicy_testkit.async_trl.PerturbedRolloutWorker``: a copy of the policy sampling with seeded Gaussian noise on
its logits, so μ ≠ π_θ and every correction has something to correct; every completion exactly ``--new-tokens`` long)
and its weight copy, with the packed tree attention in SDPA (no vLLM, no GPU). So the same number of samples and
tokens goes through every arm's step, and the sampling, which runs inside TRL's weight sync, is outside the timed
step: the step is TRL's ``training_step`` (the packed forward, the loss and its metrics, the backward) and the
optimiser step, timed from ``on_step_begin`` to ``on_step_end``, plus the weight transfer that follows it (TRL's
``_sync_weight``: the copy into the stand-in engine, and the check where it is on) less the stand-in's sampling inside
it. ``sync_check`` is off in every arm but ``sync_check``, which is ``bypass`` (ours, no correction) with the check of
every transfer on: its cost over ``bypass`` is the check's.

Seconds per optimiser step are the mean over ``--steps`` steps after one of warm-up, in process CPU time
(``process_time``; one torch thread, so what the step computes, little moved by the other processes of a shared
machine) and in wall time. One repeat runs every arm once, in an order rotated by one each repeat; an arm's ratio is
its step time over the vanilla arm's in the same repeat; the table gives the median and range over repeats, with the
load average (and ``uptime`` before and after) beside it. ``--json`` writes every repeat and the table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import statistics
import subprocess
import tempfile
import time
import warnings
from collections import defaultdict
from typing import Any

import torch

GROUP = 4  # completions per prompt
LOGLINEAR = {"name": "decoupled", "proximal": "loglinear"}
ARMS: dict[str, dict[str, Any] | None] = {
    "vanilla": None,  # TRL's AsyncGRPOTrainer: its own PPO-clip on π_θ/μ
    "bypass": {},  # ours without correction or objective: TRL's loss through offpolicy.policy_loss, and its metrics
    "tis": {"correction": "tis"},
    "icepop": {"correction": "icepop"},
    "decoupled_loglinear": {"correction": "tis", "objective": LOGLINEAR},  # AReaL's decoupled PPO, log-linear π_prox
    "m2po": {"correction": "m2po"},
    "cispo": {"objective": "cispo"},
    "sync_check": {"sync_check": "error"},  # bypass + the check after every weight transfer
}


def _prompts(n: int) -> list[tuple[str, str]]:
    from offpolicy.tasks import get_task

    return [(e.prompt, e.answer) for e in get_task("arithmetic").examples(n, seed=0)]


def _reward(text: str, answer: str) -> float:
    return float(text.strip().startswith(answer)) + 0.1 * (len(text) % 3)  # varies: a group's advantages are not 0


def run_arm(arm: str, model_dir: str, engine: torch.nn.Module, tok: Any, *, batch: int, new_tokens: int, steps: int,
            noise_std: float, out_dir: str) -> dict[str, float]:
    """Seconds per optimiser step of one arm, means over the ``steps`` after one warm-up step: ``{"cpu", "wall"}``."""
    import datasets
    from offpolicy_testkit.async_trl import (
        CopyWeightTransfer,
        PerturbedRolloutWorker,
        cpu_constructor,
        cpu_tree_attention,
    )
    from transformers import TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from offpolicy.integrations.trl import OffPolicyAsyncGRPOTrainer

    prompts = _prompts(64)
    worker = PerturbedRolloutWorker(engine, tok, prompts, _reward, num_generations=GROUP, max_new_tokens=new_tokens,
                                    samples_per_version=batch, noise_std=noise_std, seed=0)
    args = AsyncGRPOConfig(output_dir=out_dir, per_device_train_batch_size=batch, num_generations=GROUP,
                           max_completion_length=new_tokens, max_steps=1 + steps, report_to=[], use_cpu=True,
                           bf16=False, logging_steps=10_000, save_strategy="no", token_budget=0, learning_rate=1e-4,
                           seed=0, disable_tqdm=True)
    times: list[tuple[float, float]] = []
    mark: list[tuple[float, float]] = []

    class Steps(TrainerCallback):  # added before TRL's own callbacks: on_step_end runs before its weight sync
        def on_step_begin(self, *a, **k):
            mark[:] = [(time.process_time(), time.perf_counter())]

        def on_step_end(self, *a, **k):
            c0, w0 = mark[0]
            times.append((time.process_time() - c0, time.perf_counter() - w0))

    kw = ARMS[arm]
    cls = AsyncGRPOTrainer if kw is None else OffPolicyAsyncGRPOTrainer
    extra = {} if kw is None else {"sync_check": None, **kw}
    with cpu_constructor():
        trainer = cls(model=model_dir, reward_funcs=lambda **k: [0.0], args=args, processing_class=tok,
                      train_dataset=datasets.Dataset.from_list([{"prompt": p} for p, _ in prompts]),
                      rollout_worker=worker, weight_transfer=CopyWeightTransfer(worker), callbacks=[Steps()],
                      **extra)
    syncs = _time_transfers(trainer, worker)
    with cpu_tree_attention(), contextlib.redirect_stdout(io.StringIO()):  # TRL prints its step logs
        trainer.train()
    if len(times) != 1 + steps or len(syncs) != 2 + steps:
        raise RuntimeError(f"{arm}: {len(times)} steps and {len(syncs)} transfers timed, expected {1 + steps} and "
                           f"{2 + steps}")
    # step i (after the warm-up step 0) and the transfer that follows it (syncs[0] is the cold one at train begin)
    rows = [(t[0] + x[0], t[1] + x[1]) for t, x in zip(times[1:], syncs[2:])]
    return {"cpu": sum(r[0] for r in rows) / steps, "wall": sum(r[1] for r in rows) / steps,
            "transfer_cpu": sum(x[0] for x in syncs[2:]) / steps}


def _time_transfers(trainer: Any, worker: Any) -> list[tuple[float, float]]:
    """Per weight transfer, the (CPU, wall) seconds of TRL's ``_sync_weight`` — the copy into the stand-in engine and,
    in the ``sync_check`` arm, the check — less the stand-in's sampling, which runs inside it (``update_model_version``
    fills the queue) and is the same work in every arm. TRL's callback holds the bound ``_sync_weight``: wrapped there."""
    out: list[tuple[float, float]] = []
    sampling = [0.0, 0.0]
    fill = worker.update_model_version

    def timed_fill(version: int) -> None:
        c0, w0 = time.process_time(), time.perf_counter()
        fill(version)
        sampling[0] += time.process_time() - c0
        sampling[1] += time.perf_counter() - w0

    worker.update_model_version = timed_fill
    hooks = [cb for cb in trainer.callback_handler.callbacks if getattr(getattr(cb, "fn", None), "__name__", "")
             == "_sync_weight"]
    if len(hooks) != 1:
        raise RuntimeError(f"TRL's weight-sync callback: found {len(hooks)}, expected 1")

    def timed(sync: Any) -> Any:
        def run() -> None:
            s0 = list(sampling)
            c0, w0 = time.process_time(), time.perf_counter()
            sync()
            out.append((time.process_time() - c0 - (sampling[0] - s0[0]),
                        time.perf_counter() - w0 - (sampling[1] - s0[1])))
        return run

    hooks[0].fn = timed(hooks[0].fn)
    begin = [cb for cb in trainer.callback_handler.callbacks if type(cb).__name__ == "_TrainBeginCallback"]
    if len(begin) != 1:
        raise RuntimeError(f"TRL's train-begin callback: found {len(begin)}, expected 1")
    cold = begin[0]._trainer._sync_weight  # the cold transfer: TRL's train-begin callback calls it on the trainer
    begin[0]._trainer._sync_weight = timed(cold)
    return out


def summarise(runs: dict[str, list[dict[str, float]]], loads: list[float], clock: str = "cpu",
              echo=print) -> dict[str, dict[str, float]]:
    """Per arm: the median and range of its ratio to vanilla's step (same repeat), and its median step seconds."""
    base = runs["vanilla"]
    echo(f"\nseconds per optimiser step ({clock} time), median over {len(base)} repeats; ratio to vanilla's step in "
         f"the same repeat (median, range); load average {min(loads):.1f}–{max(loads):.1f}")
    echo(f"{'arm':20s} {'step':>8s}   {'ratio':>6s} {'range':>13s}")
    table: dict[str, dict[str, float]] = {}
    for arm, rs in runs.items():
        ratios = [r[clock] / b[clock] for r, b in zip(rs, base)]
        row = {"ratio": statistics.median(ratios), "low": min(ratios), "high": max(ratios),
               "step_s": statistics.median(r[clock] for r in rs)}
        table[arm] = row
        echo(f"{arm:20s} {row['step_s']:8.4f}   {row['ratio']:5.3f}× {row['low']:5.3f}–{row['high']:5.3f}×")
    return table


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("tiny", "lab"), default="lab", help="an embedded model (offpolicy.models)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="optimiser steps timed per arm, after one of warm-up")
    ap.add_argument("--batch", type=int, default=16, help="completions per optimiser step")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--noise-std", type=float, default=0.5, help="the stand-in engine's logit noise: μ ≠ π_θ")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", nargs="*", default=None, help=f"arms besides vanilla, among {', '.join(ARMS)}")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    unknown = sorted(set(a.only or ()) - set(ARMS))
    if unknown:
        raise SystemExit(f"--only: unknown arms {unknown}; choose from {', '.join(ARMS)}")
    if a.batch % GROUP or a.repeat < 1 or a.steps < 1:
        raise SystemExit(f"--batch must be a multiple of {GROUP}; --repeat and --steps at least 1")
    torch.set_num_threads(a.threads)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from offpolicy.models import load_model, model_path

    model_dir = str(model_path(a.model))
    engine, tok = load_model(a.model)
    arms = ["vanilla"] + [x for x in (a.only or ARMS) if x != "vanilla"]
    n_params = sum(p.numel() for p in engine.parameters())
    print(f"{a.model} model ({n_params / 1e6:.2f} M parameters, V={engine.config.vocab_size}), {a.batch} completions "
          f"× {a.new_tokens} tokens per optimiser step, {a.threads} thread(s), arms: {', '.join(arms)}")
    before = _uptime()
    print(f"uptime: {before}")
    runs: dict[str, list[dict[str, float]]] = defaultdict(list)
    loads: list[float] = []
    with tempfile.TemporaryDirectory() as out:
        for rep in range(a.repeat):
            order = arms[rep % len(arms):] + arms[:rep % len(arms)]
            for arm in order:
                loads.append(os.getloadavg()[0])
                r = run_arm(arm, model_dir, engine, tok, batch=a.batch, new_tokens=a.new_tokens, steps=a.steps,
                            noise_std=a.noise_std, out_dir=out)
                runs[arm].append(r)
                print(f"repeat {rep + 1} {arm:20s} cpu {r['cpu']:.4f} s/step, wall {r['wall']:.4f}, "
                      f"load {loads[-1]:.1f}", flush=True)
    after = _uptime()
    print(f"uptime: {after}")
    table = summarise(dict(runs), loads, "cpu")
    wall = summarise(dict(runs), loads, "wall")
    result = {"model": a.model, "parameters": n_params, "uptime": [before, after], "table": table,
              "table_wall": wall}
    if a.json:
        from offpolicy_testkit.bench_record import write_record

        write_record(a.json, a, loads, dict(runs), {"cpu": table, "wall": wall, "uptime": [before, after],
                                                    "parameters": n_params})
    return result


if __name__ == "__main__":
    main()

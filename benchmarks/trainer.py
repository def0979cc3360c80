"""Throughput of offpolicy's GRPO training step on the tiny model (and, if TRL is installed, the ratio vs TRL).

    python benchmarks/trainer.py [--steps 6] [--batch 32] [--new-tokens 16] [--preset mis] [--threads 2]
                                 [--repeat R] [--compile] [--trl-compile] [--phases]

Prints tokens/s (completion tokens per wall-second) for
  * the update phase alone (π_old fp32 forward + π_θ forward/backward/AdamW step on a fixed rollout batch), and
  * a full step (bf16 KV-cache rollout + rewards + advantages + update) through ``offpolicy.train.train``: the
    wall clock of a (2 + steps)-step ``train()`` call minus that of a 2-step one, so each trainer's one-off set-up
    cancels and every per-step cost counts.
If ``trl`` is importable, ``GRPOTrainer.train()`` is timed the same way on the same model, prompts, group size and
completion length and the ratio offpolicy/TRL is printed; otherwise it says how to install it
(``pip install 'offpolicy[trl]'``).
``--phases`` prints instead the CPU seconds (``time.process_time()``: little moved by other processes on a shared
machine) of each phase of offpolicy's step — rollout, scoring, update, metrics — step by step.
Short by design (a few steps): it shares two CPU cores with everything else.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from collections.abc import Callable

import torch


def _model():
    from offpolicy.models.tiny import build_tiny_model

    return build_tiny_model(0)


def bench_update(model, tok, *, batch: int, new_tokens: int, steps: int, preset: str) -> float:
    """Tokens/s of the update phase on a fixed rollout (no generation)."""
    from offpolicy.batch import LogProbBatch
    from offpolicy.losses import policy_loss
    from offpolicy.rollout.hf import HFRolloutEngine
    from offpolicy.rollout.sampling import SamplingConfig
    from offpolicy.rollout.scoring import sequence_logprobs
    from offpolicy.train.config import load_config
    from offpolicy.train.presets import PRESETS

    cfg = load_config(None, [f"algorithm.preset={preset}", "model.path=tiny-random"])
    correction = PRESETS[preset].correction(cfg.algorithm)
    sampling = SamplingConfig(max_new_tokens=new_tokens)
    prompts = [tok(f"{i}+{i}=")["input_ids"] for i in range(batch)]
    engine = HFRolloutEngine(model, tokenizer=tok)
    ro = engine.generate(prompts, sampling, seed=0)
    adv = torch.randn(batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    n_tokens = int(ro.mask.sum())

    def one() -> None:
        with torch.no_grad():
            old, mask = sequence_logprobs(model, prompts, ro.completion_ids, sampling)
        logp, mask = sequence_logprobs(model, prompts, ro.completion_ids, sampling)
        b = LogProbBatch(logp=logp, mask=mask, old_logp=old, rollout_logp=ro.logp, advantages=adv)
        loss, _ = policy_loss(b, correction=correction, objective=PRESETS[preset].objective)
        opt.zero_grad()
        loss.backward()
        opt.step()

    one()  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    return n_tokens * steps / (time.perf_counter() - t0)


GROUP = 4  # samples per prompt, both trainers


def _step_overrides(preset: str, batch: int, new_tokens: int, extra: tuple[str, ...]) -> list[str]:
    """The trainer overrides of a benchmarked step: the tiny model, ``batch`` completions in groups of ``GROUP``."""
    return [f"algorithm.preset={preset}", "model.path=tiny-random", f"task.prompts_per_step={max(batch // GROUP, 1)}",
            f"algorithm.group_size={GROUP}", f"rollout.sampling.max_new_tokens={new_tokens}",
            *(["alp.enabled=true"] if preset == "alp" else []), *extra]


def bench_full(model, tok, *, batch: int, new_tokens: int, steps: int, preset: str,
               extra: tuple[str, ...] = ()) -> tuple[int, float]:
    """(completion tokens, wall seconds) of one whole ``offpolicy.train.train`` call of ``steps`` GRPO steps, with
    ``extra`` trainer overrides."""
    from offpolicy.train.config import load_config
    from offpolicy.train.loop import train

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, [*_step_overrides(preset, batch, new_tokens, extra), f"run.steps={steps}",
                                 f"run.out_dir={out}", "run.progress=false", "run.tensorboard=false"])
        t0 = time.perf_counter()
        res = train(cfg, model=model, tokenizer=tok)
        dt = time.perf_counter() - t0
    tokens = sum(round(h["time/tokens_per_s"] * h["time/step_s"]) for h in res.history)
    return tokens, dt


def bench_phases(model, tok, *, batch: int, new_tokens: int, steps: int, preset: str,
                 extra: tuple[str, ...] = ()) -> None:
    """CPU seconds of each phase of :mod:`offpolicy.train.steps`, per step (the first step warms up and is left out
    of the mean)."""
    from offpolicy.train.build import step_seed
    from offpolicy.train.config import load_config
    from offpolicy.train.steps import build_state, metrics_step, rollout_step, score_step
    from offpolicy.train.update import update_step

    cfg = load_config(None, _step_overrides(preset, batch, new_tokens, extra))
    state = build_state(cfg, model=model, tokenizer=tok)
    names = ("rollout", "scoring", "update", "metrics")
    rows = []
    for step in range(steps + 1):
        seed = step_seed(cfg.run.seed, step)
        marks = [time.process_time()]
        rollout = rollout_step(state, seed)
        marks.append(time.process_time())
        scored = score_step(state, rollout)
        marks.append(time.process_time())
        updates = update_step(state, rollout, scored, seed)
        marks.append(time.process_time())
        _ = {k: float(v) for k, v in metrics_step(state, rollout, scored, updates, started=0.0).items()}  # the sync
        marks.append(time.process_time())
        rows.append([b - a for a, b in zip(marks, marks[1:])])
        print(f"  step {step}: " + ", ".join(f"{n} {t:.3f}" for n, t in zip(names, rows[-1]))
              + f", total {marks[-1] - marks[0]:.3f} CPU s" + (" (warm-up)" if step == 0 else ""))
    mean = [sum(r[i] for r in rows[1:]) / steps for i in range(len(names))]
    print("mean CPU s per step: " + ", ".join(f"{n} {t:.3f}" for n, t in zip(names, mean)) + f", total {sum(mean):.3f}")


def bench_trl(model, tok, *, batch: int, new_tokens: int, steps: int, compile: bool = False) -> tuple[int, float]:
    """(completion tokens, wall seconds) of one whole ``GRPOTrainer.train()`` call of ``steps`` steps on the same
    model and batch shape (only when trl is importable); ``compile``: TRL's ``torch_compile=True``."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from offpolicy.tasks import get_task

    task = get_task("arithmetic")
    ex = task.examples(batch * steps, seed=0)
    data = Dataset.from_list([{"prompt": e.prompt, "answer": e.answer} for e in ex])
    seen = {"tokens": 0}

    def reward(completions, answer, completion_ids, **kw):  # noqa: ANN001
        # the completion tokens TRL generated (eos included when sampled), as offpolicy counts its mask
        seen["tokens"] += sum(len(ids) for ids in completion_ids)
        return task.reward(completions, answer=answer)

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, per_device_train_batch_size=batch, num_generations=GROUP,
                          max_completion_length=new_tokens, max_steps=steps, logging_steps=1000, report_to=[],
                          use_cpu=True, save_strategy="no", bf16=False, disable_tqdm=True,
                          torch_compile=compile)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok)
        t0 = time.perf_counter()
        trainer.train()
        dt = time.perf_counter() - t0
    return seen["tokens"], dt


def marginal_rate(run: Callable[[int], tuple[int, float]], short: int, long: int) -> tuple[float, float]:
    """(completion tokens/s, seconds per step) of the steps a ``long``-step run adds to a ``short``-step one: the
    difference of two whole runs, so that each trainer's one-off set-up (building the engine, the data loader, …)
    cancels and every per-step cost (logging, metrics files, the optimiser) counts — the same rule for both."""
    tokens_short, t_short = run(short)
    tokens_long, t_long = run(long)
    return (tokens_long - tokens_short) / (t_long - t_short), (t_long - t_short) / (long - short)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6,
                    help="steps timed (the difference of a 2-step and a (2 + steps)-step run); --phases: steps shown")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--preset", default="mis")
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads for both trainers (on a machine shared with other work, 1 avoids spinning)")
    ap.add_argument("--repeat", type=int, default=1, help="measure offpolicy and TRL this many times, alternating")
    ap.add_argument("--phases", action="store_true", help="only CPU seconds per phase of offpolicy's step")
    ap.add_argument("--compile", action="store_true",
                    help="offpolicy's engine with rollout.compile=true (its one-off compilation is set-up: it cancels)")
    ap.add_argument("--trl-compile", action="store_true", help="TRL with torch_compile=True (its training forward)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, tok = _model()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny model: {n_params / 1e6:.2f} M parameters, batch {a.batch} × ≤{a.new_tokens} new tokens, "
          f"preset {a.preset}, {a.threads} threads")
    extra = ("rollout.compile=true",) if a.compile else ()
    if a.phases:
        bench_phases(model, tok, batch=a.batch, new_tokens=a.new_tokens, steps=a.steps, preset=a.preset, extra=extra)
        return
    upd = bench_update(copy.deepcopy(model), tok, batch=a.batch, new_tokens=a.new_tokens, steps=a.steps, preset=a.preset)
    print(f"offpolicy update phase (π_old fwd + π_θ fwd/bwd + AdamW): {upd:,.0f} tokens/s")
    try:
        import trl
    except ImportError:
        trl = None
        print("TRL is not installed, so no TRL comparison; install it with  pip install 'offpolicy[trl]'  "
              "(or pip install trl) and run this script again.")
    # one untimed step of each first: TRL's first train() pays a lazy set-up (measured 3.9×), a compiled engine its
    # compilation (later engines reuse it)
    bench_full(copy.deepcopy(model), tok, batch=a.batch, new_tokens=a.new_tokens, steps=1, preset=a.preset,
               extra=extra)
    if trl is not None:  # a compiled TRL recompiles once more for the longer run's shapes: warm both lengths up
        for n in (1, 2 + a.steps) if a.trl_compile else (1,):
            bench_trl(copy.deepcopy(model), tok, batch=a.batch, new_tokens=a.new_tokens, steps=n, compile=a.trl_compile)
    short, long = 2, 2 + a.steps
    print(f"full steps: the steps {long} add to {short} (wall clock of whole train() calls, set-up cancels)")
    ratios = []
    for _ in range(a.repeat):
        full, full_s = marginal_rate(
            lambda n: bench_full(copy.deepcopy(model), tok, batch=a.batch, new_tokens=a.new_tokens, steps=n,
                                 preset=a.preset, extra=extra), short, long)
        print(f"offpolicy full GRPO step (bf16 KV-cache rollout + update{', compiled' if a.compile else ''}):  "
              f"{full:,.0f} tokens/s ({full_s:.3f} s/step)")
        if trl is None:
            continue
        try:
            ref, ref_s = marginal_rate(
                lambda n: bench_trl(copy.deepcopy(model), tok, batch=a.batch, new_tokens=a.new_tokens, steps=n,
                                    compile=a.trl_compile), short, long)
        except Exception as err:  # TRL's API moves fast; report instead of crashing the benchmark
            print(f"TRL GRPOTrainer could not run here: {err!r}")
            return
        print(f"TRL GRPOTrainer full step{' (torch_compile)' if a.trl_compile else ''}:  "
              f"{ref:,.0f} tokens/s ({ref_s:.3f} s/step)")
        ratios.append(full / ref)
        print(f"ratio offpolicy / TRL (full step): {full / ref:.2f}×")
    if len(ratios) > 1:
        print(f"ratio offpolicy / TRL over {len(ratios)} repeats: {min(ratios):.2f}–{max(ratios):.2f}×")


if __name__ == "__main__":
    main()

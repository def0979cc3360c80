"""Each method's cost inside TRL's own step: ``GRPOTrainer`` (TRL's own vLLM importance-sampling correction) against
``OffPolicyGRPOTrainer`` with each method, the arms alternating in one process, split into generation, scoring
forward and update.

    PYTHONPATH=. python benchmarks/trl_overhead.py [--repeat 5] [--steps 4] [--only tis dvp] [--model tiny-random|lab] [--threads 1]

Every arm trains the same model (a fresh copy) on the same prompts with the same ``GRPOConfig``: TRL's vLLM server
path (``use_vllm=True, vllm_mode="server"``), which is where TRL has the engine's log-probs μ that every correction
reads, with the server answered in-process by offpolicy's HF engine in bfloat16 (:class:`EngineClient`: TRL's
``VLLMClient`` calls, the vLLM log-prob layout; a live vLLM does not run on this CPU). Generation is therefore the
same engine for every arm; it samples at temperature 1 without truncation, except in the sampling-replay arm, which
samples with top-k 50 / top-p 0.95 (what it replays). ``steps_per_generation=2`` (two optimiser steps per generation
batch), so TRL computes π_old in a scoring forward for every arm, as it does for any off-policy step. The adapter's
check of each weight sync (``sync_check``, on by default) is off: it is not a method's cost, and
``benchmarks/trl_sync_check_cost.py`` measures it.

Phases, from wrappers around TRL's own methods: *generation* — ``_generate_single_turn`` (the engine call and the
weight sync); *scoring* — the rest of ``_generate_and_score_completions`` (π_old forward, rewards, advantages);
*update* — the rest of the optimiser step (π_θ forward, loss, backward, AdamW). Seconds per optimiser step are the
mean over ``--steps`` generation cycles after one cycle of warm-up, in CPU time of the process (``process_time``;
with one torch thread, what the step computes, little moved by the other processes of a shared machine) and in wall
time. One repeat runs every arm once, in an order rotated by one each repeat; the ratio of an arm is its step time
over the vanilla arm's in the same repeat; the table gives the median and range over repeats, and the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch

GROUP = 4  # completions per prompt
ARMS: dict[str, dict[str, Any] | None] = {
    "vanilla": None,  # TRL's GRPOTrainer, its own vLLM IS correction (sequence_mask, the default)
    "trl_is_equiv": {"correction": {"name": "mis", "level": "sequence", "upper": 3.0}},  # the same correction, ours
    "tis": {"correction": "tis"},
    "icepop": {"correction": "icepop"},
    "opsm": {"correction": {"name": "opsm", "delta": 1e-4}},
    "m2po": {"correction": "m2po"},
    "ipo": {"objective": "ipo"},
    "dvp": {"dvp_rho": 1e-3},
    "replay": {"sampling_replay": True},  # with top-k 50 / top-p 0.95 (REPLAY_RECIPE), which it replays
    "topk_trm": {"topk_logprobs": 8, "correction": "trm"},
    "score_centering": {"topk_logprobs": 8, "score_centering": True},
    "alp": {"alp": True},
}
REPLAY_RECIPE = {"top_k": 50, "top_p": 0.95}  # the engine's truncation in the replay arm (the others sample plainly)
GOALS = {"trl_is_equiv": 1.03, "tis": 1.03, "icepop": 1.03, "opsm": 1.03, "m2po": 1.03, "ipo": 1.03, "topk_trm": 1.05,
         "dvp": 1.15, "replay": 1.15, "score_centering": 1.15, "alp": 1.10}


class EngineClient:
    """TRL's ``VLLMClient`` as ``trl vllm-serve`` answers it, served by offpolicy's HF engine in bfloat16: weights
    pushed by ``update_named_params``; completions with vLLM's log-prob layout (``logprobs=0``: the sampled token's
    alone; K > 0: the top-K by rank, plus the sampled token when it is not among them)."""

    def __init__(self, model, tok):
        from offpolicy.rollout.hf import HFRolloutEngine

        self.engine = HFRolloutEngine(model, tokenizer=tok)
        self.calls = 0

    def get_server_info(self):
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}

    def update_named_params(self, metadata, params):
        own = dict(self.engine.model.named_parameters())
        with torch.no_grad():
            for name, value in params:
                own[name].copy_(value)

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, features=None, n=1, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=0,
                 min_p=0.0, max_tokens=16, logprobs=0, structured_outputs_regex=None, generation_kwargs=None):
        from offpolicy_testkit.vllm_layout import vllm_logprob_lists

        from offpolicy.rollout.sampling import SamplingConfig

        k = int(logprobs or 0)
        cfg = SamplingConfig(max_new_tokens=max_tokens, temperature=temperature, top_k=top_k if top_k > 0 else None,
                             top_p=top_p if top_p < 1 else None, min_p=min_p or None,
                             repetition_penalty=repetition_penalty, logprobs_topk=max(k, 1))
        out = self.engine.generate([p for p in prompts for _ in range(n)], cfg, seed=self.calls)
        self.calls += 1
        lps, ids = vllm_logprob_lists(out, k)
        return {"prompt_ids": prompts, "completion_ids": out.completion_ids, "logprobs": lps, "logprob_token_ids": ids}


@contextlib.contextmanager
def engine_client(model, tok) -> Iterator[EngineClient]:
    """While open, a trainer built inside talks to an :class:`EngineClient` on ``model`` (TRL's
    ``VLLMGeneration._init_vllm`` replaced); TRL's own ``_init_vllm`` is back on exit, an exception included."""
    from trl.generation import vllm_generation as vg

    client = EngineClient(model, tok)  # before TRL turns on gradient checkpointing in the model it copies
    cls = vg.VLLMGeneration
    original = vars(cls).get("_init_vllm")  # None: inherited, so the class had no attribute of its own

    def init(self):
        self.vllm_client = client

    cls._init_vllm = init
    try:
        yield client
    finally:
        if original is None:
            del cls._init_vllm
        else:
            cls._init_vllm = original


class PhaseClock:
    """CPU and wall seconds spent in generation, in the whole generate-and-score call, and in each optimiser step."""

    def __init__(self) -> None:
        self.gen = [0.0, 0.0]
        self.gen_score = [0.0, 0.0]
        self.steps: list[tuple[float, float, float, float, float, float]] = []  # per step: cpu, wall of step/gen/gs
        self._mark: tuple[float, float, float, float, float, float] | None = None

    @staticmethod
    def now() -> tuple[float, float]:
        return time.process_time(), time.perf_counter()

    def wrap(self, obj: Any, name: str, into: list[float]) -> None:
        inner = getattr(obj, name)

        def timed(*a, **kw):
            c0, w0 = self.now()
            try:
                return inner(*a, **kw)
            finally:
                c1, w1 = self.now()
                into[0] += c1 - c0
                into[1] += w1 - w0

        setattr(obj, name, timed)

    def begin(self) -> None:
        c, w = self.now()
        self._mark = (c, w, *self.gen, *self.gen_score)

    def end(self) -> None:
        assert self._mark is not None
        c, w = self.now()
        c0, w0, gc, gw, sc, sw = self._mark
        self.steps.append((c - c0, w - w0, self.gen[0] - gc, self.gen[1] - gw, self.gen_score[0] - sc,
                           self.gen_score[1] - sw))


def _dataset(n: int):
    from datasets import Dataset

    from offpolicy.tasks import get_task

    task = get_task("arithmetic")
    data = Dataset.from_list([{"prompt": e.prompt, "answer": e.answer} for e in task.examples(n, seed=0)])
    return data, (lambda completions, answer, **kw: task.reward(completions, answer=answer))


def run_arm(arm: str, base_model, tok, *, batch: int, new_tokens: int, cycles: int, out_dir: str) -> dict[str, float]:
    """Seconds per optimiser step of one arm (means over the ``cycles`` generation cycles after a warm-up cycle):
    ``{"cpu", "wall", "gen_cpu", "score_cpu", "update_cpu", "gen_wall", "score_wall", "update_wall"}``."""
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from offpolicy.integrations.trl import OffPolicyGRPOTrainer

    spg = 2
    steps = spg * (1 + cycles)
    data, reward = _dataset(batch * spg * steps // GROUP + GROUP)
    kw = ARMS[arm]
    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=batch, num_generations=GROUP,
                      steps_per_generation=spg, max_completion_length=new_tokens, max_steps=steps,
                      logging_steps=10_000, report_to=[], use_cpu=True, save_strategy="no", bf16=False,
                      disable_tqdm=True, seed=0, beta=0.0, loss_type="dapo", temperature=1.0,
                      use_vllm=True, vllm_mode="server", vllm_importance_sampling_correction=kw is None,
                      **(REPLAY_RECIPE if arm == "replay" else {}))
    model = copy.deepcopy(base_model)
    clock = PhaseClock()

    class Steps(TrainerCallback):
        def on_step_begin(self, *a, **k):
            clock.begin()

        def on_step_end(self, *a, **k):
            clock.end()

    cls = GRPOTrainer if kw is None else OffPolicyGRPOTrainer
    # the adapter's check of each weight sync is its own cost (benchmarks/trl_sync_check_cost.py), not a method's
    extra = {} if kw is None else {"sync_check": None, **kw}
    with engine_client(model, tok):
        trainer = cls(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok,
                      callbacks=[Steps()], **extra)
        clock.wrap(trainer, "_generate_single_turn", clock.gen)
        clock.wrap(trainer, "_generate_and_score_completions", clock.gen_score)
        trainer.train()
    rows = clock.steps[spg:]  # the first generation cycle warms up
    if len(rows) != spg * cycles:
        raise RuntimeError(f"{arm}: {len(clock.steps)} steps timed, expected {steps}")

    def mean(i: int) -> float:
        return sum(r[i] for r in rows) / len(rows)

    cpu, wall, gen_cpu, gen_wall, gs_cpu, gs_wall = (mean(i) for i in range(6))
    return {"cpu": cpu, "wall": wall, "gen_cpu": gen_cpu, "gen_wall": gen_wall, "score_cpu": gs_cpu - gen_cpu,
            "score_wall": gs_wall - gen_wall, "update_cpu": cpu - gs_cpu, "update_wall": wall - gs_wall}


def summarise(runs: dict[str, list[dict[str, float]]], loads: list[float], clock: str = "cpu",
              echo=print) -> dict[str, dict[str, float]]:
    """Per arm: the median and range of its ratio to vanilla's step (same repeat), and its median phase seconds."""
    table: dict[str, dict[str, float]] = {}
    base = runs["vanilla"]
    echo(f"\nseconds per optimiser step ({clock} time), median over {len(base)} repeats; ratio to vanilla's step in "
         f"the same repeat (median, range); load average {min(loads):.1f}–{max(loads):.1f}")
    echo(f"{'arm':16s} {'step':>7s} {'gen':>7s} {'score':>7s} {'update':>7s}   {'ratio':>6s} {'range':>13s}  goal")
    for arm, rs in runs.items():
        ratios = [r[clock] / b[clock] for r, b in zip(rs, base)]
        row = {"ratio": statistics.median(ratios), "low": min(ratios), "high": max(ratios)}
        for key in ("", "gen_", "score_", "update_"):
            row[f"{key or 'step_'}s"] = statistics.median(r[f"{key}{clock}"] for r in rs)
        table[arm] = row
        goal = GOALS.get(arm)
        verdict = "" if goal is None else f"≤ {goal:.2f}× {'met' if row['ratio'] <= goal else 'MISSED'}"
        echo(f"{arm:16s} {row['step_s']:7.3f} {row['gen_s']:7.3f} {row['score_s']:7.3f} {row['update_s']:7.3f}   "
             f"{row['ratio']:5.3f}× {row['low']:5.3f}–{row['high']:5.3f}×  {verdict}")
    return table


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="generation cycles timed per arm (two optimiser steps each)")
    ap.add_argument("--batch", type=int, default=32, help="completions per optimiser step")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--model", choices=("tiny-random", "lab"), default="tiny-random",
                    help="tiny-random: the tiny Qwen2 with random weights (completions run to --new-tokens, as in "
                         "benchmarks/trainer.py); lab: the embedded lab model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", nargs="*", default=None, help=f"arms besides vanilla, among {', '.join(ARMS)}")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    unknown = sorted(set(a.only or ()) - set(ARMS))
    if unknown:
        raise SystemExit(f"--only: unknown arms {unknown}; choose from {', '.join(ARMS)}")
    torch.set_num_threads(a.threads)
    from offpolicy.models import build_tiny_model, load_model

    model, tok = build_tiny_model(0) if a.model == "tiny-random" else load_model(a.model)
    arms = ["vanilla"] + [x for x in (a.only or ARMS) if x != "vanilla"]
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{a.model} model ({n_params / 1e6:.2f} M parameters, V={model.config.vocab_size}, "
          f"H={model.config.hidden_size}), {a.batch} completions × ≤{a.new_tokens} tokens per optimiser step, "
          f"{a.threads} thread(s), arms: {', '.join(arms)}")
    runs: dict[str, list[dict[str, float]]] = defaultdict(list)
    loads = []
    with tempfile.TemporaryDirectory() as out:
        for rep in range(a.repeat):
            order = arms[rep % len(arms):] + arms[:rep % len(arms)]
            for arm in order:
                loads.append(os.getloadavg()[0])
                r = run_arm(arm, model, tok, batch=a.batch, new_tokens=a.new_tokens, cycles=a.steps, out_dir=out)
                runs[arm].append(r)
                print(f"repeat {rep + 1} {arm:16s} cpu {r['cpu']:.3f} s/step (gen {r['gen_cpu']:.3f}, score "
                      f"{r['score_cpu']:.3f}, update {r['update_cpu']:.3f}), wall {r['wall']:.3f}, "
                      f"load {loads[-1]:.1f}", flush=True)
    table = summarise(dict(runs), loads, "cpu")
    summarise(dict(runs), loads, "wall")
    if a.json:
        from offpolicy_testkit.bench_record import write_record

        write_record(a.json, a, loads, runs, table)
    return table


if __name__ == "__main__":
    main()

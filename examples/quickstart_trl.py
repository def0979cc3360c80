"""TRL quickstart: truncated importance sampling (TIS) inside TRL's own ``GRPOTrainer.train()``, on a rollout engine
that really differs from the trainer — on CPU, nothing downloaded. docs/quickstart-trl.md walks through it.

    python examples/quickstart_trl.py                       # 8 steps, ~60 s on 2 cores (the first run also builds
                                                            # the embedded lab model if it is not cached)
    python examples/quickstart_trl.py --steps 4 --out runs/trl_quickstart
    python examples/quickstart_trl.py --model lab-moe     # the lab model's mixture-of-experts twin (8 experts, top-2)

The engine is offpolicy's own (:class:`offpolicy.rollout.hf.HFRolloutEngine`: a bf16 copy of the model that samples
with a KV cache) handed to TRL as its ``rollout_func`` (:func:`offpolicy.integrations.trl.engine_rollout`); its
weights follow the trainer's only every ``--sync-every`` steps, as an asynchronous pipeline's engine lags. TRL stores
the engine's log-probs as ``sampling_per_token_logps`` (μ), and ``correction={"name": "tis", "upper": 2.0}`` weights
each token by min(π_old/μ, 2). With vLLM, the same trainer reads μ from vLLM instead (docs/quickstart-trl.md).

It prints one row per step: how stale the engine is, the mismatch (k3 KL per token, the range of the ratio π_old/μ)
and what TIS did (the share of tokens whose weight it capped, the mean weight), then the reward.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL marks rollout_func experimental

import torch
from datasets import Dataset
from transformers.trainer_callback import PrinterCallback
from trl import GRPOConfig

from offpolicy.integrations.trl import OffPolicyGRPOTrainer, engine_rollout
from offpolicy.models import RECIPES, get_recipe, load_model
from offpolicy.rollout.hf import HFRolloutEngine

# what to read in TRL's log (metric_naming="trl": the mismatch under TRL's sampling/ names, the correction under
# offpolicy/<method>/): docs/metrics.md has every name
COLUMNS = {
    "k3 KL": "sampling/k3_kl",
    "ratio min": "offpolicy/tis/raw_ratio_min",
    "ratio max": "offpolicy/tis/raw_ratio_max",
    "TIS capped": "offpolicy/tis/capped_frac",
    "weight mean": "offpolicy/tis/weight_mean",
    "reward": "reward",
}


def run(steps: int, sync_every: int, upper: float, out: str, seed: int = 0, model_name: str = "lab"
        ) -> list[dict[str, float]]:
    """Train ``steps`` GRPO steps in TRL with TIS on a lagging bf16 engine; returns TRL's per-step log rows.
    ``model_name``: an embedded model (``lab``; ``lab-moe``, its mixture-of-experts twin; ``tiny``)."""
    torch.manual_seed(seed)
    model, tokenizer = load_model(model_name)      # lab: 5 M parameters, warm-started on the `pattern` task
    task = get_recipe(model_name).task()
    data = Dataset.from_list([{"prompt": e.prompt, "answer": e.answer, **e.meta} for e in task.examples(256, seed=0)])
    args = GRPOConfig(
        output_dir=out, max_steps=steps, per_device_train_batch_size=8, num_generations=8, max_completion_length=16,
        learning_rate=3e-4, lr_scheduler_type="constant", temperature=1.0, beta=0.0, loss_type="bnpo",
        logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, bf16=False, seed=seed, disable_tqdm=True,
    )
    engine = HFRolloutEngine(model, tokenizer=tokenizer)  # bf16 weights, KV-cached sampling: μ ≠ π_old
    trainer = OffPolicyGRPOTrainer(
        model=model, reward_funcs=task.reward, args=args, train_dataset=data, processing_class=tokenizer,
        rollout_func=engine_rollout(engine, sync_every=sync_every),       # the engine's log-probs are μ
        correction={"name": "tis", "upper": upper},                        # w = min(π_old/μ, upper)
    )
    trainer.remove_callback(PrinterCallback)  # the table below instead of TRL's one dict per step
    trainer.train()
    return [h for h in trainer.state.log_history if "sampling/k3_kl" in h]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sync-every", type=int, default=4, help="the engine takes the trainer's weights every N steps")
    parser.add_argument("--upper", type=float, default=2.0, help="TIS cap C in w = min(π_old/μ, C)")
    parser.add_argument("--out", type=Path, default=None, help="TRL's output_dir (default: a temporary folder)")
    parser.add_argument("--model", default="lab", choices=list(RECIPES),
                        help="embedded model (lab-moe: the lab model's mixture-of-experts twin)")
    cli = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(cli.steps, cli.sync_every, cli.upper, str(cli.out or tmp), model_name=cli.model)
    print(f"\nTIS (cap {cli.upper:g}) in TRL, engine synced every {cli.sync_every} steps")
    print("step  engine lag " + " ".join(f"{name:>11}" for name in COLUMNS))
    for step, h in enumerate(rows):
        lag = step % cli.sync_every
        print(f"{step + 1:4d}  {lag:10d} " + " ".join(f"{h.get(key, float('nan')):11.4g}" for key in COLUMNS.values()))
    print(f"finished in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

"""DVP and ALP inside TRL's own ``GRPOTrainer``, on a rollout engine that really differs from the trainer — on CPU,
nothing downloaded.

    python examples/trl_dvp_alp.py                          # lab model, 6 steps, ~2 min on 2 cores
    python examples/trl_dvp_alp.py --steps 3 --out runs/trl_dvp_alp

What it turns on, as a TRL user would write it (the rest is a plain GRPOConfig):

* ``dvp_rho=1e-3`` — Dynamic Vocabulary Pruning (arXiv 2512.23087): the engine samples with ``min_p = ρ`` and every
  trainer forward (π_old and π_θ) scores the tokens over the same min-p safe set;
* ``alp={...}`` — Adaptive Layerwise Perturbation (arXiv 2603.19470): learnable Gaussian noise σ on every decoder
  layer's input in the update forward only, σ in its own optimiser group, out of ``save_pretrained``; the loss is the
  unified ratio π_{θ,σ}/μ;
* ``rollout_func=engine_rollout(...)`` — the rollouts come from offpolicy's bf16 KV-cache engine, synced with the
  trainer every 2 steps, so μ (the engine's log-probs) differs from the trainer's π — by the numerics at a sync and
  by one step of lag in between.

It prints one line per step: reward, DVP's retained mass and the share of sampled tokens outside the trainer's safe
set, ALP's mean σ, and the range of the ratio π_{θ,σ}/μ the loss sees.
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

COLUMNS = {"reward": "reward", "dvp/mass_mean": "offpolicy/dvp/mass_mean", "dvp/mass_min": "offpolicy/dvp/mass_min",
           "dvp/outside": "offpolicy/dvp_keep/masked_frac", "alp/σ_mean": "offpolicy/alp/sigma_mean",
           "ratio min": "offpolicy/loss/ratio_min", "ratio max": "offpolicy/loss/ratio_max"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="lab", choices=list(RECIPES),
                        help="embedded model (lab-moe: the lab model's mixture-of-experts twin)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dvp-rho", type=float, default=1e-3)
    parser.add_argument("--alp-init-std", type=float, default=1e-2)
    parser.add_argument("--sync-every", type=int, default=2, help="the engine takes the trainer's weights every N steps")
    parser.add_argument("--out", type=Path, default=None, help="TRL's output_dir (default: a temporary folder)")
    cli = parser.parse_args()
    torch.manual_seed(0)
    started = time.perf_counter()
    model, tokenizer = load_model(cli.model)
    task = get_recipe(cli.model).task()  # the task the model was warm-started on (tiny: arithmetic, lab and lab-moe: pattern)
    data = Dataset.from_list([{"prompt": e.prompt, "answer": e.answer, **e.meta} for e in task.examples(256, seed=0)])

    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(output_dir=str(cli.out or tmp), per_device_train_batch_size=8, num_generations=8,
                            max_completion_length=16, max_steps=cli.steps, learning_rate=3e-4,
                            lr_scheduler_type="constant", temperature=1.0, loss_type="bnpo", beta=0.0,
                            logging_steps=1, report_to=[], use_cpu=True, bf16=False, save_strategy="no", seed=0,
                            disable_tqdm=True)
        trainer = OffPolicyGRPOTrainer(
            model=model, reward_funcs=task.reward, args=config, train_dataset=data, processing_class=tokenizer,
            dvp_rho=cli.dvp_rho,                                                  # DVP: min_p = ρ + replay
            alp={"init_std": cli.alp_init_std, "lr": 5e-3, "seed": 0},          # ALP: σ per decoder layer
            rollout_func=engine_rollout(HFRolloutEngine(model, tokenizer=tokenizer), sync_every=cli.sync_every),
        )
        trainer.remove_callback(PrinterCallback)
        trainer.train()

    print(f"\nmodel {cli.model}, task {task.name}: DVP ρ = {cli.dvp_rho:g} (engine min_p = {trainer.args.min_p:g}), "
          f"ALP on {trainer.offpolicy_alp.num_layers} layers, σ₀ = {cli.alp_init_std:g}, engine synced every "
          f"{cli.sync_every} steps")
    print("step " + " ".join(f"{name:>12}" for name in COLUMNS))
    rows = [h for h in trainer.state.log_history if "offpolicy/dvp/mass_mean" in h]
    for step, h in enumerate(rows, 1):
        print(f"{step:4d} " + " ".join(f"{h.get(key, float('nan')):12.4g}" for key in COLUMNS.values()))
    print(f"σ per layer at the end: {[round(float(s), 5) for s in trainer.offpolicy_alp.sigma.detach()]}")
    print(f"finished in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

"""Retokenization drift against token-in/token-out on the same multi-turn rollouts (docs/multi-turn.md's table).

For each seed: one rollout of the two-turn ``tool_calc`` task by the trainer's engine (the transformers engine, bf16
+ KV cache by default), then the trainer's π_old over the *same* conversations twice — with the engine's ids and with
the decoded conversation re-tokenized — and the drift and per-turn mismatch of each (offpolicy.train.multi_turn's
metrics). Rollout-only: no update.

    python scripts/multi_turn_drift.py --model lab --seeds 0 1 2 --temperatures 1 1.5 2 \
        --out docs/data/multi_turn_drift.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

from offpolicy.rollout.multi_turn import TurnPrompt, run_turns
from offpolicy.rollout.prompts import step_prompts
from offpolicy.train import steps
from offpolicy.train.config import load_config
from offpolicy.train.multi_turn import mask_scored, multi_turn_metrics, rollout_of


def measure(model: str, seed: int, prompts_per_step: int, group_size: int, max_new_tokens: int,
            temperature: float) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, [f"model.path={model}", "task.name=tool_calc", f"run.out_dir={out}",
                                 f"task.prompts_per_step={prompts_per_step}", f"algorithm.group_size={group_size}",
                                 f"rollout.sampling.max_new_tokens={max_new_tokens}", f"run.seed={seed}",
                                 f"rollout.sampling.temperature={temperature}"])
        state = steps.build_state(cfg)
        state.engine.sync_weights(state.model)
        prompts = step_prompts(state.task, state.tokenizer, prompts_per_step, seed)
        rows = [TurnPrompt(p.example.prompt, list(p.ids), dict(p.example.meta)) for p in prompts
                for _ in range(group_size)]
        conversations, _ = run_turns(state.engine, state.tokenizer, state.task, rows, state.sampling, seed=seed)
        result: dict = {"rows": len(rows)}
        for mode in ("engine", "retokenize"):
            rollout = rollout_of(state, prompts, conversations, mode)
            with torch.no_grad():
                scored = mask_scored(steps.score_step(state, rollout), rollout)
            metrics = {k: float(v) for k, v in multi_turn_metrics(state, rollout, scored).items()}
            metrics["reward/mean"] = float(rollout.rewards.mean())
            result[mode] = metrics
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="lab")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0],
                        help="above 1 the policy samples its long tail: non-canonical splits and special tokens")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    report = {"model": args.model, "task": "tool_calc", "prompts": args.prompts, "group_size": args.group,
              "max_new_tokens_per_turn": args.max_new_tokens,
              "temperature": {t: {s: measure(args.model, s, args.prompts, args.group, args.max_new_tokens, t)
                                  for s in args.seeds} for t in args.temperatures}}
    text = json.dumps(report, indent=1, sort_keys=True)
    if args.out is None:
        print(text)
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(args.out)  # atomic
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""The reference trainer with vLLM as its engine (rollout.engine=vllm) on the embedded tiny model; prints JSON.

``python trainer_vllm.py OUT ok``: 3 steps, metrics.jsonl read back. ``... OUT broken``: the engine's sync drops the
tied output head (and the embedding it is tied to) from step 2 on, 6 steps at a larger learning rate (as a reload from the checkpoint's files does on vLLM's CPU backend): the sync check
must stop the run, naming the step, with the last checkpoint intact. ``... OUT bf16``: the policy itself in bf16
(``model.dtype=bfloat16``) against the bf16 engine, 3 steps. ``... OUT moe``: the mixture-of-experts lab model
(lab-moe) on its pattern task, 3 steps; the sync of step 3 leaves every expert's down projection behind (vLLM's stacked
``w2_weight``), which the parameter layer must name; the warnings the run gave are returned."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

if __name__ == "__main__":
    from offpolicy.rollout import vllm as vllm_module
    from offpolicy.rollout.sync_check import SyncCheckError
    from offpolicy.train.config import load_config
    from offpolicy.train.loop import train

    out, mode = Path(sys.argv[1]), sys.argv[2]
    overrides = ["model.path=tiny", "task.prompts_per_step=4", "algorithm.group_size=4", "algorithm.preset=tis",
                 "rollout.engine=vllm", "rollout.sampling.max_new_tokens=6", f"run.out_dir={out}", "run.checkpoint_every=1", "run.threads=2"]
    # the broken sync takes a larger learning rate so that the head it leaves behind drifts fast: with a small one
    # the gap grows step by step and the check trips later (docs/engines.md)
    overrides += ["optim.lr=3e-3", "run.steps=6"] if mode == "broken" else ["optim.lr=3e-4", "run.steps=3"]
    if mode == "bf16":
        overrides += ["model.dtype=bfloat16", "rollout.dtype=bfloat16"]
    if mode == "moe":
        overrides += ["model.path=lab-moe", "task.name=pattern", "task.options={length: 6}"]
    result: dict = {"mode": mode}
    if mode == "broken":
        real_push, calls = vllm_module.push_weights, []

        def push_without_head(llm, named):
            calls.append(1)
            named = list(named)
            tied = ("lm_head.weight", "model.embed_tokens.weight")  # the embedding too: engine_sync.py says why
            real_push(llm, [(k, v) for k, v in named if k not in tied] if len(calls) > 1 else named)

        vllm_module.push_weights = push_without_head
    if mode == "moe":
        real_push, calls = vllm_module.push_weights, []

        def push_without_experts(llm, named):
            calls.append(1)
            named = list(named)
            real_push(llm, [(k, v) for k, v in named if "experts.down_proj" not in k] if len(calls) > 2 else named)

        vllm_module.push_weights = push_without_experts
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            res = train(load_config(None, overrides))
            result["steps_done"] = res.steps_done
        except SyncCheckError as err:
            result["error"] = str(err)
    result["warnings"] = [str(w.message) for w in caught]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] if (out / "metrics.jsonl").exists() else []
    result["sync"] = [{k: v for k, v in m.items() if k.startswith("sync/")} for m in metrics]
    result["checkpoints"] = sorted(p.name for p in (out / "checkpoints").glob("*")) if (out / "checkpoints").exists() else []
    result["reward"] = [m.get("reward/mean") for m in metrics]
    result["routing"] = [{k: v for k, v in m.items() if k.startswith("routing/")} for m in metrics]
    print("RESULT " + json.dumps(result))

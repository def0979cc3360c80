"""Measure what score centering's top-k proportional tail costs against the exact centring on the lab model.

Sampler q and trainer p on the same 32 rollouts (4 prompts × 8, 32 tokens) of the lab's pattern task:

* stale: q = the initial lab model (what a lag64 engine samples with), p = naive's weights after the 20 steps of the
  fp32-control run (``SWEEP/runs/naive__none__s0``); rollouts sampled by q;
* numeric: q = a bf16 engine with KV cache on those trained weights, p = the fp32 trainer on the same weights.

    PYTHONPATH=src python docs/lab/staleness_topk_gap.py /tmp/stale_sweep
"""

import copy
import json
import sys

from offpolicy.lab.settings import LAB_BASE
from offpolicy.lab.staleness import topk_gap_table
from offpolicy.train.build import DTYPES, build_run_engine, step_seed
from offpolicy.train.checkpoint import latest_checkpoint, load_checkpoint
from offpolicy.train.config import load_config
from offpolicy.train.scoring import score_policy
from offpolicy.train.steps import build_state, rollout_step

KS = [1, 2, 5, 10, 20, 50]
sweep = sys.argv[1]
cfg = load_config(None, [*LAB_BASE, "run.out_dir=/tmp/topk_gap_unused", "rollout.dtype=float32"])
state = build_state(cfg)
initial = copy.deepcopy(state.model)
load_checkpoint(latest_checkpoint(f"{sweep}/runs/naive__none__s0/checkpoints"), model=state.model, restore_rng=False)
results = {}
for name, engine_model, dtype in (("stale (initial → trained 20 steps)", initial, "float32"),
                                  ("numeric (bf16 engine, trained weights)", state.model, "bfloat16")):
    engine_cfg = load_config(None, [*LAB_BASE, "run.out_dir=/tmp/topk_gap_unused", f"rollout.dtype={dtype}"])
    state.engine = build_run_engine(engine_cfg, copy.deepcopy(engine_model), state.tokenizer)
    rollout = rollout_step(state, step_seed(0, 0), sync_weights=False)
    q = state.engine.score(rollout.prompt_ids, rollout.completions, state.sampling, return_logits=True)[2]
    _, mask, p, _ = score_policy(state.model, rollout.prompt_ids, rollout.completions, state.sampling,
                                 dtype=DTYPES["float32"], return_logits=True)
    results[name] = topk_gap_table(p.detach(), q.detach(), mask, KS, temperature=state.sampling.temperature)
print(json.dumps(results, indent=1))

"""VLLMRolloutEngine on the embedded tiny model in this process: generate, score, sync, sync check; prints JSON.

Run by tests/vllm/test_engine_live.py (vLLM must not live inside the pytest process)."""

from __future__ import annotations

import json
import sys
import time

if __name__ == "__main__":
    import torch

    from offpolicy.models import load_model, model_path
    from offpolicy.rollout.sampling import SamplingConfig
    from offpolicy.rollout.scoring import sequence_logprobs
    from offpolicy.rollout.sync_check import SyncCheck, SyncCheckError, SyncProbe, probe_gap
    from offpolicy.rollout.vllm import VLLMRolloutEngine, push_weights

    dtype = sys.argv[1]
    result: dict = {"dtype": dtype}
    model, tok = load_model("tiny")
    start = time.perf_counter()
    engine = VLLMRolloutEngine(model_path("tiny"), dtype=dtype, max_logprobs=8, seed=0, max_model_len=128)
    result["startup_s"] = time.perf_counter() - start
    prompts = [tok(f"{a}+{b}=")["input_ids"] for a, b in [(3, 4), (12, 30), (7, 7), (25, 50)]]
    cfg = SamplingConfig(max_new_tokens=8, logprobs_topk=4)
    out = engine.generate(prompts, cfg, seed=0)
    again = engine.generate(prompts, cfg, seed=0)
    result["same_tokens_on_rerun"] = out.completion_ids == again.completion_ids
    result["tokens"] = int(out.mask.sum())
    # μ (processed log-probs at T = 1, no truncation) against the engine's own prompt log-probs of the same tokens
    eng_logp, eng_mask = engine.score(out.prompt_ids, out.completion_ids)
    result["mu_vs_engine_score"] = float((out.logp - eng_logp).abs()[out.mask].max())
    with torch.no_grad():
        trainer_logp, mask = sequence_logprobs(model, out.prompt_ids, out.completion_ids)
    result["mu_vs_trainer_mean_abs"] = float((out.logp - trainer_logp).abs()[mask].mean())
    result["topk_sorted"] = bool((out.topk_logp[..., :-1] >= out.topk_logp[..., 1:]).all())
    result["sampled_in_topk_when_rank1"] = True

    check = SyncCheck(factor=4.0, floor=1e-3)
    result["calibrate"] = check.calibrate(engine, model, SyncProbe.from_rollout(out.prompt_ids, out.completion_ids))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.02)
    result["stale_gap"] = probe_gap(*check._score(engine, model))
    start = time.perf_counter()
    engine.sync_weights(model)
    result["sync_s"] = time.perf_counter() - start
    result["after_sync"] = check.after_sync(engine, model, what="sync 1")
    # a sync that leaves the tied output head behind (as a reload from the checkpoint's files does on CPU)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.02)
    push_weights(engine.llm, [(k, v) for k, v in model.state_dict().items() if k != "lm_head.weight"])
    try:
        check.after_sync(engine, model, what="sync 2 (output head left behind)")
        result["caught"] = None
    except SyncCheckError as err:
        result["caught"] = str(err)
    print("RESULT " + json.dumps(result))

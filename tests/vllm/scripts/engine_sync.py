"""VLLMRolloutEngine on the embedded tiny model in this process: generate, score, sync, sync check; prints JSON.

Run by tests/vllm/test_engine_live.py (vLLM must not live inside the pytest process)."""

from __future__ import annotations

import json
import sys
import time

import torch


def topk_agreement(out, trainer_logits: torch.Tensor) -> dict:
    """The engine's top-K list against the trainer's own logits ``[B, T, V]`` (fp32 forward of the same tokens).

    ``sampled_in_topk_when_rank1``: at every valid position where the sampled token is the trainer's most likely one
    (rank 1), that id is among the engine's top-K ids (``out.topk_ids`` ``[B, T, K]``) — true for an engine that
    reports its own processed top-K at the right positions in the trainer's vocabulary; ``rank1_tokens`` counts those
    positions (0 would make the check vacuous). ``top1_agreement``: the fraction of valid positions where the
    engine's top-1 id is the trainer's argmax (1.0 up to near-ties in float32, a little less in bf16)."""
    mask = out.mask
    ids = torch.zeros(mask.shape, dtype=torch.long)
    for i, completion in enumerate(out.completion_ids):
        ids[i, : len(completion)] = torch.tensor(completion, dtype=torch.long)
    trainer_top1 = trainer_logits.argmax(-1)
    rank1 = mask & (ids == trainer_top1)
    in_topk = (out.topk_ids == ids[..., None]).any(-1)
    return {
        "rank1_tokens": int(rank1.sum()),
        "sampled_in_topk_when_rank1": bool(in_topk[rank1].all()) and bool(rank1.any()),
        "top1_agreement": float((out.topk_ids[..., 0] == trainer_top1)[mask].float().mean()),
    }


if __name__ == "__main__":
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
        trainer_logp, mask, trainer_logits = sequence_logprobs(model, out.prompt_ids, out.completion_ids,
                                                               return_logits=True)
    result["mu_vs_trainer_mean_abs"] = float((out.logp - trainer_logp).abs()[mask].mean())
    result["topk_sorted"] = bool((out.topk_logp[..., :-1] >= out.topk_logp[..., 1:]).all())
    result.update(topk_agreement(out, trainer_logits))

    check = SyncCheck()
    result["calibrate"] = check.calibrate(engine, model, SyncProbe.from_rollout(out.prompt_ids, out.completion_ids))
    # an update of a large RL step's size (4e-3 per weight, as Adam at lr 4e-3; at 2e-3 the stale engine's gap sat at
    # the bf16 limit itself on one CPU: 0.01690 against 0.01694): a wholesale change of the model (0.02 · N(0, 1) on
    # every weight) changes bf16's rounding error on the probe 2.8× and is a reload of another model, after which the
    # check is calibrated again
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=4e-3)
    result["stale_gap"] = probe_gap(*check._score(engine, model))
    result["threshold"] = check.threshold
    start = time.perf_counter()
    engine.sync_weights(model)
    result["sync_s"] = time.perf_counter() - start
    result["after_sync"] = check.after_sync(engine, model, what="sync 1")
    # a sync that leaves the tied output head behind, the embedding with it: without lm_head.weight alone a CPU
    # engine that repacks its head for oneDNN keeps the old head, but one that falls back to torch's linear (where
    # oneDNN cannot build the matmul: bf16 on some CPUs) reads the head from the embedding it just received
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.02)
    push_weights(engine.llm, [(k, v) for k, v in model.state_dict().items()
                              if k not in ("lm_head.weight", "model.embed_tokens.weight")])
    try:
        check.after_sync(engine, model, what="sync 2 (output head left behind)")
        result["caught"] = None
    except SyncCheckError as err:
        result["caught"] = str(err)
    # a step of Adam's size at lr 1e-6 with the last decoder layer left behind: far below the probe's noise in bf16,
    # named at once by the parameter layer (the engine's readable tensors: norms, biases, embedding)
    check = SyncCheck(on_failure="warn")
    engine.sync_weights(model)
    check.calibrate(engine, model, SyncProbe.from_rollout(out.prompt_ids, out.completion_ids))
    last = max(int(k.split(".")[2]) for k in model.state_dict() if k.startswith("model.layers."))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randint(0, 2, p.shape).float() * 2 - 1, alpha=1e-6)
    push_weights(engine.llm, [(k, v) for k, v in model.state_dict().items()
                              if not k.startswith(f"model.layers.{last}.")])
    result["layer_left"] = check.after_sync(engine, model, what="sync 3 (last layer left behind)")
    result["layer_left_checked"] = check.parameters.checked if check.parameters is not None else None
    print("RESULT " + json.dumps(result))

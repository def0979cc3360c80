"""TRL's own ``train()`` against live vLLM in colocate mode (vLLM's CPU build, the embedded tiny model, bf16 engine
against the fp32 trainer), one scenario after another in this process; prints ``RESULT {json}``.

    PYTHONPATH=. python tests/vllm/scripts/trl_colocate.py trl_is dvp trm8 trm20 trm20_max m2po ipo centering
    PYTHONPATH=. python tests/vllm/scripts/trl_colocate.py --dtype=float32 sync_control head_left_behind sampler_order

Every scenario builds a fresh trainer on a fresh copy of the model (2 steps; the sync scenarios 4); TRL's ``LLM`` — in
``--dtype`` (bfloat16 by default) — is built once (by the
first trainer, with ``max_logprobs`` for the largest K) and handed to the later trainers with the checkpoint's
weights pushed back into it, so each starts as TRL would start it. Run by tests/vllm/test_trl_live.py (vLLM must not
live inside the pytest process) and by examples/trl_vllm.py's test.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
import warnings
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[2] / "data" / "recipes"


def _numbers(history: list[dict]) -> dict[str, list[float]]:
    """TRL's log history as ``{key: [value per logged step]}`` (numbers only)."""
    out: dict[str, list[float]] = {}
    for row in history:
        for key, value in row.items():
            if isinstance(value, (int, float)) and key not in ("epoch", "step"):
                out.setdefault(key, []).append(float(value) if math.isfinite(value) else str(value))
    return out


if __name__ == "__main__":
    import torch
    from offpolicy_testkit.trl_toy import arithmetic_dataset, train_recording_sync_failure, varied_reward
    from trl import GRPOConfig, GRPOTrainer
    from trl.generation import vllm_generation

    from offpolicy.integrations.trl import OffPolicyGRPOTrainer, extra_llm_kwargs, install_vllm_sync
    from offpolicy.integrations.trl.vllm_sync import trl_named_weights
    from offpolicy.models import load_model
    from offpolicy.rollout.vllm import push_weights

    names = sys.argv[1:]
    dtype = "bfloat16"
    if names and names[0].startswith("--dtype="):
        dtype, names = names[0].split("=", 1)[1], names[1:]
    built: dict = {}
    original_llm = vllm_generation.LLM

    def shared_llm(*args, **kwargs):
        """TRL's LLM, built once; later trainers get it back holding the checkpoint's weights."""
        if "llm" not in built:
            built["llm"] = original_llm(*args, **{**kwargs, "max_logprobs": -1, "enforce_eager": True, "dtype": dtype})
        else:
            fresh, _ = load_model("tiny")
            push_weights(built["llm"], fresh.state_dict().items())
        return built["llm"]

    vllm_generation.LLM = shared_llm

    def config(out: str, **kw) -> GRPOConfig:
        base = dict(output_dir=out, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                    max_steps=2, report_to=[], use_cpu=True, bf16=False, logging_steps=1, save_strategy="no",
                    beta=0.0, seed=0, use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128,
                    vllm_importance_sampling_correction=False, temperature=1.0, learning_rate=1e-5)
        return GRPOConfig(**{**base, **kw})

    def offpolicy(out: str, args: dict | None = None, policy_dtype: str | None = None, **kw) -> OffPolicyGRPOTrainer:
        model, tok = load_model("tiny")
        if policy_dtype is not None:  # the policy's own weights in that dtype, as a user loads a bf16 checkpoint
            model = model.to(getattr(torch, policy_dtype))
        return OffPolicyGRPOTrainer(model=model, reward_funcs=varied_reward, args=config(out, **(args or {})),
                                    train_dataset=arithmetic_dataset(), processing_class=tok, **kw)

    HEAD_ARGS = dict(learning_rate=1e-3, max_steps=4, per_device_train_batch_size=8)
    scenarios = {
        # TRL's own IS correction (sequence_mask at 3.0 by default): the baseline, on TRL's own GRPOTrainer with
        # the sync made to work on CPU
        "trl_is": None,
        "dvp": dict(dvp_rho=0.1, args=dict(temperature=0.9, top_k=20, top_p=0.9)),
        "trm8": dict(topk_logprobs=8, correction={"name": "trm"}),
        "trm20": dict(topk_logprobs=20, correction={"name": "trm"}),
        "m2po": dict(correction={"name": "m2po"}),
        "ipo": dict(objective={"name": "ipo", "threshold": 1e-4}),
        "centering": dict(topk_logprobs=8, score_centering=True, correction={"name": "tis", "upper": 2.0}),
        "trm20_max": dict(topk_logprobs=20, correction={"name": "trm", "avg_kl": None}),
        # the recipe file the reference trainer and verl's main_ppo run: ALP, centred on the engine's top-20
        "recipe_alp_centering": dict(recipe=str(RECIPES / "alp_score_centering.yaml")),
        # a head left behind is a few % of one Adam step on the probe: at lr 1e-3 about 0.01 nats per token, under
        # a bf16 engine's own noise (gap ≤ 1.7× its baseline: not flagged) but 10× the fp32 engine's floor; run
        # these two with --dtype=float32
        "sync_control": dict(correction={"name": "tis", "upper": 2.0}, args=HEAD_ARGS),
        "head_left_behind": dict(correction={"name": "tis", "upper": 2.0}, args=HEAD_ARGS),
        # a bf16 policy (its parameters bf16, accelerate's bf16 mixed precision on) against the bf16 engine, the
        # default sync check on; 3 steps at a learning rate bf16 weights can hold (1e-6 would leave most unchanged)
        "bf16_policy": dict(policy_dtype="bfloat16", correction={"name": "tis", "upper": 2.0},
                            args=dict(bf16=True, max_steps=3, learning_rate=1e-3)),
        "bf16_policy_centering": dict(policy_dtype="bfloat16", topk_logprobs=8, score_centering=True,
                                      correction={"name": "tis", "upper": 2.0}, args=dict(bf16=True, learning_rate=1e-3)),
        "bf16_policy_noop_push": dict(policy_dtype="bfloat16", correction={"name": "tis", "upper": 2.0},
                                      args=dict(bf16=True, max_steps=3, learning_rate=1e-3)),
    }
    def sampler_order() -> dict:
        """vLLM's processed distribution at every sampled position (``logprobs=-1``) with top-k, top-p and min-p
        together, against the trainer's replay of the same recipe in vLLM's order and in HF's."""
        from offpolicy.corrections.vocabulary import SUPPORT_ORDER, sampling_support_mask
        from offpolicy.rollout.sampling import TRUNCATION_ORDER
        from offpolicy.rollout.scoring import sequence_logprobs
        from vllm import SamplingParams

        model, tok = load_model("tiny")
        if "llm" not in built:  # run alone: the engine TRL would build
            from offpolicy.models import model_path

            built["llm"] = original_llm(model=str(model_path("tiny")), dtype=dtype, max_logprobs=-1, enforce_eager=True,
                                        logprobs_mode="processed_logprobs", max_model_len=128, seed=0)
        push_weights(built["llm"], model.state_dict().items())
        prompts = [tok(row["prompt"])["input_ids"] for row in arithmetic_dataset(32, seed=1)]
        recipe = dict(temperature=0.9, top_k=20, top_p=0.7, min_p=0.15)
        outs = built["llm"].generate([{"prompt_token_ids": p} for p in prompts],
                                     [SamplingParams(max_tokens=8, logprobs=-1, seed=i, **recipe)
                                      for i in range(len(prompts))], use_tqdm=False)
        completions = [list(o.outputs[0].token_ids) for o in outs]
        with torch.no_grad():
            _, mask, logits = sequence_logprobs(model, prompts, completions, return_logits=True)
        engine = torch.full(logits.shape, -math.inf)
        for i, o in enumerate(outs):
            for j, step in enumerate(o.outputs[0].logprobs):
                engine[i, j, list(step.keys())] = torch.tensor([v.logprob for v in step.values()])
        engine, logits = engine[mask], logits[mask]
        kept = torch.isfinite(engine)
        out: dict = {"positions": int(mask.sum()), "recipe": recipe}
        for label, order in (("vllm", SUPPORT_ORDER), ("hf", TRUNCATION_ORDER)):
            support = sampling_support_mask(logits, order=order, **recipe)
            same = (support == kept).all(-1)
            z = (logits / recipe["temperature"]).masked_fill(~support, -math.inf).log_softmax(-1)
            both = support & kept
            out[label] = {"same_support": float(same.float().mean()),
                          "max_abs_logp_on_support": float((z - engine)[both].abs().max())}
        return out

    result: dict = {}
    for name in names:
        if name == "sampler_order":
            result[name] = sampler_order()
            continue
        out = tempfile.mkdtemp(prefix=f"trl-{name}-")
        start = time.perf_counter()
        entry: dict = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if name == "trl_is":
                model, tok = load_model("tiny")
                with extra_llm_kwargs({"enforce_eager": True}):
                    trainer = GRPOTrainer(model=model, reward_funcs=varied_reward, train_dataset=arithmetic_dataset(),
                                          args=config(out, vllm_importance_sampling_correction=True),
                                          processing_class=tok)
                install_vllm_sync(trainer)
            else:
                kw = dict(scenarios[name])
                trainer = offpolicy(out, kw.pop("args", None), **kw)
            if name == "bf16_policy_noop_push":  # a sync that pushes nothing: the engine keeps the first weights
                trainer.offpolicy_sync.push = lambda: None
            if name == "head_left_behind":  # a sync that leaves the tied output head behind
                generation = trainer.vllm_generation

                def headless(generation=generation):
                    push_weights(generation.llm, ((n, t) for n, t in trl_named_weights(generation)
                                                  if n != "lm_head.weight"))

                trainer.offpolicy_sync.push = headless
            train_recording_sync_failure(trainer, entry)
        entry["seconds"] = time.perf_counter() - start
        entry["log"] = _numbers(trainer.state.log_history)
        entry["policy_dtype"] = str(next(trainer.model.parameters()).dtype)
        entry["warnings"] = [str(w.message) for w in caught if "TRM on the engine" in str(w.message)]
        advice = getattr(trainer, "offpolicy_topk_advice", None)
        entry["advice"] = None if advice is None else {**advice.__dict__, "vacuous": advice.vacuous}
        result[name] = entry
        print(f"{name}: {entry['seconds']:.1f} s", file=sys.stderr, flush=True)
    print("RESULT " + json.dumps(result))

"""``engine_rollout``: offpolicy's rollout engine as TRL's ``rollout_func`` — the prompts tokenised as TRL would, the
engine's log-probs returned as μ, the weights synced every ``sync_every`` optimiser steps. The run inside TRL's own
``train()`` is tests/test_quickstarts.py (examples/quickstart_trl.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from offpolicy.integrations.trl.rollout import engine_rollout, sampling_from_trl
from offpolicy.models.tiny import build_tiny_model
from offpolicy.rollout.hf import HFRolloutEngine


class CountingEngine:
    """An HF engine that records when it takes the trainer's weights."""

    def __init__(self, model, tok):
        self.inner = HFRolloutEngine(model, tokenizer=tok)
        self.synced_at: list[int] = []
        self.step = 0

    def sync_weights(self, model):
        self.synced_at.append(self.step)
        self.inner.sync_weights(model)

    def generate(self, prompt_ids, cfg, *, seed):
        return self.inner.generate(prompt_ids, cfg, seed=seed)


def _trainer(model, tok, step=0):
    args = SimpleNamespace(max_completion_length=4, temperature=1.0, top_k=0, top_p=1.0, min_p=None,
                           repetition_penalty=1.0)
    return SimpleNamespace(model=model, processing_class=tok, args=args, state=SimpleNamespace(global_step=step))


def test_the_rollout_returns_the_engines_tokens_and_log_probs():
    model, tok = build_tiny_model(seed=0)
    engine = HFRolloutEngine(model, tokenizer=tok)
    rollout = engine_rollout(engine, seed=5)
    prompts = ["1+2=", "1+2=", "3+4="]
    out = rollout(prompts, _trainer(model, tok))
    assert out["prompt_ids"] == [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    again = engine.generate(out["prompt_ids"], sampling_from_trl(_trainer(model, tok).args), seed=5)
    assert out["completion_ids"] == [list(c) for c in again.completion_ids]
    for row, lp in enumerate(out["logprobs"]):  # μ: the engine's own log-prob of each sampled token
        assert len(lp) == len(out["completion_ids"][row])
        torch.testing.assert_close(torch.tensor(lp), again.logp[row, : len(lp)])
    # the second call draws with the next seed (not the same tokens again by construction)
    assert rollout(prompts, _trainer(model, tok))["completion_ids"] == \
        [list(c) for c in engine.generate(out["prompt_ids"], sampling_from_trl(_trainer(model, tok).args), seed=6).completion_ids]


def test_the_weights_are_synced_every_sync_every_steps():
    model, tok = build_tiny_model(seed=0)
    engine = CountingEngine(model, tok)
    rollout = engine_rollout(engine, sync_every=3)
    for step in [0, 0, 1, 2, 3, 4, 5, 6, 6, 7]:  # two generations in a step (gradient accumulation) sync once
        engine.step = step
        rollout(["1+2="], _trainer(model, tok, step))
    assert engine.synced_at == [0, 3, 6]


def test_the_engine_follows_the_trainer_only_when_synced():
    model, tok = build_tiny_model(seed=0)
    engine = HFRolloutEngine(model, tokenizer=tok)
    rollout = engine_rollout(engine, sync_every=2)
    rollout(["1+2="], _trainer(model, tok, 0))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)
    first = next(engine.model.parameters()).detach().clone()
    rollout(["1+2="], _trainer(model, tok, 1))  # lag 1: still the step-0 weights
    assert torch.equal(next(engine.model.parameters()), first)
    rollout(["1+2="], _trainer(model, tok, 2))  # synced: the trainer's weights, in bf16
    torch.testing.assert_close(next(engine.model.parameters()).float(), next(model.parameters()).detach(),
                               atol=1e-2, rtol=1e-2)


def test_bad_arguments_are_named():
    model, tok = build_tiny_model(seed=0)
    with pytest.raises(ValueError, match="sync_every must be an int >= 1, got 0"):
        engine_rollout(HFRolloutEngine(model, tokenizer=tok), sync_every=0)
    with pytest.raises(ValueError, match="engine must be an offpolicy rollout engine"):
        engine_rollout(object())
    rollout = engine_rollout(HFRolloutEngine(model, tokenizer=tok))
    with pytest.raises(ValueError, match="prompts must be plain text"):
        rollout([[{"role": "user", "content": "1+2="}]], _trainer(model, tok))


def test_the_recipe_is_trls():
    args = SimpleNamespace(max_completion_length=6, temperature=0.7, top_k=5, top_p=0.9, min_p=0.01,
                           repetition_penalty=1.1)
    cfg = sampling_from_trl(args)
    assert (cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p, cfg.repetition_penalty) == \
        (6, 0.7, 5, 0.9, 0.01, 1.1)
    off = sampling_from_trl(SimpleNamespace(max_completion_length=6, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0))
    assert (off.top_k, off.top_p, off.min_p) == (None, None, None)


def test_vllm_logprob_lists_is_a_test_helper_outside_the_package():
    # vLLM's layout for stubs of TRL's VLLMClient lives in offpolicy_testkit.vllm_layout, not in the library
    import doctest

    from offpolicy_testkit import vllm_layout

    import offpolicy.integrations.trl as trl_api

    assert not hasattr(trl_api, "vllm_logprob_lists") and "vllm_logprob_lists" not in trl_api.__all__
    result = doctest.testmod(vllm_layout)
    assert result.attempted > 0 and result.failed == 0

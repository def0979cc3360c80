"""The presets for stale data run in the trainer: m2po, ipo, score_centering (exact and top-k), with their metrics."""

from __future__ import annotations

import math

import pytest
import torch

from offpolicy.train.config import load_config
from offpolicy.train.loop import train


@pytest.mark.parametrize("preset, metric", [("m2po", "m2po/m2_before"), ("ipo", "loss/ipo_masked")])
def test_two_steps_on_a_lagging_engine(preset, metric, tmp_path, fresh, make_overrides, varying_task):
    model, tok = fresh
    before = [p.detach().clone() for p in model.parameters()]
    cfg = load_config(None, make_overrides(tmp_path, preset, steps=2, rollout__sync_every=2, rollout__dtype="float32"))
    res = train(cfg, model=model, tokenizer=tok, task=varying_task())
    assert all(math.isfinite(r["loss/loss"]) and math.isfinite(r[metric]) for r in res.history)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize("preset", ["score_centering", "score_centering_topk"])
def test_trainer_logs_the_drift_and_trains(preset, tmp_path, fresh, make_overrides, varying_task):
    model, tok = fresh
    before = [p.detach().clone() for p in model.parameters()]
    # an engine synced every 2 steps: step 2 samples with step 1's weights (q ≠ p), step 1 is on-policy (q = p)
    cfg = load_config(None, make_overrides(tmp_path, preset, steps=2, rollout__sync_every=2, rollout__dtype="float32"))
    res = train(cfg, model=model, tokenizer=tok, task=varying_task())
    h = res.history
    assert all(math.isfinite(r["loss/loss"]) for r in h)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    # the drift ½‖q − p_θ‖₁ is measured at each minibatch's π_θ: step 1 is the engine's own policy until the first
    # update moves θ; step 2's rollout lags by one step, so its drift is larger
    assert h[1]["score_centering/drift_tv"] > h[0]["score_centering/drift_tv"] >= 0.0
    assert 0.0 <= h[1]["score_centering/topk_gap_tv"] <= h[1]["score_centering/drift_tv"] + 1e-6


@pytest.mark.parametrize("preset, sampling", [("score_centering_tis", {}), ("score_centering_icepop", {}),
                                              ("score_centering_replay", {"rollout__sampling__top_k": 8})])
def test_is_rule_presets_train_with_their_weight_and_no_correction(preset, sampling, tmp_path, fresh, make_overrides,
                                                                   varying_task):
    model, tok = fresh
    before = [p.detach().clone() for p in model.parameters()]
    cfg = load_config(None, make_overrides(tmp_path, preset, steps=2, rollout__sync_every=2, rollout__dtype="float32",
                                           **sampling))
    res = train(cfg, model=model, tokenizer=tok, task=varying_task())
    h = res.history
    assert all(math.isfinite(r["loss/loss"]) for r in h)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    # the weight is logged (only the IS-rule path computes it); replay's rule has none (w = 1, nothing clipped)
    assert all(0.0 < r["score_centering/is_weight"] and 0.0 <= r["score_centering/is_clipped"] <= 1.0 for r in h)
    if preset == "score_centering_replay":  # w = 1 wherever the trainer's own top-8 holds the token: all of step 1
        # (same weights), not all of step 2 (a lagging sampler's token outside it has π_old = 0 and is dropped)
        assert h[0]["score_centering/is_weight"] == pytest.approx(1.0)
        assert all(r["score_centering/is_weight"] <= 1.0 + 1e-6 and r["score_centering/is_clipped"] == 0.0 for r in h)
    assert not any(k.startswith("tis/") or k.startswith("icepop/") for k in h[0])  # no correction chain

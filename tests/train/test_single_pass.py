"""The single pass: with one optimiser step over the whole batch, the scoring's forward (with its graph) is π_θ's —
the update runs no second forward, and the run matches the one that does."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from offpolicy.rollout.scoring import sequence_logprobs
from offpolicy.train import steps
from offpolicy.train.config import load_config
from offpolicy.train.loop import train
from offpolicy.train.scoring import score_policy
from offpolicy.train.update import update_step


def _state(tmp_path, model, tok, task, make_overrides, **extra):
    cfg = load_config(None, make_overrides(tmp_path, **extra))
    return steps.build_state(cfg, model=model, tokenizer=tok, task=task)


@pytest.mark.parametrize("extra, expected", [
    ({}, True),
    ({"optim__minibatches": 2}, False),
    ({"optim__epochs": 2}, False),
    ({"preset": "alp"}, False),  # π_θ's forward has ALP noise on, π_old's has it off
])
def test_single_pass_only_when_theta_is_theta_old(extra, expected, tmp_path, fresh, make_overrides, varying_task):
    model, tok = fresh
    assert steps.single_pass(_state(tmp_path, model, tok, varying_task(), make_overrides, **extra)) is expected


@pytest.mark.parametrize("preset", ["mis", "dvp_mis", "trm"])
def test_the_scoring_forward_is_pi_old_and_serves_the_update_once(preset, tmp_path, fresh, make_overrides,
                                                                  varying_task):
    model, tok = fresh
    state = _state(tmp_path, model, tok, varying_task(), make_overrides, preset=preset)
    rollout = steps.rollout_step(state, seed=3)
    scored = steps.score_step(state, rollout)
    with torch.no_grad():  # the separate no-grad forward the trainer used to run: bitwise the same π_old
        expected = score_policy(model, rollout.prompt_ids, rollout.completions, state.sampling,
                                      dtype=torch.float32, dvp_rho=state.cfg.algorithm.dvp_rho if preset == "dvp_mis"
                                      else None)[0]
    assert torch.equal(scored.old_logp, expected) and not scored.old_logp.requires_grad
    assert scored.theta is not None and scored.theta[0].requires_grad
    updates = update_step(state, rollout, scored, seed=3)
    assert len(updates) == 1 and math.isfinite(float(updates[0]["loss/loss"]))
    assert scored.theta is None  # the graph is released after its backward


def test_a_run_with_the_single_pass_matches_one_without(tmp_path, tiny_pair, make_overrides, varying_task,
                                                         monkeypatch):
    model, tok = tiny_pair
    runs = []
    for reuse in (True, False):
        if not reuse:  # the update runs its own π_θ forward, as before the single pass existed
            monkeypatch.setattr(steps, "single_pass", lambda state: False)
        cfg = load_config(None, make_overrides(tmp_path / str(reuse), "tis", steps=3))
        runs.append(train(cfg, model=copy.deepcopy(model), tokenizer=tok, task=varying_task()))
    (a, b) = runs
    for ha, hb in zip(a.history, b.history):
        for key in ("loss/loss", "loss/grad_norm", "rollout_correction/k3_kl", "reward/mean"):
            # the gradient is summed over rows in another order: equal up to float32 rounding
            assert ha[key] == pytest.approx(hb[key], rel=1e-5, abs=1e-7), key
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_scoring_keeps_only_the_completion_positions_bitwise(tiny_pair):
    model, _ = tiny_pair
    prompts, completions = [[1, 19, 13, 7, 8], [1, 20]], [[21, 2, 5], [22]]
    logp, mask, logits = sequence_logprobs(model, prompts, completions, return_logits=True)
    # by hand: one full forward over every position, the logit at p_i − 1 + t predicts completion token t
    ids = torch.tensor([[1, 19, 13, 7, 8, 21, 2, 5], [1, 20, 22, 0, 0, 0, 0, 0]])
    attn = torch.tensor([[1] * 8, [1, 1, 1, 0, 0, 0, 0, 0]])
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=attn).logits.float()
    assert torch.equal(logits[0], full[0, 4:7]) and torch.equal(logits[1, :1], full[1, 1:2])
    expected = full[0, 4:7].log_softmax(-1).gather(-1, torch.tensor([[21], [2], [5]]))[:, 0]
    assert torch.equal(logp[0], expected.detach()) and mask.tolist() == [[True] * 3, [True, False, False]]

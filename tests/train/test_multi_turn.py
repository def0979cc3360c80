"""The trainer on a multi-turn task: token-in/token-out has no drift, re-tokenizing is measured, tool tokens and
padding never reach the loss in a single pass or in minibatches, and configs that cannot be served are refused."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from offpolicy.batch import LogProbBatch
from offpolicy.losses import policy_loss
from offpolicy.train import steps
from offpolicy.train.config import load_config
from offpolicy.train.loop import train
from offpolicy.train.multi_turn import mask_scored, multi_turn_rollout, multi_turn_step
from offpolicy.train.update import _minibatch

MULTI = {"task__name": "tool_calc", "rollout__sampling__max_new_tokens": 6}


def _state(tmp_path, fresh, make_overrides, **extra):
    model, tok = fresh
    cfg = load_config(None, make_overrides(tmp_path, **MULTI, **extra))
    return steps.build_state(cfg, model=model, tokenizer=tok)


@pytest.mark.parametrize("mode", ["engine", "retokenize"])
def test_a_multi_turn_run_logs_drift_and_per_turn_mismatch(mode, tmp_path, fresh, make_overrides):
    model, tok = fresh
    cfg = load_config(None, make_overrides(tmp_path, **MULTI, task__multi_turn_ids=mode))
    last = train(cfg, model=model, tokenizer=tok).history[-1]
    for key in ("multi_turn/turn1/k3", "multi_turn/turn2/first_abs_logp_diff", "multi_turn/drift/tool1",
                "multi_turn/retokenize_drift_positions", "reward/mean"):
        assert key in last
    assert last["multi_turn/tool_tokens"] > 0
    if mode == "engine":  # the trainer's ids are the engine's
        assert last["multi_turn/drift_positions"] == 0 and last["multi_turn/unaligned_tokens"] == 0
    else:  # the trainer's drift is the re-tokenization's
        assert last["multi_turn/drift_positions"] == last["multi_turn/retokenize_drift_positions"]


@pytest.mark.parametrize("mode", ["engine", "retokenize"])
def test_tool_tokens_and_padding_never_contribute_to_the_loss(mode, tmp_path, fresh, make_overrides):
    state = _state(tmp_path, fresh, make_overrides, task__multi_turn_ids=mode)
    rollout = multi_turn_rollout(state, seed=3)
    scored = mask_scored(steps.score_step(state, rollout), rollout)
    b, t = scored.mask.shape
    for i, view in enumerate(rollout.views):  # valid exactly at the policy tokens that carry an engine log-prob
        expected = torch.zeros(t, dtype=torch.bool)
        expected[: len(view.loss)] = torch.tensor(view.loss)
        assert torch.equal(scored.mask[i], expected)
        tool = [j for j, k in enumerate(view.segment) if k > 0 and rollout.conversations[i].segments[k].role == "tool"]
        assert tool and not scored.mask[i, tool].any()
    assert (scored.rollout_logp[~scored.mask] == 0).all()
    # the loss the single-pass update computes from this mask: its gradient is 0 at every tool / padding position
    assert scored.theta is not None  # the single pass keeps the scoring forward's graph
    logp = scored.old_logp.clone().requires_grad_(True)
    batch = LogProbBatch(logp=logp, mask=scored.mask, old_logp=scored.old_logp,
                               rollout_logp=scored.rollout_logp, advantages=torch.linspace(-1, 1, b))
    loss, _ = policy_loss(batch, correction=state.correction, objective={"name": state.objective,
                                                                          **state.objective_params})
    loss.backward()
    assert logp.grad is not None
    assert (logp.grad[~scored.mask] == 0).all() and (logp.grad[scored.mask] != 0).any()


def test_the_engines_ids_are_what_the_trainer_scores(tmp_path, fresh, make_overrides):
    state = _state(tmp_path, fresh, make_overrides)
    rollout, scored, metrics = multi_turn_step(state, seed=4)
    for conv, prompt, completion in zip(rollout.conversations, rollout.prompt_ids, rollout.completions):
        assert prompt == list(conv.segments[0].ids)
        assert completion == [i for s in conv.segments[1:] for i in s.ids]
    assert float(metrics["multi_turn/drift_positions"]) == 0.0


@pytest.mark.parametrize("extra", [{"optim__minibatches": 2}, {"optim__epochs": 2},
                                   {"optim__minibatches": 2, "optim__epochs": 2}, {"preset": "alp"}])
def test_every_minibatch_keeps_tool_tokens_out_of_the_loss(extra, tmp_path, fresh, make_overrides):
    state = _state(tmp_path, fresh, make_overrides, **extra)
    rollout, scored, _ = multi_turn_step(state, seed=5)
    assert scored.theta is None  # the update scores π_θ again: the mask must come from the scoring
    rows = torch.arange(len(rollout.completions))
    batch = _minibatch(state, rollout, scored, rows[1::2])
    t = batch.mask.shape[1]
    assert torch.equal(batch.mask, scored.mask[rows[1::2], :t])
    assert (~batch.mask & (rollout.loss_mask[rows[1::2], :t] == 0)).any()  # tool / padding positions are there
    batch = dataclasses.replace(batch, advantages=torch.linspace(-1, 1, len(batch.advantages)))  # nonzero
    loss, _ = policy_loss(batch, correction=state.correction, objective={"name": state.objective,
                                                                          **state.objective_params})
    grad, = torch.autograd.grad(loss, batch.logp)
    assert (grad[~batch.mask] == 0).all() and (grad[batch.mask] != 0).any()
    history = train(state.cfg, model=fresh[0], tokenizer=fresh[1]).history
    assert history and all(math.isfinite(h["loss/loss"]) for h in history)


def test_replaying_the_engines_routes_is_refused(tmp_path, fresh, make_overrides):
    state = _state(tmp_path, fresh, make_overrides)
    state.cfg.rollout.routing_replay = "r3"
    with pytest.raises(ValueError, match="rollout.routing_replay"):
        multi_turn_step(state, seed=0)


def test_an_unknown_id_mode_is_refused(tmp_path, make_overrides):
    with pytest.raises(ValueError, match="multi_turn_ids"):
        load_config(None, make_overrides(tmp_path, **MULTI, task__multi_turn_ids="text"))

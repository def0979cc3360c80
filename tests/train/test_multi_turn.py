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
from offpolicy.train.multi_turn import mask_scored, multi_turn_rollout, multi_turn_step, padded
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
                                   {"optim__minibatches": 2, "optim__epochs": 2}, {"preset": "alp"},
                                   {"preset": "score_centering", "optim__minibatches": 2}])
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


def test_score_centering_centres_on_the_engines_q_over_the_whole_conversation(tmp_path, fresh, make_overrides):
    state = _state(tmp_path, fresh, make_overrides, preset="score_centering")
    rollout, scored, _ = multi_turn_step(state, seed=6)
    q = scored.sampler_logits  # the engine's re-score of every completion token, tool turns included
    assert q is not None and q.shape[:2] == scored.mask.shape
    engine_logp = torch.log_softmax(q.float(), -1).gather(-1, padded(rollout.completions, 0, torch.long,
                                                                      q.shape[1]).unsqueeze(-1)).squeeze(-1)
    # at the policy tokens, q is the distribution the engine sampled them from (its reported log-prob)
    torch.testing.assert_close(engine_logp[scored.mask], scored.rollout_logp[scored.mask], atol=1e-4, rtol=0)


def test_r2_replays_the_scoring_routes_on_every_conversation_token(tmp_path, tiny_pair, make_overrides):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    _, tok = tiny_pair
    torch.manual_seed(0)
    moe = Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        num_experts=8, num_experts_per_tok=2, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)).eval()
    cfg = load_config(None, make_overrides(tmp_path, **MULTI, steps=2, rollout__routing_replay="r2"))
    history = train(cfg, model=moe, tokenizer=tok).history
    for row in history:
        assert "routing/flip_rate" not in row  # the engine's routes are not recorded across turns: nothing to compare
        # one update on the scoring's weights with its routes replayed: π_θ is π_old at every token (a route
        # replayed at the wrong position would move the ratio)
        assert abs(row["loss/ratio_max"] - 1) < 1e-5 and abs(row["loss/ratio_min"] - 1) < 1e-5

"""algorithm.proximal=loglinear in the reference trainer: versions recorded with each rollout, no π_prox forward, the
loss on AReaL's interpolation — equal to the forward's on fresh data, the hand-computed α on stale data."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from offpolicy.batch import LogProbBatch
from offpolicy.losses import policy_loss
from offpolicy.train import steps
from offpolicy.train import update as UPDATE  # where the update's private helpers live
from offpolicy.train.config import load_config, objective_call
from offpolicy.train.loop import train
from offpolicy.train.proximal import with_versions
from offpolicy.train.scoring import score_policy

DECOUPLED = {"name": "decoupled", "clip_low": 0.2, "clip_high": 0.28}  # the trainer's clip range


def _cfg(tmp_path, make_overrides, proximal="loglinear", preset="tis", **extra):
    extra = {"algorithm__objective": "decoupled", "algorithm__proximal": proximal, **extra}
    return load_config(None, make_overrides(tmp_path, preset, **extra))


def _state(tmp_path, model, tok, task, make_overrides, **extra):
    return steps.build_state(_cfg(tmp_path, make_overrides, **extra), model=model, tokenizer=tok, task=task)


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.preset=tis", "algorithm.proximal=loglinear"], "algorithm.proximal does not apply to objective 'ppo'"),
    (["algorithm.preset=trm", "algorithm.objective=decoupled", "algorithm.proximal=loglinear"], "preset 'trm' needs"),
    (["algorithm.preset=dvp", "algorithm.objective=decoupled", "algorithm.proximal=loglinear"], "preset 'dvp' needs"),
    (["algorithm.preset=score_centering", "algorithm.objective=decoupled", "algorithm.proximal=loglinear"],
     "preset 'score_centering' needs"),
    (["algorithm.objective=decoupled", "algorithm.proximal=loglinear", "rollout.routing_replay=r2"],
     "rollout.routing_replay=r2"),
    (["algorithm.objective=decoupled", "algorithm.proximal=forward"], "algorithm.proximal"),
])
def test_config_refuses_what_loglinear_cannot_do(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_the_objectives_own_proximal_parameter_is_the_same_switch():
    cfg = load_config(None, ["algorithm.objective={name: decoupled, proximal: loglinear}"])
    assert objective_call(cfg) == ("decoupled", {"clip_low": 0.2, "clip_high": 0.28, "proximal": "loglinear"})
    assert objective_call(load_config(None, ["algorithm.objective=decoupled", "algorithm.proximal=loglinear"])) \
        == objective_call(cfg)


def test_each_rollout_carries_the_engines_version_per_token_and_padding_none(tmp_path, fresh, make_overrides,
                                                                            varying_task):
    model, tok = fresh
    state = _state(tmp_path, model, tok, varying_task(), make_overrides)
    state.policy_version = 5  # as after 5 steps: a sync hands the engine version 5
    rollout = steps.rollout_step(state, seed=1)
    _, mask, _, _ = score_policy(model, rollout.prompt_ids, rollout.completions, state.sampling,
                                       dtype=torch.float32)
    assert rollout.versions is not None and rollout.versions.dtype == torch.int64
    assert torch.equal(rollout.versions, torch.where(mask, 5, -1))
    state.policy_version = 7  # no sync: the engine keeps version 5
    assert (steps.rollout_step(state, seed=2, sync_weights=False).versions.max() == 5)
    scored = steps.score_step(state, rollout)  # without a forward, the forward's mask from the lengths
    assert torch.equal(scored.mask, mask)


def test_a_rollout_without_versions_is_refused(tmp_path, fresh, make_overrides, varying_task):
    model, tok = fresh
    state = _state(tmp_path, model, tok, varying_task(), make_overrides)
    rollout = steps.rollout_step(state, seed=1)
    rollout.versions = None
    with pytest.raises(ValueError, match=r"^versions: algorithm.proximal=loglinear needs the per-token policy versions"):
        steps.score_step(state, rollout)


class _Forwards:
    """Counts the trainer model's forward calls."""

    def __init__(self, model: torch.nn.Module):
        self.n = 0
        self.handle = model.register_forward_hook(self._count)

    def _count(self, module, args, output):
        self.n += 1


@pytest.mark.parametrize("proximal, minibatches, expected", [
    ("recompute", 2, 3),  # π_prox's no-grad forward + one π_θ forward per minibatch
    ("loglinear", 2, 2),  # the π_θ forwards only
    ("recompute", 1, 1),  # single pass: π_prox's forward is π_θ's
    ("loglinear", 1, 1),
])
def test_loglinear_skips_the_proximal_forward(proximal, minibatches, expected, tmp_path, fresh, make_overrides,
                                              varying_task):
    model, tok = fresh
    state = _state(tmp_path, model, tok, varying_task(), make_overrides, proximal=proximal,
                   optim__minibatches=minibatches)
    rollout = steps.rollout_step(state, seed=1)
    forwards = _Forwards(state.model)
    scored = steps.score_step(state, rollout)
    UPDATE.update_step(state, rollout, scored, seed=1)
    forwards.handle.remove()
    assert forwards.n == expected
    assert state.policy_version == 1


def test_on_fresh_data_the_run_matches_the_forwards(tmp_path, tiny_pair, make_overrides, varying_task):
    """An fp32 engine synced every step: every token is fresh (v_behave = v_θ, α = 0, π_prox = μ) and μ equals the
    forward's π_old up to the engine's KV-cache rounding, so the runs agree to that rounding — two minibatches, so
    π_θ has moved from π_prox on the second (a wrong α would show there)."""
    model, tok = tiny_pair
    runs = []
    for proximal in ("recompute", "loglinear"):
        cfg = _cfg(tmp_path / proximal, make_overrides, proximal=proximal, steps=3, rollout__dtype="float32",
                   optim__minibatches=2)
        runs.append(train(cfg, model=copy.deepcopy(model), tokenizer=tok, task=varying_task()))
    a, b = runs
    assert any(abs(h["loss/loss"]) > 1e-4 for h in a.history)  # there is a loss to compare
    for ha, hb in zip(a.history, b.history, strict=True):
        for key in ("loss/loss", "loss/grad_norm", "loss/ratio_max", "reward/mean"):
            assert ha[key] == pytest.approx(hb[key], rel=1e-4, abs=1e-6), key
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-6)


def test_on_stale_data_the_loss_reads_the_hand_computed_interpolation(tmp_path, fresh, make_overrides, varying_task,
                                                                     monkeypatch):
    """Engine synced at step 0, trained at step 2: v_behave = 0, v_θ = 2, α = (2 − 1 − 0)/(2 − 0) = ½."""
    model, tok = fresh
    state = _state(tmp_path, model, tok, varying_task(), make_overrides, preset="naive", optim__minibatches=2)
    seen: list[tuple[LogProbBatch, torch.Tensor]] = []
    loss_of = UPDATE._loss

    def spy(state, batch):
        loss, metrics = loss_of(state, batch)
        seen.append((batch, loss.detach()))
        return loss, metrics

    monkeypatch.setattr(UPDATE, "_loss", spy)
    for step in range(3):
        rollout = steps.rollout_step(state, seed=step, sync_weights=step == 0)
        scored = steps.score_step(state, rollout)
        seen.clear()
        UPDATE.update_step(state, rollout, scored, seed=step)
    assert len(seen) == 2
    for batch, loss in seen:
        valid = batch.bool_mask
        assert batch.policy_version == 2 and batch.old_logp is None
        assert (batch.versions[valid] == 0).all() and (batch.versions[~valid] == -1).all()
        mu, theta = batch.rollout_logp, batch.logp.detach()
        by_hand = batch.replace(old_logp=mu + 0.5 * (theta - mu), versions=None, policy_version=None)
        expected, _ = policy_loss(by_hand, objective=DECOUPLED)
        torch.testing.assert_close(loss, expected)
    # the step's π_old diagnostics hold the approximation the first minibatch's loss read, on its rows
    first, _ = seen[0]
    rows = torch.randperm(len(rollout.completions), generator=torch.Generator().manual_seed(2)).tensor_split(2)[0]
    valid = first.bool_mask
    expected = first.rollout_logp + 0.5 * (first.logp.detach() - first.rollout_logp)
    torch.testing.assert_close(scored.old_logp[rows, : first.seq_len][valid], expected[valid])


def test_padding_never_contributes(tmp_path, fresh, make_overrides, varying_task):
    """Whatever μ and the versions hold past a completion's end, the loss and its gradient are the same."""
    model, tok = fresh
    state = _state(tmp_path, model, tok, varying_task(), make_overrides, preset="naive",
                   rollout__sampling__max_new_tokens=6)
    state.policy_version = 3  # trained at version 3 on an engine at version 0: α = 2/3 on the sampled tokens
    rollout = steps.rollout_step(state, seed=4, sync_weights=False)
    rollout.completions[0] = rollout.completions[0][:2]  # row 0 ends after two tokens: four positions of padding
    rollout.versions[0, 2:] = -1
    rows = torch.arange(len(rollout.completions))
    results = []
    for junk_logp, junk_version in ((50.0, 2), (-80.0, -7), (float("nan"), 0)):
        r = copy.copy(rollout)
        r.rollout_logp = rollout.rollout_logp.clone()
        r.rollout_logp[0, 2:] = junk_logp
        r.versions = rollout.versions.clone()
        r.versions[0, 2:] = junk_version
        scored = steps.score_step(state, r)
        assert not scored.mask[0, 2:].any()
        batch = with_versions(UPDATE._minibatch(state, r, scored, rows), r.versions, state.policy_version)
        state.model.zero_grad(set_to_none=True)
        loss, _ = UPDATE._loss(state, batch)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in state.model.parameters() if p.grad is not None])
        results.append((loss.detach(), grads))
    assert math.isfinite(float(results[0][0])) and results[0][1].abs().sum() > 0
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0])
        torch.testing.assert_close(grads, results[0][1])


def test_a_resumed_run_keeps_its_versions(tmp_path, tiny_pair, make_overrides, varying_task):
    """Interrupted after 2 of 4 steps on an engine synced every 3: step 3 trains at v_θ = 2 on tokens of version 0
    (α = ½) only if the resumed run takes its versions from the step it resumes at; it then matches the run that was
    not interrupted."""
    model, tok = tiny_pair

    def run(folder, steps, resume=False):
        cfg = _cfg(tmp_path / folder, make_overrides, steps=steps, rollout__sync_every=3, optim__minibatches=2)
        return train(cfg, model=copy.deepcopy(model), tokenizer=tok, task=varying_task(), resume=resume)

    whole = run("whole", 4)
    run("halves", 2)
    second = run("halves", 4, resume=True)
    assert second.state is not None and (second.state.policy_version, second.state.engine_version) == (4, 3)
    for ha, hb in zip(whole.history[2:], second.history, strict=True):
        for key in ("loss/loss", "loss/grad_norm", "rollout_correction/k3_kl"):
            assert ha[key] == pytest.approx(hb[key], rel=1e-6, abs=1e-9), key

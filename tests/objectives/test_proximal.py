"""Decoupled PPO's proximal policy from policy versions (AReaL's ``loglinear``): α and log π_prox by hand, against
AReaL's formula on the same inputs, inside policy_loss (with and without a correction), and the refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.batch import LogProbBatch
from offpolicy.losses import policy_loss
from offpolicy.objectives.proximal import approximate_proximal, loglinear_alpha, loglinear_proximal_logp
from offpolicy.registry import build_correction


def areal_loglinear(old_logp, logprobs, versions, current_version):
    """AReaL ``areal/trainer/ppo/actor.py::compute_prox_logp_approximations`` (method ``loglinear``, lines 604–666 of
    the stored snapshot 4aef98d): v_prox = current − 1; α = (v_prox − v_behave)/(v_θ − v_behave) where
    v_θ − v_behave > 0 and the token was generated (version ≥ 0), else 0; clamped to [0, 1];
    old_logp + α·(logprobs − old_logp). ``old_logp`` is AReaL's behaviour log-prob (our μ)."""
    v_behave = versions.float()
    v_theta = float(current_version)
    diff = v_theta - v_behave
    gap = (current_version - 1) - v_behave
    alpha = torch.where((diff > 0) & (versions >= 0), gap / diff, torch.zeros_like(v_behave)).clamp(0.0, 1.0)
    return old_logp + alpha * (logprobs - old_logp)


def batch(logp, versions, policy_version=7, **kw):
    b, t = logp.shape
    g = torch.Generator().manual_seed(1)
    return LogProbBatch(logp=logp, mask=torch.ones(b, t), rollout_logp=logp.detach() - torch.rand(b, t, generator=g),
                        advantages=torch.linspace(-1.0, 1.0, b), versions=versions, policy_version=policy_version,
                        **kw)


def test_alpha_and_logp_by_hand():
    # v_θ = 7, v_prox = 6: fresh (7) → 0; 1-stale (6) → 0; 2-stale (5) → ½; 3-stale (4) → ⅔; 7-stale (0) → 6/7
    alpha = loglinear_alpha(torch.tensor([[7, 6, 5, 4, 0]]), 7)
    torch.testing.assert_close(alpha, torch.tensor([[0.0, 0.0, 0.5, 2 / 3, 6 / 7]]))
    # log μ = −2, log π_θ = −1: log π_prox = −2 + α
    versions = torch.tensor([[7, 6, 5, 4, 0]])
    out = loglinear_proximal_logp(torch.full((1, 5), -1.0), torch.full((1, 5), -2.0), versions, 7)
    torch.testing.assert_close(out, torch.tensor([[-2.0, -2.0, -1.5, -4 / 3, -2 + 6 / 7]]))


def test_equal_versions_give_the_behaviour_policy():
    lp = torch.randn(2, 3)
    mu = lp - 0.3
    for v in (0, 5):  # v_θ == v_behave (α's 0/0 case) and a version-less token (< 0)
        out = loglinear_proximal_logp(lp, mu, torch.full((2, 3), v), v)
        assert torch.equal(out, mu)
    assert torch.equal(loglinear_proximal_logp(lp, mu, torch.full((2, 3), -1), 5), mu)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), current=st.integers(0, 12), b=st.integers(1, 3), t=st.integers(1, 6))
def test_equals_areal_on_the_same_inputs(seed, current, b, t):
    g = torch.Generator().manual_seed(seed)
    versions = torch.randint(-1, current + 3, (b, t), generator=g)  # prompt-like −1, stale, fresh, ahead
    lp, mu = -torch.rand(b, t, generator=g) * 5, -torch.rand(b, t, generator=g) * 5
    torch.testing.assert_close(loglinear_proximal_logp(lp, mu, versions, current),
                               areal_loglinear(mu, lp, versions, current), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("correction", [None, "tis"])
def test_policy_loss_equals_recompute_with_the_approximation_as_old_logp(correction):
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(3, 4, generator=g) * 3).requires_grad_(True)
    versions = torch.tensor([[7, 6, 5, 3], [6, 6, 4, 4], [2, 7, 7, 1]])
    b = batch(lp, versions)
    corr = build_correction(correction) if correction else None
    loss, metrics = policy_loss(b, objective={"name": "decoupled", "proximal": "loglinear"}, correction=corr)
    grad = torch.autograd.grad(loss, lp)[0]
    approx = areal_loglinear(b.rollout_logp, lp.detach(), versions, 7)
    lp2 = lp.detach().clone().requires_grad_(True)
    ref, ref_metrics = policy_loss(b.replace(logp=lp2, old_logp=approx), objective="decoupled", correction=corr)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, torch.autograd.grad(ref, lp2)[0])  # the approximation carries no gradient
    assert metrics["loss/ratio_mean"].item() == pytest.approx(ref_metrics["loss/ratio_mean"].item())
    # and it is not the recompute loss on the batch's own old_logp (here: none, i.e. π_θ itself)
    plain, _ = policy_loss(b.replace(logp=lp2.detach()), objective="decoupled", correction=corr)
    assert plain.item() != pytest.approx(loss.item())


def test_one_step_stale_data_weights_nothing_and_clips_against_mu():
    # every token one version behind: π_prox = μ, so the behaviour weight π_prox/μ is 1 and PPO clips π_θ/μ
    lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    b = LogProbBatch(logp=lp, mask=torch.ones(1, 2), rollout_logp=torch.tensor([[-1.0, -2.0]]),
                     advantages=torch.tensor([1.0]), versions=torch.tensor([[4, 4]]), policy_version=5)
    loss, _ = policy_loss(b, objective={"name": "decoupled", "proximal": "loglinear"})
    assert loss.item() == pytest.approx(-(1.0 + 1.2) / 2)  # r = (1, e) → (1, clipped 1.2)


def test_refusals_name_the_missing_field():
    lp = torch.zeros(1, 2)
    spec = {"name": "decoupled", "proximal": "loglinear"}
    with pytest.raises(ValueError, match="^versions: "):
        policy_loss(batch(lp, None), objective=spec)
    with pytest.raises(ValueError, match="^policy_version: "):
        policy_loss(batch(lp, torch.tensor([[1, 2]]), policy_version=None), objective=spec)
    with pytest.raises(ValueError, match="^rollout_logp: "):
        approximate_proximal(batch(lp, torch.tensor([[1, 2]])).replace(rollout_logp=None))
    with pytest.raises(ValueError, match="^proximal must be one of"):
        policy_loss(batch(lp, torch.tensor([[1, 2]])), objective={"name": "decoupled", "proximal": "linear"})
    with pytest.raises(ValueError, match="has no parameter 'proximal'"):
        policy_loss(batch(lp, torch.tensor([[1, 2]])), objective={"name": "ppo", "proximal": "loglinear"})
    with pytest.raises(ValueError, match="^versions must be an integer tensor"):
        batch(lp, torch.tensor([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="^versions has shape"):
        batch(lp, torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="^policy_version must be an int"):
        batch(lp, torch.tensor([[1, 2]]), policy_version=True)


def test_an_empty_batch_still_works():
    lp = torch.zeros(0, 3, requires_grad=True)
    b = LogProbBatch(logp=lp, mask=torch.zeros(0, 3), rollout_logp=torch.zeros(0, 3), advantages=torch.zeros(0),
                     versions=torch.zeros(0, 3, dtype=torch.long), policy_version=2)
    loss, _ = policy_loss(b, objective={"name": "decoupled", "proximal": "loglinear"})
    assert loss.item() == 0.0 and torch.autograd.grad(loss, lp)[0].shape == (0, 3)
    assert b.nonempty().versions.tolist() == [[-1, -1, -1]]

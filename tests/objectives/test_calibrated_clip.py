"""Calibrated clipping (arXiv 2609.22870): PPO on π_θ/μ with ε_low / ε_high widened to the batch's π_old/μ quantiles,
by hand, against ``bypass`` and ``ppo``, and its properties (the quantile ignores padding, no gradient through the
bounds, plain PPO when the batch has no μ)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.batch import LogProbBatch
from offpolicy.losses import needs_rollout_logp, policy_loss
from offpolicy.objectives.calibrated_clip import calibrated_bounds, masked_quantile

LN = math.log


def _batch(rho, adv, mask=None, p_old=0.5):
    """π_θ = π_old = p_old on every token, μ = π_old/ρ: the clipped ratio π_θ/μ is ρ."""
    rho = torch.tensor(rho)
    old = torch.full_like(rho, LN(p_old))
    logp = old.clone().requires_grad_(True)
    b = LogProbBatch(logp=logp, old_logp=old, rollout_logp=old - torch.log(rho),
                     mask=torch.ones_like(rho) if mask is None else torch.tensor(mask, dtype=torch.float32),
                     advantages=torch.tensor(adv))
    return b, logp


def test_by_hand_the_noise_no_longer_holds_a_negative_advantage_token():
    # ρ = (0.7, 0.75, 1.0, 1.3), A = (+1, −1, +1, −1); quantile 0: ε = (1 − 0.7, 1.3 − 1) = (0.3, 0.3) > the 0.2 floor
    b, logp = _batch([[0.7, 0.75, 1.0, 1.3]], [[1.0, -1.0, 1.0, -1.0]])
    loss, m = policy_loss(b, objective={"name": "calibrated_clip", "quantile": 0.0})
    # inside [0.7, 1.3] every term is −A r: (−0.7 + 0.75 − 1 + 1.3) / 4 = 0.0875; ∂/∂log π = −A r / 4
    assert loss.item() == pytest.approx(0.0875, abs=1e-6)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.tensor([[-0.175, 0.1875, -0.25, 0.325]]))
    assert m["loss/clipfrac_low"].item() == 0.0 and m["loss/clipfrac_high"].item() == 0.0
    assert m["loss/calibrated_widened_low"].item() == 1.0 and m["loss/calibrated_widened_high"].item() == 1.0
    # bypass's fixed [0.8, 1.2] holds the A < 0 token at 0.75 (loss 0.8, no gradient)
    b, logp = _batch([[0.7, 0.75, 1.0, 1.3]], [[1.0, -1.0, 1.0, -1.0]])
    loss, m = policy_loss(b, objective="bypass")
    assert loss.item() == pytest.approx((-0.7 + 0.8 - 1 + 1.3) / 4, abs=1e-6)
    assert m["loss/clipfrac_low"].item() == pytest.approx(0.25)
    assert torch.autograd.grad(loss, logp)[0][0, 1].item() == 0.0


def test_by_hand_the_floor_and_the_default_quantile():
    # ρ within [0.9, 1.1]: the bounds stay at the floors, the loss is bypass's exactly
    b, _ = _batch([[0.9, 1.0, 1.1]], [[1.0, -1.0, 1.0]])
    loss, m = policy_loss(b, objective="calibrated_clip", clip_low=0.2, clip_high=0.28)
    b2, _ = _batch([[0.9, 1.0, 1.1]], [[1.0, -1.0, 1.0]])
    expected, _ = policy_loss(b2, objective="bypass", clip_low=0.2, clip_high=0.28)
    assert torch.equal(loss.detach(), expected.detach()) and m["loss/calibrated_widened_low"].item() == 0.0
    # 101 tokens ρ = 0.5, 0.51, …, 1.5: the 1 % / 99 % quantiles are 0.51 and 1.49 → ε = (0.49, 0.49)
    rho = torch.linspace(0.5, 1.5, 101).reshape(1, -1)
    eps_low, eps_high = calibrated_bounds(rho.log(), torch.ones_like(rho, dtype=torch.bool), 0.2, 0.2)
    assert eps_low.item() == pytest.approx(0.49, abs=1e-5) and eps_high.item() == pytest.approx(0.49, abs=1e-5)


def test_without_mu_it_is_ppo_and_needs_no_engine():
    assert needs_rollout_logp(None, "calibrated_clip") == []
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(2, 5, generator=g)
    old = logp + 0.3 * torch.randn(2, 5, generator=g)
    for mu in (None, old.clone()):  # no μ, or μ = π_old (TRL's HF generate)
        a, b = (logp.clone().requires_grad_(True) for _ in range(2))
        batch = LogProbBatch(logp=a, old_logp=old, rollout_logp=mu, mask=torch.ones(2, 5), advantages=torch.randn(2))
        ours, _ = policy_loss(batch, objective="calibrated_clip", clip_high=0.28)
        ppo, _ = policy_loss(batch.replace(logp=b), objective="ppo", clip_high=0.28)
        assert torch.equal(ours.detach(), ppo.detach())
        torch.testing.assert_close(torch.autograd.grad(ours, a)[0], torch.autograd.grad(ppo, b)[0], rtol=0, atol=0)


def test_a_non_finite_mu_falls_back_to_pi_old_and_leaves_the_quantile(monkeypatch):
    monkeypatch.setenv("OFFPOLICY_MAX_NONFINITE_ROLLOUT", "none")  # a non-finite μ on purpose
    b, logp = _batch([[0.7, 0.75, 1.0, 1.3]], [[1.0, -1.0, 1.0, -1.0]])
    mu = b.rollout_logp.clone()
    mu[0, 0] = float("nan")  # the 0.7 gone: ε_low = 1 − 0.75 = 0.25, the token's own ratio π_θ/π_old = 1
    loss, m = policy_loss(b.replace(rollout_logp=mu), objective={"name": "calibrated_clip", "quantile": 0.0})
    assert torch.isfinite(loss) and m["loss/nonfinite_tokens"].item() == 0.0
    assert loss.item() == pytest.approx((-1.0 + 0.75 - 1 + 1.3) / 4, abs=1e-6)


@pytest.mark.parametrize("kw, named", [({"quantile": 0.5}, "quantile"), ({"quantile": -0.1}, "quantile"),
                                       ({"quantile": True}, "quantile"), ({"clip_low": -0.1}, "clip_low"),
                                       ({"dual_clip": 0.5}, "dual_clip")])
def test_bad_parameters_are_refused_naming_them(kw, named):
    b, _ = _batch([[1.0]], [[1.0]])
    with pytest.raises(ValueError, match=rf"^{named}"):
        policy_loss(b, objective={"name": "calibrated_clip", **kw})


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 4), st.integers(1, 12), st.sampled_from([0.0, 0.01, 0.1, 0.3]),
       st.sampled_from([0.0, 0.5]))
def test_masked_quantile_is_torch_quantile_of_the_selected_values(seed, b, t, q, drop):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(b, t, generator=g)
    m = torch.rand(b, t, generator=g) >= drop
    got = masked_quantile(torch.where(m, v, torch.tensor(float("nan"))), m, q)  # padding holds junk
    if not m.any():
        assert torch.isnan(got)
    else:
        torch.testing.assert_close(got, torch.quantile(v[m], q))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 4), st.integers(1, 12), st.sampled_from([0.05, 0.3]))
def test_properties(seed, b, t, noise):
    g = torch.Generator().manual_seed(seed)
    logp0 = -3 * torch.rand(b, t, generator=g)
    old = logp0 + 0.05 * torch.randn(b, t, generator=g)
    mu = old + noise * torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.3
    adv = torch.randn(b, generator=g)
    rho = (old - mu)[mask]

    def run(old_, mu_):
        logp = logp0.clone().requires_grad_(True)
        batch = LogProbBatch(logp=logp, old_logp=old_, rollout_logp=mu_, mask=mask, advantages=adv)
        loss, metrics = policy_loss(batch, objective="calibrated_clip")
        return loss, torch.autograd.grad(loss, logp)[0], metrics

    loss, grad, metrics = run(old, mu)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and (grad[~mask] == 0).all()
    # the bounds: the floor widened to the valid tokens' quantiles
    if rho.numel():
        eps_low, eps_high = calibrated_bounds(old - mu, mask, 0.2, 0.2)
        assert eps_low.item() == pytest.approx(max(0.2, 1 - torch.quantile(rho, 0.01).exp().item()), rel=1e-5)
        assert eps_high.item() == pytest.approx(max(0.2, torch.quantile(rho, 0.99).exp().item() - 1), rel=1e-5)
    # padding junk changes nothing
    nan = torch.tensor(float("nan"))
    loss2, grad2, _ = run(torch.where(mask, old, nan), torch.where(mask, mu, -nan))
    assert torch.equal(loss.detach(), loss2.detach()) and torch.equal(grad, grad2)
    # never holds more tokens than bypass's fixed range
    batch = LogProbBatch(logp=logp0, old_logp=old, rollout_logp=mu, mask=mask, advantages=adv)
    _, fixed = policy_loss(batch, objective="bypass")
    held = metrics["loss/clipfrac_low"] + metrics["loss/clipfrac_high"]
    assert held.item() <= (fixed["loss/clipfrac_low"] + fixed["loss/clipfrac_high"]).item() + 1e-6

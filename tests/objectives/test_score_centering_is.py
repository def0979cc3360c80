"""Score centering with IS-rule coefficients (TIS, IcePop, sampling replay): hand numbers on a 4-token vocabulary,
the peers' formulas on the same inputs, and the properties (no drift in expectation, on-policy and unweighted
reductions, exactness on the sampler's whole support, padding, finite gradients)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.batch import LogProbBatch
from offpolicy.losses import policy_loss
from offpolicy.objectives.score_centering import score_center, score_center_topk
from offpolicy.objectives.score_centering_is import (
    is_weight,
    sampled_is_weight,
    score_center_weighted,
    score_center_weighted_topk,
    weighted_centered_logp,
)

P = torch.tensor([0.1, 0.2, 0.3, 0.4])  # the trainer
Q = torch.tensor([0.5, 0.1, 0.3, 0.1])  # the sampler; its top-2 head is H = {0, 2}
H = torch.tensor([0, 2])


def grad_of(fn, p=P):
    z = p.log().clone().requires_grad_(True)
    c = fn(z)
    return c.detach(), torch.autograd.grad(c, z)[0]


# --- the peers' formulas, written from their sources, on head tensors [N, K] -----------------------------------------


def nemo_rl_tis_coefficients(p_head, q_head, lo, hi):
    """NeMo-RL 0.8.0 token-TIS coefficients, from the release's formula for
    ``nemo_rl.algorithms.loss.score_centering.compute_score_centering_term`` (its source is not stored here):
    m_v = clamp(p_v, lo·q_v, hi·q_v), ρ = (1 − Σ_H q) / max(1 − Σ_H p, 1e-6), α = clamp(1, lo·ρ, hi·ρ),
    c_v = m_v − α·p_v."""
    m = torch.minimum(torch.maximum(p_head, lo * q_head), hi * q_head)
    rho = (1 - q_head.sum(-1, keepdim=True)) / torch.clamp(1 - p_head.sum(-1, keepdim=True), min=1e-6)
    alpha = torch.minimum(torch.maximum(torch.ones_like(rho), lo * rho), hi * rho)
    return m - alpha * p_head


def verl_coefficients(p_head, q_head, weight_fn, eps=1e-6):
    """verl-project/verl ``verl/trainer/ppo/score_centering.py::score_centering_correction``'s residual
    ``q·w(p/q) − α·p`` with α = ρ·w(1/ρ), ρ = max(1 − Σq, eps) / max(1 − Σp, eps) (its weight_fn: TIS
    ``ratio.clamp(max=upper)``, IcePop ``ratio·1[lower ≤ ratio ≤ upper]``)."""
    rho = (1 - q_head.sum(-1)).clamp_min(eps) / (1 - p_head.sum(-1)).clamp_min(eps)
    alpha = rho * weight_fn(1.0 / rho)
    return q_head * weight_fn(p_head / q_head) - alpha.unsqueeze(-1) * p_head


def _gradient_of_head_coefficients(coef, ids, p):
    """∂/∂z of Σ_H sg(c_v) log p_v: Σ_H c_v (e_v − p) = scatter(c) − p·Σ_H c."""
    return torch.zeros_like(p).scatter(-1, ids, coef) - p * coef.sum(-1, keepdim=True)


def _ours_gradient(z, ids, logq, **kw):
    z = z.clone().requires_grad_(True)
    return torch.autograd.grad(score_center_weighted_topk(z, ids, logq, **kw).sum(), z)[0]


# --- hand numbers ----------------------------------------------------------------------------------------------------


def test_tis_by_hand_head_and_exact():
    # head H = {0, 2}, [lo, hi] = [0.5, 2]: m = (clamp(.1, .25, 1), clamp(.3, .15, .6)) = (.25, .3); Σ_H q = .8,
    # Σ_H p = .4, ρ = .2/.6 = ⅓, α = clamp(1, ⅙, ⅔) = ⅔; c = (.25 − .0667, .3 − .2) = (.183333, .1)
    # value Σ c log p = .183333·ln .1 + .1·ln .3 = −.542537; gradient c − p·Σc, Σc = .283333
    c, g = grad_of(lambda z: score_center_weighted_topk(z, H, Q[H].log(), lower=0.5, upper=2.0))
    assert c.item() == pytest.approx(-0.542537, abs=1e-5)
    torch.testing.assert_close(g, torch.tensor([0.155, -0.0566667, 0.015, -0.1133333]), atol=1e-5, rtol=0)
    # exact: r = p/q = (.2, 2, 1, 4) → w = (.5, 2, 1, 2) → m = q·w = (.25, .2, .3, .2), Σm = .95; gradient m − p·Σm
    _, g = grad_of(lambda z: score_center_weighted(z, Q.log(), lower=0.5, upper=2.0))
    torch.testing.assert_close(g, torch.tensor([0.155, 0.01, 0.015, -0.18]), atol=1e-5, rtol=0)


def test_icepop_by_hand_head_and_exact():
    # band [0.5, 2]: r = (.2, 2, 1, 4) keeps tokens 1 and 2; head: m = (0, .3), 1/ρ = 3 is outside → α = 0, c = (0, .3)
    _, g = grad_of(lambda z: score_center_weighted_topk(z, H, Q[H].log(), weighting="icepop", lower=0.5, upper=2.0))
    torch.testing.assert_close(g, torch.tensor([-0.03, -0.06, 0.21, -0.12]), atol=1e-6, rtol=0)
    # exact: m = p·1[band] = (0, .2, .3, 0), Σm = .5
    _, g = grad_of(lambda z: score_center_weighted(z, Q.log(), weighting="icepop", lower=0.5, upper=2.0))
    torch.testing.assert_close(g, torch.tensor([-0.05, 0.1, 0.15, -0.2]), atol=1e-6, rtol=0)


def test_replay_by_hand():
    # support S = {0, 2}, q^S = (.625, .375), p^S = (.1, .3)/.4 = (.25, .75); tokens outside S get no gradient
    qs = torch.tensor([0.625, 0.375]).log()
    _, g = grad_of(lambda z: score_center_weighted_topk(z, H, qs, weighting="none", replay=True))
    torch.testing.assert_close(g, torch.tensor([0.375, 0.0, -0.375, 0.0]), atol=1e-6, rtol=0)
    # with TIS [.5, 2]: r = p^S/q^S = (.4, 2) → w = (.5, 2), m = (.3125, .75), Σm = 1.0625: m − p^S·Σm on S
    _, g = grad_of(lambda z: score_center_weighted_topk(z, H, qs, lower=0.5, upper=2.0, replay=True))
    torch.testing.assert_close(g, torch.tensor([0.046875, 0.0, -0.046875, 0.0]), atol=1e-6, rtol=0)


def test_weighted_centered_logp_by_hand_in_a_reinforce_loss():
    # one token y = 3 sampled: w_3 = clamp(p/q = 4, .5, 2) = 2; REINFORCE −A·logp' with A = 1: gradient
    # −(2·(e_3 − p) − (m − p·Σm)) with the exact TIS m of test_tis_by_hand_head_and_exact
    z = P.log().clone().requires_grad_(True)
    lp = torch.log_softmax(z, -1)
    w = sampled_is_weight(lp[3:4], Q[3:4].log(), lower=0.5, upper=2.0)
    assert w.item() == pytest.approx(2.0)
    out = weighted_centered_logp(lp[3:4], w, score_center_weighted(z, Q.log(), lower=0.5, upper=2.0).reshape(1))
    assert out.item() == lp[3].item()
    g = torch.autograd.grad(-out.sum(), z)[0]
    expected = -(2.0 * (torch.tensor([0.0, 0.0, 0.0, 1.0]) - P) - torch.tensor([0.155, 0.01, 0.015, -0.18]))
    torch.testing.assert_close(g, expected, atol=1e-5, rtol=0)


# --- the peers' formulas on the same inputs --------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), v=st.integers(3, 30), k=st.integers(1, 29),
       bounds=st.sampled_from([(0.0, 2.0), (0.5, 2.0), (0.8, 1.25), (0.2, 5.0)]))
def test_tis_equals_nemo_rl_and_verl(seed, v, k, bounds):
    k = min(k, v - 1)  # a non-empty tail
    g = torch.Generator().manual_seed(seed)
    z, zq = 2 * torch.randn(4, v, generator=g), 2 * torch.randn(4, v, generator=g)
    logq = torch.log_softmax(zq, -1)
    logq_head, ids = logq.topk(k, -1)
    p = torch.softmax(z.double(), -1)  # the references in float64
    p_head, q_head = p.gather(-1, ids), logq_head.double().exp()
    lo, hi = bounds
    ours = _ours_gradient(z, ids, logq_head, lower=lo, upper=hi).double()
    for coef in (nemo_rl_tis_coefficients(p_head, q_head, lo, hi),
                 verl_coefficients(p_head, q_head, lambda r: r.clamp(lo, hi))):
        torch.testing.assert_close(ours, _gradient_of_head_coefficients(coef, ids, p), atol=1e-5, rtol=1e-4)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), v=st.integers(3, 30), k=st.integers(1, 29),
       bounds=st.sampled_from([(0.5, 2.0), (0.5, 5.0), (0.9, 1.1)]))
def test_icepop_equals_verl(seed, v, k, bounds):
    k = min(k, v - 1)
    g = torch.Generator().manual_seed(seed)
    z, zq = torch.randn(3, v, generator=g), torch.randn(3, v, generator=g)  # modest gaps: some ratios in the band
    logq = torch.log_softmax(zq, -1)
    logq_head, ids = logq.topk(k, -1)
    p = torch.softmax(z.double(), -1)
    p_head, q_head = p.gather(-1, ids), logq_head.double().exp()
    lo, hi = bounds
    ours = _ours_gradient(z, ids, logq_head, weighting="icepop", lower=lo, upper=hi).double()
    ref = verl_coefficients(p_head, q_head, lambda r: torch.where((r >= lo) & (r <= hi), r, torch.zeros_like(r)))
    torch.testing.assert_close(ours, _gradient_of_head_coefficients(ref, ids, p), atol=1e-5, rtol=1e-4)


# --- properties ------------------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), v=st.integers(2, 30), k=st.integers(1, 30),
       temperature=st.sampled_from([0.7, 1.0, 1.5]))
def test_unweighted_is_the_existing_centering(seed, v, k, temperature):
    g = torch.Generator().manual_seed(seed)
    z, zq = 2 * torch.randn(3, v, generator=g), 2 * torch.randn(3, v, generator=g)
    logq, ids = torch.log_softmax(zq / temperature, -1).topk(min(k, v), -1)
    for ours, theirs in (
        (lambda x: score_center_weighted(x, zq, weighting="none", temperature=temperature),
         lambda x: score_center(x, zq, temperature=temperature)),
        (lambda x: score_center_weighted_topk(x, ids, logq, weighting="none", temperature=temperature),
         lambda x: score_center_topk(x, ids, logq, temperature=temperature)),
    ):
        (c1, g1), (c2, g2) = (grad_of(lambda x, f=f: f(x).sum(), p=torch.softmax(z, -1)) for f in (ours, theirs))
        torch.testing.assert_close(g1, g2, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("weighting", ["tis", "icepop", "none"])
def test_on_policy_there_is_nothing_to_centre_as_with_the_existing_centering(weighting):
    z = torch.randn(5, 12, generator=torch.Generator().manual_seed(0))
    logq, ids = torch.log_softmax(z, -1).topk(4, -1)
    for f in (lambda x: score_center_weighted(x, z, weighting=weighting, lower=0.5, upper=2.0),
              lambda x: score_center_weighted_topk(x, ids, logq, weighting=weighting, lower=0.5, upper=2.0),
              lambda x: score_center(x, z)):
        _, g = grad_of(lambda x, f=f: f(x).sum(), p=torch.softmax(z, -1))
        assert g.abs().max().item() < 1e-6


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), v=st.integers(2, 20), weighting=st.sampled_from(["tis", "icepop", "none"]),
       bounds=st.sampled_from([(0.0, 2.0), (0.5, 2.0), (0.5, 5.0)]))
def test_the_weighted_update_has_no_drift_in_expectation(seed, v, weighting, bounds):
    # Σ_y q_y (w_y ∇log p_y − Σ_a m_a ∇log p_a) = 0 for every prefix: the term that compounds is gone
    g = torch.Generator().manual_seed(seed)
    z, zq = 2 * torch.randn(v, generator=g), 2 * torch.randn(v, generator=g)
    q = torch.softmax(zq, -1)
    lo, hi = bounds
    x = z.clone().requires_grad_(True)
    lp = torch.log_softmax(x, -1)
    center = score_center_weighted(x, zq, weighting=weighting, lower=lo, upper=hi)
    w = sampled_is_weight(lp.detach(), q.log(), weighting=weighting, lower=lo, upper=hi)
    expected = torch.zeros(v)
    for y in range(v):
        out = weighted_centered_logp(lp[y:y + 1], w[y:y + 1], center.reshape(1))
        expected += q[y] * torch.autograd.grad(out.sum(), x, retain_graph=True)[0]
    assert expected.abs().max().item() < 1e-5


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), v=st.integers(3, 30), top_k=st.integers(1, 30),
       weighting=st.sampled_from(["tis", "icepop", "none"]))
def test_the_head_is_exact_on_the_samplers_whole_support(seed, v, top_k, weighting):
    # a top-k sampler: q = 0 outside its k survivors, the engine reports all of them → tail 0, ρ = α = 0, exact
    g = torch.Generator().manual_seed(seed)
    z, zq = 2 * torch.randn(2, v, generator=g), 2 * torch.randn(2, v, generator=g)
    k = min(top_k, v)
    kth = zq.topk(k, -1).values[..., -1:]
    zq = torch.where(zq >= kth, zq, float("-inf"))
    logq, ids = torch.log_softmax(zq, -1).topk(k, -1)
    kw = {"weighting": weighting, "lower": 0.5, "upper": 2.0}
    # the gradient, not the value: a head summing to 1 − ε leaves ρ = ε / max(tail_p, 1e-6), whose α·Σ_H p log p
    # moves the value (never the gradient once H is everything p and q put mass on: Σ_a p_a ∇log p_a = 0)
    _, g1 = grad_of(lambda x: score_center_weighted_topk(x, ids, logq, **kw).sum(), p=torch.softmax(z, -1))
    _, g2 = grad_of(lambda x: score_center_weighted(x, zq, **kw).sum(), p=torch.softmax(z, -1))
    torch.testing.assert_close(g1, g2, atol=1e-5, rtol=1e-5)


def _centred_batch(z, zq, y, mask, weighting):
    lp = torch.log_softmax(z, -1)
    logp = lp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    mu = torch.log_softmax(zq, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    w = sampled_is_weight(logp, mu, weighting=weighting, lower=0.5, upper=2.0)
    c = score_center_weighted(z, zq, weighting=weighting, lower=0.5, upper=2.0)
    return LogProbBatch(logp=weighted_centered_logp(logp, w, c), mask=mask, rollout_logp=mu,
                        advantages=torch.tensor([1.0, -0.5]))


@pytest.mark.parametrize("weighting", ["tis", "icepop"])
def test_padding_never_contributes_and_gradients_are_finite(weighting):
    g = torch.Generator().manual_seed(3)
    z = (3 * torch.randn(2, 5, 9, generator=g)).requires_grad_(True)
    zq = 3 * torch.randn(2, 5, 9, generator=g)
    zq[0, 1, :4] = float("-inf")  # a truncated sampler row
    y = torch.randint(0, 9, (2, 5), generator=g)
    y[0, 1] = 6  # a token inside its support
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    loss, _ = policy_loss(_centred_batch(z, zq, y, mask, weighting), objective="reinforce")
    grad = torch.autograd.grad(loss, z)[0]
    assert torch.isfinite(grad).all() and torch.isfinite(loss)
    assert (grad[0, 3:] == 0).all() and grad[0, :3].abs().sum() > 0
    # garbage at the padded positions (huge logits, a NaN sampler row) changes nothing
    z2 = z.detach().clone()
    z2[0, 3:] = 1e4 * torch.randn(2, 9, generator=g)
    zq2 = zq.clone()
    zq2[0, 3:] = float("nan")
    z2.requires_grad_(True)
    loss2, _ = policy_loss(_centred_batch(z2, zq2, y, mask, weighting), objective="reinforce")
    grad2 = torch.autograd.grad(loss2, z2)[0]
    assert loss2.item() == pytest.approx(loss.item(), abs=1e-6)
    torch.testing.assert_close(grad2[:, :3], grad[:, :3])
    assert (grad2[0, 3:] == 0).all()


def test_extreme_inputs_keep_gradients_finite():
    z = torch.tensor([[30.0, -30.0, 0.0, -1e4]], requires_grad=True)
    zq = torch.tensor([[-30.0, 30.0, float("-inf"), 0.0]])
    logq, ids = torch.log_softmax(zq, -1).topk(2, -1)
    for weighting in ("tis", "icepop", "none"):
        for c in (score_center_weighted(z, zq, weighting=weighting),
                  score_center_weighted_topk(z, ids, logq, weighting=weighting),
                  score_center_weighted_topk(z, ids, logq, weighting=weighting, replay=True)):
            assert torch.isfinite(torch.autograd.grad(c.sum(), z)[0]).all()
    w = sampled_is_weight(torch.tensor([[0.0, float("-inf")]]), torch.tensor([[-1e4, -1.0]]))
    assert torch.equal(w, torch.tensor([[2.0, 0.0]]))


def test_errors():
    z, ids, logq = torch.zeros(4), torch.tensor([0]), torch.tensor([0.0])
    with pytest.raises(ValueError, match="^weighting must be one of"):
        score_center_weighted(z, z, weighting="mis")
    with pytest.raises(ValueError, match="^lower must be <= upper"):
        score_center_weighted_topk(z, ids, logq, lower=3.0, upper=2.0)
    with pytest.raises(ValueError, match="^upper must be a finite number"):
        is_weight(z, "tis", 0.0, math.inf)
    with pytest.raises(ValueError, match="^center must have logp's shape"):
        weighted_centered_logp(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2))
    with pytest.raises(ValueError, match="^sampler_logits has shape"):
        score_center_weighted(z, torch.zeros(5))


@pytest.mark.parametrize("rule", ["tis", "icepop", "replay"])
def test_the_trainers_helper_is_the_composition(rule):
    from offpolicy.objectives.score_centering_is import PRESET_RULES, weighted_centering

    g = torch.Generator().manual_seed(5)
    z = torch.randn(2, 3, 6, generator=g).requires_grad_(True)
    zq = torch.randn(2, 3, 6, generator=g)
    y = torch.randint(0, 6, (2, 3), generator=g)
    logq, ids = torch.log_softmax(zq, -1).topk(6, -1)  # the whole support: replay's S
    lp = torch.log_softmax(z, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    mu = torch.log_softmax(zq, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    out, extras = weighted_centering(lp, z, mu, (ids, logq), rule=rule)
    weighting, lo, hi, replay = PRESET_RULES[rule]
    w = sampled_is_weight(lp, mu, weighting=weighting, lower=lo, upper=hi)
    ref = weighted_centered_logp(lp, w, score_center_weighted_topk(z, ids, logq, weighting=weighting, lower=lo,
                                                                   upper=hi, replay=replay))
    a = torch.randn(2, 3, generator=g)
    g_out = torch.autograd.grad((out * a).sum(), z, retain_graph=True)[0]
    torch.testing.assert_close(g_out, torch.autograd.grad((ref * a).sum(), z, retain_graph=True)[0])
    assert torch.equal(extras["score_centering/is_weight"], w)
    ratio = (lp - mu).detach().exp()
    expected = {"tis": ratio > 2.0, "icepop": (ratio < 0.5) | (ratio > 5.0), "replay": torch.zeros_like(w).bool()}
    assert torch.equal(extras["score_centering/is_clipped"].bool(), expected[rule])
    if rule != "replay":  # from the full logits it is the exact centre
        out, _ = weighted_centering(lp, z, mu, zq, rule=rule)
        assert torch.equal(out.detach(), lp.detach())
    else:
        with pytest.raises(ValueError, match="^sampler: rule='replay'"):
            weighted_centering(lp, z, mu, zq, rule=rule)
    with pytest.raises(ValueError, match="^rule must be one of"):
        weighted_centering(lp, z, mu, zq, rule="mis")


def test_replay_with_targets_takes_the_gradient_on_the_support_and_keeps_the_value():
    from offpolicy.objectives.score_centering_is import weighted_centering

    g = torch.Generator().manual_seed(8)
    z = torch.randn(2, 6, generator=g).requires_grad_(True)
    logq, ids = torch.log_softmax(torch.randn(2, 3, generator=g), -1), torch.tensor([[0, 2, 5], [1, 3, 4]])
    y = torch.tensor([2, 4])  # inside each support
    lp = torch.log_softmax(z, -1).gather(-1, y[:, None])[:, 0]
    mu = logq.gather(-1, torch.tensor([[1], [2]]))[:, 0]
    out, _ = weighted_centering(lp, z, mu, (ids, logq), rule="replay", targets=y)
    assert torch.equal(out.detach(), lp.detach())
    lps = z.gather(-1, y[:, None])[:, 0] - z.gather(-1, ids).logsumexp(-1)  # log p^S(y)
    ref = lps - score_center_weighted_topk(z, ids, logq, weighting="none", replay=True)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), z, retain_graph=True)[0],
                               torch.autograd.grad(ref.sum(), z)[0])

"""Score centering (arXiv 2609.20807): the exact chunked centre, the top-k proportional tail, the centred log-prob,
the drift / gap measures (the trainer's wiring: tests/train/test_stale_presets.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.batch import LogProbBatch
from offpolicy.losses import policy_loss
from offpolicy.objectives.score_centering import (
    centered_logp,
    centering_token_metrics,
    sampler_topk,
    score_center,
    score_center_topk,
    score_center_topk_with_drift,
    topk_drift_tv,
    topk_tail_gap,
)


def plain_center(logits: torch.Tensor, sampler_logits: torch.Tensor, t: float) -> torch.Tensor:
    """Σ_a sg(q_a) log p_a written directly (an [N, V] tensor; the reference for the chunked one)."""
    q = torch.softmax(sampler_logits / t, -1)
    return (q * torch.log_softmax(logits / t, -1)).sum(-1)


def test_by_hand_gradient_is_q_minus_p_over_t():
    # z = (ln 2, 0, 0) at T = 2: p = softmax(z/2) ∝ (√2, 1, 1) = (0.414214, 0.292893, 0.292893); q = (0.1, 0.2, 0.7)
    # c = Σ q log p = 0.1·(−0.881374) + 0.9·(−1.227947) = −1.193290; ∂c/∂z = (q − p)/2 = (−0.157107, −0.046447, 0.203553)
    z = torch.tensor([math.log(2.0), 0.0, 0.0], requires_grad=True)
    q = torch.tensor([0.1, 0.2, 0.7])
    c = score_center(z, (q.log() * 2.0), temperature=2.0)  # sampler logits whose softmax at T = 2 is q
    assert c.item() == pytest.approx(-1.193290, abs=1e-5)
    torch.testing.assert_close(torch.autograd.grad(c, z)[0], torch.tensor([-0.157107, -0.046447, 0.203553]),
                               atol=1e-5, rtol=0)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 3), t=st.integers(1, 5), v=st.integers(2, 40),
       temperature=st.sampled_from([0.7, 1.0, 1.5]), budget=st.sampled_from([64, 10_000, 2**28]))
def test_chunked_exact_matches_the_plain_formula(seed, b, t, v, temperature, budget):
    g = torch.Generator().manual_seed(seed)
    z = (2 * torch.randn(b, t, v, generator=g)).requires_grad_(True)
    zq = 2 * torch.randn(b, t, v, generator=g)
    w = torch.randn(b, t, generator=g)  # an arbitrary upstream gradient
    ours = score_center(z, zq, temperature=temperature, memory_budget_bytes=budget)  # 64 B: one row per chunk
    ref_z = z.detach().clone().requires_grad_(True)
    ref = plain_center(ref_z, zq, temperature)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    g_ours = torch.autograd.grad((ours * w).sum(), z)[0]
    g_ref = torch.autograd.grad((ref * w).sum(), ref_z)[0]
    torch.testing.assert_close(g_ours, g_ref, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), v=st.integers(2, 30), k=st.integers(1, 30))
def test_topk_gradient_is_q_hat_minus_p(seed, v, k):
    g = torch.Generator().manual_seed(seed)
    z = (2 * torch.randn(4, v, generator=g)).requires_grad_(True)
    zq = 2 * torch.randn(4, v, generator=g)
    ids, logq = sampler_topk(zq, k)
    c = score_center_topk(z, ids, logq)
    grad = torch.vstack([torch.autograd.grad(c[i], z, retain_graph=True)[0][i] for i in range(4)])
    # q̂: q on the head, the tail mass spread in proportion to p (computed here the long way)
    p, q = torch.softmax(z.detach(), -1), torch.softmax(zq, -1)
    head = torch.zeros_like(q, dtype=torch.bool).scatter_(-1, ids, True)
    tail_p = (p * ~head).sum(-1, keepdim=True)
    q_hat = torch.where(head, q, (1 - (q * head).sum(-1, keepdim=True)) * p / tail_p.clamp(min=1e-30))
    torch.testing.assert_close(grad, q_hat - p, atol=2e-5, rtol=1e-4)
    if k >= v:  # the whole vocabulary is the head: the top-k centre is the exact one
        torch.testing.assert_close(c, score_center(z.detach(), zq), atol=1e-5, rtol=1e-5)


def test_centered_logp_value_and_the_drift_term_vanishes():
    # value unchanged; gradient of log p(y) becomes (onehot(y) − q)/T, whose q-expectation is zero: under the sampler,
    # the centred score has mean 0 whatever p is (the drift term E_q[R]·E_q[∇ log p] is gone)
    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, generator=g).requires_grad_(True)
    zq = torch.randn(5, generator=g)
    q = torch.softmax(zq, -1)
    lp = torch.log_softmax(z, -1)
    center = score_center(z, zq)
    expected = sum(q[y] * centered_logp(lp[y], center) for y in range(5))
    assert torch.autograd.grad(expected, z)[0].abs().max() < 1e-6
    lp = torch.log_softmax(z, -1)
    plain = sum(q[y] * lp[y] for y in range(5))  # without centring: q − p, the drift
    torch.testing.assert_close(torch.autograd.grad(plain, z)[0], q - torch.softmax(z.detach(), -1))
    for y in range(5):
        assert centered_logp(lp[y], center).item() == lp[y].item()


def test_on_policy_centering_changes_nothing_in_expectation_and_q_eq_p_has_zero_centre_gradient():
    z = torch.tensor([[0.3, -1.0, 2.0]], requires_grad=True)
    c = score_center(z, z.detach())
    assert torch.autograd.grad(c.sum(), z)[0].abs().max() < 1e-7  # q = p: E_q[∇ log p] = 0
    drift, gap, _ = topk_tail_gap(z.detach(), z.detach(), 1)
    assert drift.item() < 1e-7 and gap.item() < 1e-7  # q = p: q̂ = p exactly


def test_reinforce_on_the_centred_score_by_hand():
    # one token, V = 2, y = 0, A = 2, p = (½, ½), q = (0.8, 0.2): L = −A·log p(y) → ∂L/∂z = −A (onehot(y) − q)
    # = −2·(0.2, −0.2) = (−0.4, 0.4); without centring it is −2·(½, −½) = (−1, 1)
    z = torch.zeros(1, 1, 2, requires_grad=True)
    lp = torch.log_softmax(z, -1)[..., 0]
    logp = centered_logp(lp, score_center(z, torch.tensor([[[0.8, 0.2]]]).log()))
    b = LogProbBatch(logp=logp, mask=torch.ones(1, 1), advantages=torch.tensor([2.0]))
    loss, _ = policy_loss(b, objective="reinforce")
    assert loss.item() == pytest.approx(2 * math.log(2))
    torch.testing.assert_close(torch.autograd.grad(loss, z)[0], torch.tensor([[[-0.4, 0.4]]]))


def test_gap_by_hand_and_k_equal_v_is_exact():
    p = torch.tensor([0.5, 0.3, 0.2]).log()
    q = torch.tensor([0.4, 0.1, 0.5]).log()
    # head k=1 of q: {2} (0.5); m_q = 0.5, m_p = 0.2, κ = 0.5/0.8 = 0.625: q̂ = (0.3125, 0.1875, 0.5)
    # drift ½(0.1 + 0.2 + 0.3) = 0.3; gap ½(|0.4 − 0.3125| + |0.1 − 0.1875|) = 0.0875
    drift, gap, head_mass = topk_tail_gap(p, q, 1)
    assert drift.item() == pytest.approx(0.3, abs=1e-6) and gap.item() == pytest.approx(0.0875, abs=1e-6)
    assert head_mass.item() == pytest.approx(0.5, abs=1e-6)  # m_q of H = {2}
    assert topk_tail_gap(p, q, 2).head_mass_q.item() == pytest.approx(0.9, abs=1e-6)  # H = {2, 0}
    full = topk_tail_gap(p, q, 3)
    assert full.gap.item() == pytest.approx(0.0, abs=1e-7) and full.head_mass_q.item() == pytest.approx(1.0, abs=1e-6)


def test_head_drift_by_hand_on_four_tokens():
    p = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    q = torch.tensor([0.5, 0.0, 0.3, 0.2])
    # exact ½‖q − p‖₁ = ½(0.1 + 0.3 + 0.1 + 0.1) = 0.3
    assert topk_tail_gap(p, q.log(), 1)[0].item() == pytest.approx(0.3, abs=1e-6)
    # H = {0}: ½(|0.5 − 0.4| + |m_p − m_q|) = ½(0.1 + |0.4 − 0.5|) = 0.1 — below the exact 0.3: off H, q − p is
    # (−0.3, 0.1, 0.1), whose signs the proportional tail cannot see
    one = topk_drift_tv(p, torch.tensor([0]), q[:1].log())
    assert one.item() == pytest.approx(0.1, abs=1e-6)
    # H = {0, 2, 3} covers q's support (q_1 = 0): ½(0.1 + 0.1 + 0.1 + |0.7 − 1|) = 0.3 = the exact drift
    full = topk_drift_tv(p, torch.tensor([0, 2, 3]), q[[0, 2, 3]].log())
    assert full.item() == pytest.approx(0.3, abs=1e-6)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), v=st.integers(2, 12), k=st.integers(1, 12),
       temperature=st.sampled_from([0.5, 1.0, 1.7]))
def test_head_drift_is_a_lower_bound_exact_at_k_equal_v_and_zero_on_policy(seed, v, k, temperature):
    g = torch.Generator().manual_seed(seed)
    z, zq = torch.randn(3, v, generator=g) * 2, torch.randn(3, v, generator=g) * 2
    k = min(k, v)
    ids, logq = sampler_topk(zq, k, temperature=temperature)  # the tempered head, as an engine reports it
    est = topk_drift_tv(z, ids, logq, temperature=temperature)
    exact = topk_tail_gap(z, zq, v, temperature=temperature)[0]
    assert bool((est <= exact + 1e-6).all())
    if k == v:
        torch.testing.assert_close(est, exact, atol=1e-6, rtol=0)
    on_policy = topk_drift_tv(zq, ids, logq, temperature=temperature)  # q = p
    assert float(on_policy.abs().max()) < 1e-6


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_centre_with_drift_is_the_two_functions_and_the_metrics_are_named_once(temperature):
    g = torch.Generator().manual_seed(3)
    z = torch.randn(2, 5, 11, generator=g, requires_grad=True)
    logq, ids = torch.log_softmax(torch.randn(2, 5, 11, generator=g), -1).topk(3, -1)
    logq = logq.clone()
    logq[0, 0, 2] = float("-inf")  # an unreported slot
    c, d = score_center_topk_with_drift(z, ids, logq, temperature=temperature)
    torch.testing.assert_close(c, score_center_topk(z, ids, logq, temperature=temperature), atol=0, rtol=0)
    torch.testing.assert_close(d, topk_drift_tv(z, ids, logq, temperature=temperature), atol=0, rtol=0)
    assert c.requires_grad and not d.requires_grad
    m = centering_token_metrics(d, logq)
    assert sorted(m) == ["score_centering/drift_tv", "score_centering/head_mass_q"]
    torch.testing.assert_close(m["score_centering/head_mass_q"], torch.where(logq > float("-inf"), logq.exp(),
                                                                             0.0).sum(-1))
    assert m["score_centering/head_mass_q"].shape == (2, 5) and bool((m["score_centering/head_mass_q"] <= 1).all())
    # the exact path's head mass from topk_tail_gap (the sampler's full logits) names the same metrics
    zq = torch.randn(2, 5, 11, generator=g)
    tail = topk_tail_gap(z.detach(), zq, 3, temperature=temperature)
    exact = centering_token_metrics(tail.drift, head_mass_q=tail.head_mass_q)
    head = centering_token_metrics(tail.drift, sampler_topk(zq, 3, temperature=temperature)[1])
    assert sorted(exact) == sorted(m)
    torch.testing.assert_close(exact["score_centering/head_mass_q"], head["score_centering/head_mass_q"])
    for wrong in ({}, {"topk_logq": logq, "head_mass_q": tail.head_mass_q}):
        with pytest.raises(ValueError, match="topk_logq or head_mass_q"):
            centering_token_metrics(d, **wrong)


def test_unreported_slots_are_not_in_the_head():
    # an engine whose truncation kept 2 of 4 tokens reports them and leaves K − 2 slots at −inf (id 0 as filler):
    # the head is the whole support of the truncated q = (0.75, 0, 0.25, 0), so κ = 0 and the gradient is q − p
    z = torch.zeros(4, requires_grad=True)  # p = ¼ each
    ids = torch.tensor([0, 2, 0, 0])
    logq = torch.tensor([0.75, 0.25, 0.0, 0.0]).log()
    c = score_center_topk(z, ids, logq)
    torch.testing.assert_close(torch.autograd.grad(c, z)[0], torch.tensor([0.5, -0.25, 0.0, -0.25]))
    # the same number as the head without the empty slots
    assert c.item() == pytest.approx(score_center_topk(z.detach(), ids[:2], logq[:2]).item(), abs=1e-7)
    # drift: ½(|0.75 − 0.25| + |0.25 − 0.25| + |m_p − m_q|) = ½(0.5 + 0 + |0.5 − 1|) = 0.5 = ½‖q − p‖₁
    assert topk_drift_tv(z.detach(), ids, logq).item() == pytest.approx(0.5, abs=1e-6)


def test_errors():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="sampler_logits"):
        score_center(z, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="temperature"):
        score_center(z, z, temperature=0.0)
    with pytest.raises(ValueError, match="topk_logq"):
        score_center_topk(z, torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="topk_ids"):
        score_center_topk(z, torch.zeros(2, 1), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="center"):
        centered_logp(torch.zeros(2, 3), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="k must"):
        sampler_topk(z, 0)
    with pytest.raises(ValueError, match="topk_logq"):
        topk_drift_tv(z, torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="temperature"):
        topk_drift_tv(z, torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1), temperature=-1.0)

"""offpolicy.divergence: exact KL/TV, the top-k lower bound, and the TRM field helper."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.batch import LogProbBatch
from offpolicy.divergence import (
    NONFINITE_DIVERGENCE,
    divergence_fields,
    divergence_kind,
    token_kl,
    token_tv,
    topk_kl_lower_bound,
    topk_kl_upper_bound,
)


def ref_kl(roll, z):
    lq, lp = torch.log_softmax(roll.double(), -1), torch.log_softmax(z.double(), -1)
    q = lq.exp()
    return torch.where(q > 0, q * (lq - lp), torch.zeros((), dtype=torch.float64)).sum(-1)


def test_kl_and_tv_hand_values():
    # μ = (½, ½), π = (¾, ¼): KL = ½ log(½/¾) + ½ log(½/¼) = ½(−0.405465 + 0.693147) = 0.143841
    # TV = ½(|½ − ¾| + |½ − ¼|) = 0.25
    roll, z = torch.zeros(2), torch.tensor([0.75, 0.25]).log()
    assert token_kl(roll, z).item() == pytest.approx(0.143841, abs=1e-6)
    assert token_tv(roll, z).item() == pytest.approx(0.25, abs=1e-7)
    # Rollout first: KL(π‖μ) = ¾ log(3/2) + ¼ log(1/2) = 0.304099 − 0.173287 = 0.130812 ≠ 0.143841
    assert token_kl(z, roll).item() == pytest.approx(0.130812, abs=1e-6)


def test_kl_matches_reference_batched_with_temperature_and_gradient():
    g = torch.Generator().manual_seed(0)
    roll, z = torch.randn(3, 5, 37, generator=g) * 3, (torch.randn(3, 5, 37, generator=g) * 3).requires_grad_()
    got = token_kl(roll, z, temperature=0.7, rollout_temperature=1.3, memory_budget_bytes=2000)
    torch.testing.assert_close(got.double(), ref_kl(roll / 1.3, z.detach() / 0.7), atol=1e-5, rtol=1e-5)
    (grad,) = torch.autograd.grad(got.sum(), z)
    # ∂KL/∂z = (π − μ) / τ
    want = (torch.softmax(z.detach() / 0.7, -1) - torch.softmax(roll / 1.3, -1)) / 0.7
    torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-4)


def test_rollout_log_probs_with_minus_inf_give_finite_kl():
    # A top-k-truncated rollout distribution stored as log-probs with −inf: 0 · log 0 counts as 0, not NaN.
    roll = torch.tensor([[0.0, 0.0, float("-inf"), float("-inf")]])
    z = torch.zeros(1, 4)
    # μ = (½, ½, 0, 0), π uniform: KL = log(½ / ¼) = log 2
    assert token_kl(roll, z).item() == pytest.approx(math.log(2), abs=1e-6)


@settings(max_examples=50, deadline=None)
@given(v=st.integers(2, 30), k=st.integers(1, 30), scale=st.floats(0.1, 8.0), seed=st.integers(0, 10_000))
def test_topk_bound_below_exact_monotone_in_k_and_tight_at_v(v, k, scale, seed):
    k = min(k, v)
    g = torch.Generator().manual_seed(seed)
    roll = torch.randn(4, v, generator=g, dtype=torch.float64) * scale
    z = torch.randn(4, v, generator=g, dtype=torch.float64) * scale
    lq = torch.log_softmax(roll, -1)
    top = lq.topk(v, -1)
    exact = token_kl(roll, z)
    tv_exact = token_tv(roll, z)
    prev = torch.zeros(4, dtype=torch.float64)
    for kk in sorted({1, k, v}):
        kl_k, tv_k = topk_kl_lower_bound(top.values[:, :kk], top.indices[:, :kk], z, with_tv=True)
        assert torch.all(kl_k <= exact + 1e-9)          # data-processing inequality
        assert torch.all(tv_k <= tv_exact + 1e-9)
        assert torch.all(kl_k >= prev - 1e-9)           # a finer partition never loses divergence
        prev = kl_k
        upper = topk_kl_upper_bound(top.values[:, :kk], top.indices[:, :kk], z)
        assert torch.all(upper >= exact - 1e-9)         # all tail mass of μ on π's least likely tail token
    torch.testing.assert_close(prev, exact)            # k = V: every token is its own bucket
    torch.testing.assert_close(upper, exact)


def test_topk_bound_hand_value():
    # μ = (½, ¼, ¼), π = (¼, ¼, ½); top-1 of μ = token 0; rest {1, 2}: μ_rest = ½, π_rest = ¾
    # bound = ½ log(½/¼) + ½ log(½/¾) = 0.346574 − 0.202733 = 0.143841
    # exact = ½ log 2 + ¼ log 1 + ¼ log ½ = 0.346574 − 0.173287 = 0.173287
    lq, z = torch.tensor([0.5, 0.25, 0.25]).log(), torch.tensor([0.25, 0.25, 0.5]).log()
    assert topk_kl_lower_bound(lq[:1], torch.tensor([0]), z).item() == pytest.approx(0.143841, abs=1e-6)
    assert token_kl(lq, z).item() == pytest.approx(0.173287, abs=1e-6)
    # upper = 0.143841 + ½ log(p_rest / π_min) = 0.143841 + ½ log(¾ / ¼) = 0.143841 + 0.549306 = 0.693147
    assert topk_kl_upper_bound(lq[:1], torch.tensor([0]), z).item() == pytest.approx(0.693147, abs=1e-6)


def test_capped_upper_bound_hand_value_where_the_cap_binds():
    # μ = (0.4, 0.2, 0.2, 0.2), π uniform, top-1 = token 0 (q = 0.4): the tail holds q_R = 0.6, but no tail token can
    # exceed the cap 0.4, so the worst tail is (0.4, 0.2, 0): head 0.4 log(0.4/0.25) = 0.4 · 0.470004 = 0.188001,
    # tail 0.188001 + 0.2 log(0.2/0.25) = 0.188001 − 0.044629 = 0.143373 → upper 0.331374
    # (the uncapped bound, all 0.6 on one token: 0.188001 + 0.6 log(0.6/0.25) = 0.188001 + 0.525281 = 0.713283);
    # exact = 0.188001 + 3 · 0.2 log(0.8) = 0.188001 − 0.133886 = 0.054115
    lq, z = torch.tensor([0.4, 0.2, 0.2, 0.2]).log(), torch.zeros(4)
    assert topk_kl_upper_bound(lq[:1], torch.tensor([0]), z).item() == pytest.approx(0.331374, abs=1e-5)
    assert token_kl(lq, z).item() == pytest.approx(0.054115, abs=1e-6)


def _uncapped_upper(lq_k, ids, z):
    """The bound without the cap: head terms + q_R · log(q_R / π_min) over the tail (float64)."""
    lp = torch.log_softmax(z.double(), -1)
    head = (lq_k.exp() * (lq_k - lp.gather(-1, ids))).sum(-1)
    q_rest = (1 - lq_k.exp().sum(-1)).clamp(min=0)
    p_min = lp.scatter(-1, ids, math.inf).amin(-1)
    return head + torch.where(q_rest > 0, q_rest * (q_rest.clamp(min=1e-300).log() - p_min), torch.zeros_like(q_rest))


@settings(max_examples=60, deadline=None)
@given(v=st.integers(3, 40), k=st.integers(1, 39), scale=st.floats(0.1, 6.0), seed=st.integers(0, 10_000))
def test_capped_upper_bound_is_sound_no_looser_and_attained(v, k, scale, seed):
    k = min(k, v - 1)
    g = torch.Generator().manual_seed(seed)
    lq = torch.log_softmax(torch.randn(3, v, generator=g, dtype=torch.float64) * scale, -1)
    z = torch.randn(3, v, generator=g, dtype=torch.float64) * scale
    top = lq.topk(k, -1)
    upper = topk_kl_upper_bound(top.values, top.indices, z)
    assert torch.all(upper >= token_kl(lq, z) - 1e-9)                               # sound
    assert torch.all(upper <= _uncapped_upper(top.values, top.indices, z) + 1e-9)  # never looser than uncapped
    # attained: the μ* with the same top-k whose tail puts the cap c on π's least likely tail tokens, the remainder on
    # the next, has exactly KL(μ*‖π) = upper — no certified bound from this top-k can be smaller
    lp = torch.log_softmax(z, -1)
    for row in range(3):
        ids, q = top.indices[row], top.values[row].exp()
        c, q_rest = float(q.min()), float(1 - q.sum())
        tail = [j for j in lp[row].argsort().tolist() if j not in set(ids.tolist())]
        mu = torch.zeros(v, dtype=torch.float64)
        mu[ids] = q
        for rank, j in enumerate(tail):
            mu[j] = min(max(q_rest - rank * c, 0.0), c)
        assert token_kl(mu.log(), z[row]).item() == pytest.approx(upper[row].item(), rel=1e-6, abs=1e-9)


def _capped_tail_max_by_full_sort(log_p_tail, cap, lo, hi):
    """capped_tail_max with π's whole tail sorted (what the selection of its least likely tokens must equal)."""
    from offpolicy.divergence import _capped_tail, _xlog

    log_p_sorted = log_p_tail.sort(dim=-1).values
    n_rest = torch.isfinite(log_p_tail).sum(dim=-1, keepdim=True).to(torch.float64)
    uncapped = torch.maximum(_xlog(lo, log_p_sorted[:, :1]), _xlog(hi, log_p_sorted[:, :1]))
    hi = torch.maximum(torch.minimum(hi, n_rest * cap), lo)
    best = torch.maximum(_capped_tail(log_p_sorted, cap, lo, n_rest), _capped_tail(log_p_sorted, cap, hi, n_rest))
    m_cap = torch.floor(hi / cap) * cap
    inner = torch.where(m_cap >= lo, _capped_tail(log_p_sorted, cap, m_cap, n_rest), torch.full_like(lo, -math.inf))
    return torch.minimum(torch.maximum(best, inner), uncapped)


@settings(max_examples=40, deadline=None)
@given(v=st.integers(50, 3000), k=st.integers(1, 40), scale=st.floats(0.05, 8.0), seed=st.integers(0, 10_000))
def test_capped_tail_selects_the_least_likely_tokens_instead_of_sorting(v, k, scale, seed):
    # a vertex fills at most ⌈q / cap⌉ tail tokens: selecting π's least likely few gives the full sort's value, whether
    # the tail is light (few filled: the selection) or heavy (most of the row: the sort); the sums differ only in the
    # float64 grouping of the terms (the sort's also adds the exact zeros)
    from offpolicy.divergence import capped_tail_max, topk_cap
    from offpolicy.kernels.fused_tiles import rest_mass_bounds

    g = torch.Generator().manual_seed(seed)
    lq = torch.log_softmax(torch.randn(4, v, generator=g, dtype=torch.float64) * scale, -1)
    top = lq.topk(min(k, v - 1), -1)
    z = torch.randn(4, v, generator=g, dtype=torch.float64) * scale
    log_p_tail = (z - z.logsumexp(-1, keepdim=True)).scatter(1, top.indices, float("inf"))
    lo, hi = rest_mass_bounds(top.values, v)
    cap = topk_cap(top.values)
    torch.testing.assert_close(capped_tail_max(log_p_tail, cap, lo, hi),
                               _capped_tail_max_by_full_sort(log_p_tail, cap, lo, hi), rtol=1e-12, atol=1e-15)


def test_topk_rest_mass_is_accurate_when_topk_covers_almost_everything():
    # π puts 1 − 1e-9 on token 0; the complement's logsumexp keeps p_rest ≈ 1e-9 (1 − Σ p_i in fp32 would be 0,
    # making the bound +inf whenever μ has any rest mass).
    z = torch.tensor([[0.0, math.log(1e-9)]])
    lq = torch.tensor([[math.log(1 - 1e-6)]])     # μ: 1 − 1e-6 on token 0, 1e-6 on the rest
    b = topk_kl_lower_bound(lq, torch.tensor([[0]]), z)
    # KL = (1−1e-6) log((1−1e-6)/(1−1e-9)) + 1e-6 log(1e-6/1e-9) ≈ −1e-6 + 1e-6 · 6.9078 = 5.908e-6
    # (fp32: q_rest = 1 − fl(1 − 1e-6) = 1.013e-6, so 2% tolerance; the point is finiteness and the right order)
    assert torch.isfinite(b).all() and b.item() == pytest.approx(5.908e-6, rel=3e-2)


@pytest.mark.parametrize("q_rest", [1e-4, 2e-4, 1e-6])
def test_topk_bounds_hold_with_float32_inputs_and_a_small_real_rest_mass(q_rest):
    # V = 1000, K = 256: μ spreads 1 − q_rest over the top-k and puts q_rest on token 256, where π has ~4e-12.
    # The exact KL then has a tail q_rest·log(q_rest/π) ≈ 1e-4·17 = 1.7e-3. A rest mass below the old fixed tolerance
    # 4·K·eps32 = 1.2e-4 was thrown away, and the "sound" upper bound came out at −1e-4 < exact. Now
    # lower ≤ exact ≤ upper, with float32 log-probs and logits.
    V, K = 1000, 256
    q = torch.zeros(V, dtype=torch.float64)
    q[:K], q[K] = (1 - q_rest) / K, q_rest
    p = torch.full((V,), 1e-9 / (V - K), dtype=torch.float64)
    p[:K] = (1 - 1e-9) / K
    lq, lp = q.log().float().unsqueeze(0), p.log().float().unsqueeze(0)
    ids = torch.arange(K).unsqueeze(0)
    exact = token_kl(lq, lp).item()
    lower = topk_kl_lower_bound(lq[:, :K], ids, lp).item()
    upper = topk_kl_upper_bound(lq[:, :K], ids, lp).item()
    assert lower <= exact * (1 + 1e-5) and exact <= upper * (1 + 1e-5)
    assert upper > 0.0
    # and the lower-bound case: the rest spread evenly over both tails, where the tail term is negative
    q[K:] = q_rest / (V - K)
    p[:K], p[K:] = 0.5 / K, 0.5 / (V - K)
    lq, lp = q.log().float().unsqueeze(0), p.log().float().unsqueeze(0)
    assert topk_kl_lower_bound(lq[:, :K], ids, lp).item() <= token_kl(lq, lp).item() + 1e-6


def test_divergence_kind_and_fields_feed_logprobbatch():
    z = torch.zeros(2, 3, 4)
    roll = torch.randn(2, 3, 4)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert divergence_kind(rollout_logits=roll) == "exact"
    assert divergence_kind() is None
    f = divergence_fields(z, mask, rollout_logits=roll)
    assert f["token_divergence_kind"] == "exact"
    d = f["token_divergence"]
    assert d.shape == (2, 3) and not d.requires_grad and d.dtype == torch.float32
    assert torch.all(d[mask == 0] == 0)
    torch.testing.assert_close(d[mask == 1].double(), ref_kl(roll, z)[mask == 1], atol=1e-6, rtol=1e-6)
    top = torch.log_softmax(roll, -1).topk(2, -1)
    ft = divergence_fields(z, mask, rollout_topk_logp=top.values, rollout_topk_ids=top.indices)
    assert ft["token_divergence_kind"] == "topk"
    assert torch.all(ft["token_divergence"] <= d + 1e-6)
    none = divergence_fields(z, mask)
    assert none["token_divergence"] is None
    b = LogProbBatch(logp=torch.zeros(2, 3), mask=mask, **ft)
    assert b.token_divergence_kind == "topk"


def test_infinite_divergence_at_valid_token_fails_any_threshold():
    # π gives token 1 probability 0 (logit −inf) where μ gives ½: KL = +inf -> a large finite stand-in, not 0/NaN.
    z = torch.tensor([[[0.0, float("-inf")]]])
    f = divergence_fields(z, torch.ones(1, 1), rollout_logits=torch.zeros(1, 1, 2))
    assert f["token_divergence"].item() == NONFINITE_DIVERGENCE


def test_validation_names_arguments():
    with pytest.raises(ValueError, match="rollout_logits"):
        token_kl(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="rollout_topk"):
        divergence_kind(rollout_topk_logp=torch.zeros(1, 2))
    with pytest.raises(ValueError, match="mask"):
        divergence_fields(torch.zeros(2, 3, 4), torch.ones(3, 2), rollout_logits=torch.zeros(2, 3, 4))

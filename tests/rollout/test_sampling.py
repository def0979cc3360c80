import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.rollout.sampling import SamplingConfig, inverse_cdf, process_logits, sample_tokens, topk_logprobs

NEG_INF = float("-inf")


def test_config_validation_names_the_argument():
    for kwargs, name in [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"logprobs_topk": -1}, "logprobs_topk"),
        ({"max_new_tokens": True}, "max_new_tokens"),
    ]:
        with pytest.raises(ValueError, match=name):
            SamplingConfig(**kwargs)


def test_no_config_is_log_softmax():
    z = torch.tensor([[1.0, 2.0, 3.0]])
    # log_softmax by hand: log(e^z / (e + e^2 + e^3)); e+e²+e³ = 2.71828 + 7.38906 + 20.08554 = 30.19288
    expected = z - math.log(30.19288)
    torch.testing.assert_close(process_logits(z), expected, atol=1e-5, rtol=0)


def test_temperature_hand_computed():
    z = torch.tensor([2.0, 0.0])
    # T = 2: z/T = [1, 0]; p = [e/(e+1), 1/(e+1)] = [0.731059, 0.268941]
    p = process_logits(z, SamplingConfig(temperature=2.0)).exp()
    torch.testing.assert_close(p, torch.tensor([0.731059, 0.268941]), atol=1e-6, rtol=0)


def test_top_k_keeps_ties_like_hf():
    z = torch.tensor([3.0, 1.0, 1.0, 0.0])
    # k = 2: the 2nd largest is 1.0, and both 1.0 tokens tie with it → 3 tokens kept (HF rule: drop z < kth)
    lp = process_logits(z, SamplingConfig(top_k=2))
    assert torch.isinf(lp[3]) and torch.isfinite(lp[:3]).all()
    # kept mass: e^3 + 2e = 20.0855 + 5.4366 = 25.5221 → p0 = 0.786979
    assert lp[0].exp().item() == pytest.approx(20.0855 / 25.5221, abs=1e-5)


def test_top_p_hand_computed():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    z = p.log()
    # top_p = 0.7: cumulative from the top 0.5, 0.8 → token 1 crosses 0.7 and is kept; tokens 2, 3 dropped.
    lp = process_logits(z, SamplingConfig(top_p=0.7))
    torch.testing.assert_close(lp.exp(), torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=1e-6, rtol=0)
    # top_p = 0.5 exactly: ascending cumsum [0.05, 0.2, 0.5, 1.0] ≤ 1 − 0.5 drops tokens 3, 2 and (at equality) 1
    lp = process_logits(z, SamplingConfig(top_p=0.5))
    assert torch.isfinite(lp).tolist() == [True, False, False, False]


def test_min_p_hand_computed():
    p = torch.tensor([0.6, 0.3, 0.07, 0.03])
    # min_p = 0.1: threshold 0.1 × 0.6 = 0.06 → keep 0.6, 0.3, 0.07; renormalised by 0.97
    lp = process_logits(p.log(), SamplingConfig(min_p=0.1))
    torch.testing.assert_close(lp.exp(), torch.tensor([0.6, 0.3, 0.07, 0.0]) / 0.97, atol=1e-6, rtol=0)


def test_order_temperature_then_truncation():
    p = torch.tensor([0.6, 0.3, 0.07, 0.03])
    # T = 2 flattens to p ∝ sqrt(p) = [0.7746, 0.5477, 0.2646, 0.1732] before min_p = 0.3 (threshold 0.2324):
    # token 2 (0.2646) survives only because temperature came first.
    lp = process_logits(p.log(), SamplingConfig(temperature=2.0, min_p=0.3))
    assert torch.isfinite(lp).tolist() == [True, True, True, False]


def test_fullgraph_compile_matches_eager():
    cfg = SamplingConfig(temperature=0.7, top_k=5, top_p=0.9, min_p=0.01)
    z = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(lambda x: process_logits(x, cfg), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(z), process_logits(z, cfg))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    temperature=st.floats(0.2, 3.0),
    top_k=st.one_of(st.none(), st.integers(1, 40)),
    top_p=st.one_of(st.none(), st.floats(0.05, 1.0)),
    min_p=st.one_of(st.none(), st.floats(0.0, 0.5)),
)
def test_processed_distribution_properties(seed, temperature, top_k, top_p, min_p):
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    z = 3 * torch.randn(4, 32, generator=torch.Generator().manual_seed(seed))
    lp = process_logits(z, cfg)
    # a distribution: finite entries sum to 1
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(4), atol=1e-5, rtol=0)
    # the most likely token always survives, and truncation never *raises* an unkept token
    assert torch.isfinite(lp.gather(-1, z.argmax(-1, keepdim=True))).all()
    kept = torch.isfinite(lp)
    plain = torch.log_softmax(z / temperature, -1)
    # kept tokens keep their relative order: log p_kept − log p_plain is the same constant per row
    shift = torch.where(kept, lp - plain, torch.zeros_like(lp))
    row_shift = shift.max(-1, keepdim=True).values
    torch.testing.assert_close(torch.where(kept, shift, row_shift), row_shift.expand_as(shift), atol=1e-4, rtol=0)
    # support is an upper set of the plain distribution: every dropped token is below every kept one
    lowest_kept = torch.where(kept, plain, torch.full_like(plain, math.inf)).min(-1).values
    highest_dropped = torch.where(~kept, plain, torch.full_like(plain, -math.inf)).max(-1).values
    assert (highest_dropped <= lowest_kept + 1e-6).all()
    if top_k is not None:
        assert (kept.sum(-1) <= top_k).all()  # continuous random logits: no ties


@pytest.mark.parametrize("method", ["inverse_cdf", "multinomial"])
def test_sample_tokens_respects_support_and_frequencies(method):
    g = torch.Generator().manual_seed(0)
    lp = torch.log(torch.tensor([[0.7, 0.2, 0.1, 0.0]])).expand(20_000, 4)
    ids = sample_tokens(lp, g, method)
    freq = torch.bincount(ids, minlength=4).float() / 20_000
    # binomial sd of p=0.7 at n=20000 is 0.0032; 0.015 is > 4 sd
    torch.testing.assert_close(freq, torch.tensor([0.7, 0.2, 0.1, 0.0]), atol=0.015, rtol=0)
    assert freq[3] == 0


def test_inverse_cdf_frequencies_match_a_vocabulary_sized_distribution():
    # 4,099 tokens with log-normal-ish probabilities; 40,000 draws split over 8 buckets of the sorted vocabulary.
    # Each bucket's count is binomial: sd = sqrt(n p (1 − p)) ≤ sqrt(40000 · 0.25) = 100, so 5 sd ≤ 500 draws, i.e.
    # 0.0125 in frequency; an off-by-one in the search moves each draw to its neighbour in vocabulary order, which
    # lies in a random bucket of the sorted one, and shifts the buckets by far more (the float64 running sum has a
    # test of its own, test_inverse_cdf_reaches_a_tail_token_behind_a_large_mass)
    n = 40_000
    g = torch.Generator().manual_seed(1)
    lp = torch.log_softmax(torch.randn(4099, generator=g) * 2.0, -1)
    ids = sample_tokens(lp.expand(n, -1), g, "inverse_cdf")
    order = torch.argsort(lp)
    bucket_of = torch.empty(4099, dtype=torch.long)
    bucket_of[order] = torch.arange(4099) * 8 // 4099
    freq = torch.bincount(bucket_of[ids], minlength=8).double() / n
    expected = torch.zeros(8, dtype=torch.float64).index_add_(0, bucket_of, lp.double().exp())
    torch.testing.assert_close(freq, expected, atol=0.0125, rtol=0)
    shifted = torch.bincount(bucket_of[(ids + 1) % 4099], minlength=8).double() / n  # the off-by-one's buckets
    assert float((shifted - expected).abs().max()) > 0.0125


def test_inverse_cdf_by_hand():
    # p = (0.5, 0, 0.25, 0.25): c = (0.5, 0.5, 0.75, 1.0), S = 1; the first a with c_a > u·S
    p = torch.tensor([[0.5, 0.0, 0.25, 0.25]])
    u = torch.tensor([[0.0], [0.4999], [0.5], [0.7499], [0.75], [1.0 - 2**-53]], dtype=torch.float64)
    assert inverse_cdf(p.expand(6, 4), u).tolist() == [0, 0, 2, 2, 3, 3]
    # unnormalised p scales u: p = (2, 6), S = 8 → u = 0.25 lands at c = 2 exactly → the next token
    assert inverse_cdf(torch.tensor([[2.0, 6.0]]), torch.tensor([[0.25]], dtype=torch.float64)).tolist() == [1]


def test_inverse_cdf_reaches_a_tail_token_behind_a_large_mass():
    # p = (0.5, 1e-9, 0.5): in float32 0.5 + 1e-9 rounds to 0.5 (spacing 6e-8) and the 1e-9 token could never be
    # drawn; the float64 running sum keeps its interval [0.5, 0.5 + 1e-9) of S = 1 + 1e-9
    p = torch.tensor([[0.5, 1e-9, 0.5]])
    tiny = float(p[0, 1].double())  # the float32 value of 1e-9, exact in float64
    total = 1.0 + tiny

    def pick(mass_before_u: float) -> int:
        return int(inverse_cdf(p, torch.tensor([[mass_before_u / total]], dtype=torch.float64)))

    assert [pick(0.5 - tiny), pick(0.5 + 0.5 * tiny), pick(0.5 + 1.01 * tiny)] == [0, 1, 2]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.0, 1e-30, 1e-12, 1e-6, 0.3, 1.0, 7.0]), min_size=1, max_size=12),
       st.floats(0.0, 1.0, exclude_max=True))
def test_inverse_cdf_never_picks_a_zero_probability_token(probs, u):
    if sum(probs) == 0:
        probs = [*probs[:-1], 1.0]
    p = torch.tensor([probs])
    for x in (u, 0.0, 1.0 - 2**-53):  # the largest float64 below 1: u·S may round up to S
        a = inverse_cdf(p, torch.tensor([[x]], dtype=torch.float64)).item()
        assert 0 <= a < len(probs) and p[0, a] > 0


def test_sample_tokens_is_seeded_and_draws_one_uniform_per_row():
    lp = torch.log_softmax(torch.randn(5, 50, generator=torch.Generator().manual_seed(0)), -1)
    first = sample_tokens(lp, torch.Generator().manual_seed(3))
    assert torch.equal(first, sample_tokens(lp, torch.Generator().manual_seed(3)))
    g = torch.Generator().manual_seed(3)
    sample_tokens(lp, g)
    reference = torch.Generator().manual_seed(3)
    torch.rand((5, 1), generator=reference, dtype=torch.float64)
    assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=reference))


def test_sample_tokens_errors_name_the_problem():
    with pytest.raises(ValueError, match="method"):
        sample_tokens(torch.zeros(1, 3), method="gumbel")
    with pytest.raises(ValueError, match="logp"):
        sample_tokens(torch.tensor([[0.0, float("nan")]]))
    with pytest.raises(ValueError, match="logp"):
        sample_tokens(torch.full((1, 3), NEG_INF))


def test_topk_logprobs_shows_neg_inf_when_support_is_small():
    lp = process_logits(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), SamplingConfig(top_k=2))
    values, ids = topk_logprobs(lp, 3)
    assert ids[0, :2].tolist() == [0, 1]
    assert values[0, 2].item() == NEG_INF

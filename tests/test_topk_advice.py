"""offpolicy.topk_advice: when TRM's certified top-k bound is vacuous, and which K would make it informative."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.trust_region import trm
from offpolicy.divergence import topk_kl_lower_bound, topk_kl_upper_bound
from offpolicy.topk_advice import (
    TopKAdvice,
    certifiable_fraction,
    doubling_ks,
    own_topk_slack,
    topk_advice,
)


def test_certifiable_fraction_hand_values():
    # sequence 0: slack (0.01, 0.03) → max 0.03 ≤ 0.05, mean 0.02; sequence 1: (0.2, pad) → max 0.2 > 0.05;
    # sequence 2: empty (not counted)
    slack = torch.tensor([[0.01, 0.03], [0.2, 9.0], [5.0, 5.0]])
    mask = torch.tensor([[True, True], [True, False], [False, False]])
    assert certifiable_fraction(slack, mask, max_kl=0.05, avg_kl=None) == 0.5
    assert certifiable_fraction(slack, mask, max_kl=0.05, avg_kl=0.01) == 0.0  # mean 0.02 > 0.01
    assert certifiable_fraction(slack, mask, max_kl=None, avg_kl=0.25) == 1.0  # means 0.02 and 0.2
    assert certifiable_fraction(slack, torch.zeros_like(mask), max_kl=0.05, avg_kl=None) == 1.0


def test_advice_on_a_heavy_tail_is_vacuous_and_suggests_the_k_that_covers_it():
    # V = 64: μ = π put 0.9 on 4 tokens (0.225 each) and 0.1 evenly on the other 60 (1/600 each). With the engine's
    # top-4, the tail (0.1, cap 0.225) may all sit on one tail token: slack 0.1 log(0.1 / (1/600)) − 0 = 0.409 per
    # token > 0.05: nothing certifiable. π's own top-8 leaves 56/600 of tail with cap 1/600: every tail token at its
    # own probability — no slack at all; the suggestion is the first doubling that gets there: 8.
    v, k = 64, 4
    p = torch.full((v,), 0.1 / 60)
    p[:k] = 0.225
    z = p.log().expand(2, 3, v)
    lp = z.log_softmax(-1)
    top = lp.topk(k, -1)
    lower = topk_kl_lower_bound(top.values, top.indices, z)
    upper = topk_kl_upper_bound(top.values, top.indices, z)
    assert float(upper.mean()) == pytest.approx(0.1 * math.log(0.1 * 600), rel=1e-4)
    ks = doubling_ks(k, v)
    assert ks == [8, 16, 32, 64]
    own = own_topk_slack(z.reshape(-1, v), ks).reshape(len(ks), 2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    advice = topk_advice(lower, upper, mask, top.values, max_kl=0.05, avg_kl=0.001, own_slack=own, ks=ks)
    assert advice.vacuous and advice.certifiable == 0.0
    assert advice.head_mass == pytest.approx(0.9, rel=1e-5) and advice.slack == pytest.approx(0.4094, rel=1e-3)
    assert advice.suggested_k == 8 and advice.suggested_k_max_only == 8
    assert "topk_logprobs=8" in advice.message() and "avg_kl=None" in advice.message()
    # the same data at K = 8 is informative (nothing to suggest)
    top8 = lp.topk(8, -1)
    a8 = topk_advice(topk_kl_lower_bound(top8.values, top8.indices, z), topk_kl_upper_bound(top8.values, top8.indices, z),
                     mask, top8.values, max_kl=0.05, avg_kl=0.001)
    assert not a8.vacuous and a8.certifiable == 1.0 and "informative" in a8.message()


@settings(max_examples=40, deadline=None)
@given(v=st.integers(4, 40), k=st.integers(1, 8), scale=st.floats(0.2, 5.0), noise=st.floats(0.0, 0.5),
       seed=st.integers(0, 10_000))
def test_trm_on_the_upper_bound_never_keeps_more_than_the_certifiable_fraction(v, k, scale, noise, seed):
    # the certified test keeps a sequence only if max upper ≤ δ and mean upper ≤ δ_avg; upper ≥ slack, so TRM's
    # accept rate can never exceed the fraction the slack alone allows
    k = min(k, v - 1)
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(3, 5, v, generator=g) * scale
    roll = z + noise * torch.randn(3, 5, v, generator=g)
    top = roll.log_softmax(-1).topk(k, -1)
    lower = topk_kl_lower_bound(top.values, top.indices, z)
    upper = topk_kl_upper_bound(top.values, top.indices, z)
    mask = torch.rand(3, 5, generator=g) > 0.2
    batch = LogProbBatch(logp=torch.zeros(3, 5), rollout_logp=torch.zeros(3, 5), mask=mask.float(),
                         token_divergence=upper, token_divergence_kind="topk")
    for max_kl, avg_kl in [(0.05, 0.001), (0.5, None), (None, 0.1)]:
        accepted = 1.0 - float(trm(max_kl=max_kl, avg_kl=avg_kl)(batch).metrics["trm/masked_seq_frac"])
        advice = topk_advice(lower, upper, mask, top.values, max_kl=max_kl, avg_kl=avg_kl)
        assert accepted <= advice.certifiable + 1e-6


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="must share"):
        topk_advice(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), torch.zeros(2, 3, 1), max_kl=0.05,
                    avg_kl=None)
    with pytest.raises(ValueError, match="own_slack"):
        topk_advice(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3, 1), max_kl=0.05,
                    avg_kl=None, own_slack=torch.zeros(1, 2, 3), ks=[2, 4])


def test_message_without_a_suggestion_names_the_other_ways_out():
    msg = TopKAdvice(8, 0.05, None, 0.5, 3.0, 0.0, None).message()
    assert "vacuous" in msg and "No larger K" in msg and "topk_bound='lower'" in msg and "maximum only" not in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TopKAdvice(8, 0.05, None, 0.999, 0.001, 1.0).message().endswith("of the sequences.")


def test_a_max_test_that_would_pass_alone_is_named():
    # slack 0.003 on every token: max 0.003 ≤ 0.05 passes, mean 0.003 > 0.001 fails — the average test alone is what
    # rejects everything (TRM's default pair under live vLLM at K = 20)
    slack = torch.full((2, 3), 0.003)
    m = torch.ones(2, 3, dtype=torch.bool)
    a = topk_advice(torch.zeros(2, 3), slack, m, torch.full((2, 3, 1), -0.01), max_kl=0.05, avg_kl=0.001)
    assert a.vacuous and a.certifiable == 0.0 and a.certifiable_max_only == 1.0
    assert "avg_kl=None (at this K it could keep 100 %)" in a.message()

"""Tests for kl_rejection: verl's divergence rejection modes (token / seq_sum / seq_mean / seq_max × k2 / k3)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import chain
from offpolicy.corrections.trust_region import KL_REJECTION_MODES, kl_rejection, trm

NAN, INF = float("nan"), float("inf")


def batch(old: torch.Tensor, mask: torch.Tensor) -> LogProbBatch:
    """μ = 0, so r = log(π_old/μ) = old (source="mismatch")."""
    return LogProbBatch(logp=torch.zeros_like(old), old_logp=old, rollout_logp=torch.zeros_like(old), mask=mask)


# r: row 0 = (0.2, −0.4, pad), row 1 = (0.1, 0.1, 0.1), row 2 empty
R = torch.tensor([[0.2, -0.4, 9.0], [0.1, 0.1, 0.1], [0.0, 0.0, 0.0]])
M = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
K2 = [[0.02, 0.08], [0.005] * 3]  # ½r²
K3 = [[math.exp(0.2) - 1.2, math.exp(-0.4) - 0.6], [math.exp(0.1) - 1.1] * 3]  # e^r − 1 − r: 0.021403, 0.070320; 0.005171


@pytest.mark.parametrize(
    "mode, upper, kept_rows",
    [
        # seq_sum: k2 sums 0.10 and 0.015; k3 sums 0.091723 and 0.015513
        ("seq_sum_k2", 0.05, [False, True, False]),
        ("seq_sum_k2", 0.1001, [True, True, False]),
        ("seq_sum_k3", 0.09, [False, True, False]),
        # seq_mean: k2 means 0.05 and 0.005; k3 means 0.045862 and 0.005171
        ("seq_mean_k2", 0.04, [False, True, False]),
        ("seq_mean_k3", 0.046, [True, True, False]),
        ("seq_mean_k3", 0.045, [False, True, False]),
        # seq_max: k2 maxima 0.08 and 0.005; k3 maxima 0.070320 and 0.005171
        ("seq_max_k2", 0.079, [False, True, False]),
        ("seq_max_k3", 0.071, [True, True, False]),
    ],
)
def test_sequence_modes_by_hand(mode, upper, kept_rows):
    r = kl_rejection(mode, upper=upper)(batch(R, M))
    assert r.keep.any(-1).tolist() == kept_rows
    assert torch.equal(r.keep, r.keep & M.bool())  # only valid tokens are kept
    assert r.metrics[f"{mode}/masked_seq_frac"].item() == pytest.approx(kept_rows[:2].count(False) / 2)  # of 2 non-empty
    dropped_tokens = sum(n for n, kept in zip((2, 3), kept_rows) if not kept)  # row 0 has 2 valid tokens, row 1 3
    assert r.metrics[f"{mode}/masked_frac"].item() == pytest.approx(dropped_tokens / 5)


def test_the_threshold_is_inclusive():
    # r = 0.5 (exact in float32): k2 = ½·0.25 = 0.125 exactly, kept at upper = 0.125 and dropped just below
    b = batch(torch.tensor([[0.5, 0.5]]), torch.ones(1, 2))
    for mode in ("token_k2", "seq_mean_k2", "seq_max_k2"):
        assert kl_rejection(mode, upper=0.125)(b).keep.all(), mode
        assert not kl_rejection(mode, upper=0.1249)(b).keep.any(), mode


def test_sequence_stat_mean_by_hand():
    m = kl_rejection("seq_mean_k3", upper=1.0)(batch(R, M)).metrics
    expected = ((K3[0][0] + K3[0][1]) / 2 + K3[1][0]) / 2  # mean over the two non-empty sequences
    assert m["seq_mean_k3/stat_mean"].item() == pytest.approx(expected, rel=1e-5)


def test_token_modes_by_hand():
    # token_k2 at 0.03: keeps k2 = 0.02 and the three 0.005, drops 0.08 → 1 of 5 valid tokens rejected
    r = kl_rejection("token_k2", upper=0.03)(batch(R, M))
    assert r.keep.tolist() == [[True, False, False], [True, True, True], [False, False, False]]
    assert r.metrics["token_k2/masked_frac"].item() == pytest.approx(1 / 5)
    assert r.metrics["token_k2/masked_seq_frac"].item() == 0.0  # no sequence lost every token
    assert r.metrics["token_k2/stat_mean"].item() == pytest.approx((0.02 + 0.08 + 3 * 0.005) / 5, rel=1e-5)
    r = kl_rejection("token_k3", upper=0.02)(batch(R, M))  # 0.021403 and 0.070320 above 0.02
    assert r.keep.tolist() == [[False, False, False], [True, True, True], [False, False, False]]


def test_nonfinite_drops_its_token_or_sequence_and_padding_never_matters():
    old = torch.tensor([[0.0, NAN, 0.0], [0.0, -INF, 0.0], [0.0, 0.0, NAN]])
    m = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]])  # row 2's NaN is padding
    r = kl_rejection("token_k3", upper=1.0)(batch(old, m))
    assert r.keep.tolist() == [[True, False, True], [True, False, True], [True, True, False]]
    for mode in ("seq_sum_k2", "seq_mean_k3", "seq_max_k2"):
        r = kl_rejection(mode, upper=1.0)(batch(old, m))
        assert r.keep.any(-1).tolist() == [False, False, True], mode
        assert all(bool(torch.isfinite(v)) for v in r.metrics.values())


def test_k1_modes_point_to_mis_and_bad_arguments_are_named():
    with pytest.raises(ValueError, match="mis"):
        kl_rejection("seq_mean_k1", upper=1.0)
    with pytest.raises(ValueError, match="mode"):
        kl_rejection("seq_median_k3", upper=1.0)
    for bad in (0.0, -1.0, NAN, INF):
        with pytest.raises(ValueError, match="upper"):
            kl_rejection("token_k2", upper=bad)
    with pytest.raises(ValueError, match="source"):
        kl_rejection("token_k2", upper=1.0, source="old")


def test_two_modes_chain_under_their_own_names():
    r = chain(kl_rejection("token_k2", upper=0.03), kl_rejection("seq_mean_k3", upper=0.045))(batch(R, M))
    assert {"token_k2/masked_frac", "seq_mean_k3/masked_frac"} <= set(r.metrics)
    # AND of both: token_k2 drops (0, 1); seq_mean_k3 drops row 0 → only row 1 left
    assert r.keep.tolist() == [[False, False, False], [True, True, True], [False, False, False]]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 5), st.integers(1, 10), st.sampled_from([0.01, 0.1, 0.5]),
       st.sampled_from([1e-4, 1e-3, 1e-2]))
def test_seq_max_k2_and_seq_mean_k3_are_trms_fallback_tests(seed, b, t, scale, threshold):
    g = torch.Generator().manual_seed(seed)
    old = scale * torch.randn(b, t, generator=g)
    m = torch.rand(b, t, generator=g) < 0.8
    bt = batch(old, m)
    src = "mismatch"
    assert torch.equal(kl_rejection("seq_max_k2", threshold, src)(bt).keep, trm(threshold, None, src)(bt).keep)
    assert torch.equal(kl_rejection("seq_mean_k3", threshold, src)(bt).keep, trm(None, threshold, src)(bt).keep)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(KL_REJECTION_MODES))
def test_on_policy_keeps_every_valid_token(seed, mode):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(3, 6, generator=g) < 0.7
    r = kl_rejection(mode, upper=1e-12)(batch(torch.zeros(3, 6), m))  # r = 0 → k = 0 ≤ any threshold
    assert torch.equal(r.keep, m) and torch.equal(r.weights, m.float())
    assert r.metrics[f"{mode}/masked_frac"].item() == 0.0 and r.metrics[f"{mode}/kept_frac"].item() == 1.0


def test_source_total_reads_the_current_policy():
    b = LogProbBatch(logp=torch.tensor([[0.5]]), old_logp=torch.zeros(1, 1), rollout_logp=torch.zeros(1, 1),
                     mask=torch.ones(1, 1))
    assert kl_rejection("token_k2", upper=0.1)(b).keep.all()  # π_old/μ = 1
    assert not kl_rejection("token_k2", upper=0.1, source="total")(b).keep.any()  # ½·0.25 = 0.125 > 0.1

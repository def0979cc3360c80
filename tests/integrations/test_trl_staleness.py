"""Per-token staleness of asynchronous rollouts and the metrics split by it (``offpolicy.integrations.trl.staleness``):
the packed-terms-to-rows layout, staleness by hand, and each bucket's k3 / clipped / dropped fractions by hand."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.corrections.base import CorrectionResult
from offpolicy.integrations.trl.staleness import rows_from_packed, token_staleness
from offpolicy.metrics import metrics_by_staleness


def test_rows_from_packed_lays_each_completion_in_order_and_pads_with_fill():
    seg = torch.tensor([0, 0, 0, 1, 2, 2])
    mask, a, b = rows_from_packed(seg, torch.arange(6.0), torch.arange(6) * 10, fill=-1)
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert a.tolist() == [[0, 1, 2], [3, -1, -1], [4, 5, -1]]
    assert b.tolist() == [[0, 10, 20], [30, -1, -1], [40, 50, -1]] and b.dtype == torch.long


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=6))
def test_rows_from_packed_round_trips_and_padding_carries_no_gradient(lengths):
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    x = torch.randn(seg.numel(), requires_grad=True)
    mask, rows = rows_from_packed(seg, x)
    assert torch.equal(rows[mask.bool()], x.detach())  # row-major order is the packed order
    assert mask.sum(1).tolist() == lengths
    (rows * 3).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))  # each term once; padding reaches nothing


def test_rows_from_packed_refuses_unordered_segments_and_mismatched_values():
    with pytest.raises(ValueError, match="non-decreasing"):
        rows_from_packed(torch.tensor([1, 0]), torch.zeros(2))
    with pytest.raises(ValueError, match=r"values\[0\] has shape \(3,\)"):
        rows_from_packed(torch.tensor([0, 1]), torch.zeros(3))
    with pytest.raises(ValueError, match="segment_id must be a 1-D integer"):
        rows_from_packed(torch.tensor([0.0, 1.0]), torch.zeros(2))


def test_token_staleness_is_the_trainer_version_minus_the_samples():
    # samples sampled at versions 5, 2, 5; the trainer at version 6: terms of sample 1 are 4 versions old
    st_ = token_staleness(torch.tensor([5, 2, 5, -1]), torch.tensor([0, 0, 1, 1, 1, 2]), 6)
    assert st_.tolist() == [1, 1, 4, 4, 4, 1]
    with pytest.raises(ValueError, match="without a version"):
        token_staleness(torch.tensor([5, -1]), torch.tensor([0, 1]), 6)
    with pytest.raises(ValueError, match="newer than the trainer's"):
        token_staleness(torch.tensor([7]), torch.tensor([0]), 6)


def test_staleness_metrics_by_hand():
    # row 0: 2 fresh tokens (d=0), π = μ; row 1: 2 tokens of d=3, log ρ = 1 and −1; padding has d = −1
    staleness = torch.tensor([[0, 0, -1], [3, 3, -1]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    pi = torch.zeros(2, 3)
    mu = torch.tensor([[0.0, 0.0, 5.0], [-1.0, 1.0, 5.0]])
    # a correction that truncates the ρ = e token to 2 and drops the ρ = e⁻¹ one
    w = torch.exp(pi - mu)
    w[1, 0] = 2.0
    keep = mask.bool().clone()
    keep[1, 1] = False
    out = metrics_by_staleness(staleness, pi, mu, mask, CorrectionResult(w, keep, {}, weight_level="token"))
    assert out["staleness/mean"].item() == pytest.approx(1.5)
    assert out["staleness/max"].item() == 3.0
    assert out["staleness/d0/k3_kl"].item() == 0.0 and out["staleness/d0/tokens"].item() == 2.0
    k3 = ((math.e - 1 - 1) + (math.exp(-1) + 1 - 1)) / 2  # ρ − log ρ − 1 at ρ = e and e⁻¹
    assert out["staleness/d3/k3_kl"].item() == pytest.approx(k3, rel=1e-5)
    assert out["staleness/d0/clipped_frac"].item() == 0.0 and out["staleness/d0/masked_frac"].item() == 0.0
    assert out["staleness/d3/clipped_frac"].item() == 1.0  # both: one truncated, one dropped
    assert out["staleness/d3/masked_frac"].item() == 0.5
    assert not any(k.startswith("staleness/d-1") for k in out)  # padding is no bucket


def test_staleness_metrics_without_a_correction_or_valid_tokens():
    out = metrics_by_staleness(torch.tensor([[1, 1]]), torch.zeros(1, 2), torch.full((1, 2), -0.5), torch.ones(1, 2))
    assert out["staleness/d1/clipped_frac"].item() == 0.0 and out["staleness/d1/k3_kl"].item() > 0
    empty = metrics_by_staleness(torch.full((1, 2), -1), torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2))
    assert set(empty) == {"staleness/mean", "staleness/max"} and empty["staleness/mean"].item() == 0.0

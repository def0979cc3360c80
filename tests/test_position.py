"""The mismatch by position (``offpolicy.position``): bins by hand, the bins partition the whole-batch diagnostics,
padding never contributes, the context-depth offset, and errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy import offpolicy_metrics
from offpolicy.position import bin_label, mismatch_by_position, position_bin_edges, position_metrics


def test_by_hand():
    # one row of 10 tokens, π = 0, μ = −0.1·t: r_t = 0.1·t; bins [0, 8) and [8, 16)
    t = torch.arange(10, dtype=torch.float32)
    train, rollout = torch.zeros(1, 10), (-0.1 * t)[None]
    p = mismatch_by_position(train, rollout, torch.ones(1, 10))
    assert p.edges == [0, 8, 16] and p.labels() == ["pos00000-00007", "pos00008-00015"]
    assert p.stats["tokens"].tolist() == [8.0, 2.0]
    # kl = mean(μ − π) = mean(−0.1 t): bin 0: −0.1·(0+…+7)/8 = −0.35; bin 1: −0.1·(8+9)/2 = −0.85
    torch.testing.assert_close(p.stats["kl"], torch.tensor([-0.35, -0.85]))
    # |r|: 0.35, 0.85; k2 = ½ mean r²: bin 0: ½·0.01·(0+1+4+…+49)/8 = ½·0.01·140/8 = 0.0875; bin 1: ½·0.01·(64+81)/2 = 0.3625
    torch.testing.assert_close(p.stats["logp_abs_diff_mean"], torch.tensor([0.35, 0.85]))
    torch.testing.assert_close(p.stats["k2_kl"], torch.tensor([0.0875, 0.3625]))
    # k3 = mean(e^r − 1 − r): bin 1: ((e^0.8 − 1.8) + (e^0.9 − 1.9))/2 = (0.425541 + 0.559603)/2 = 0.492572
    assert p.stats["k3_kl"][1].item() == pytest.approx((math.exp(0.8) - 1.8 + math.exp(0.9) - 1.9) / 2, rel=1e-6)
    assert "kl_exact" not in p.stats


def test_exact_kl_padding_and_context_depth():
    # row 0: 3 valid tokens then padding holding junk; row 1: 1 valid token. Exact KL given per token.
    train = torch.tensor([[0.0, 0.0, 0.0, float("nan")], [0.0, 5.0, 5.0, 5.0]])
    rollout = torch.tensor([[-1.0, 0.0, 0.0, float("inf")], [-2.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    kl = torch.tensor([[0.3, 0.1, 0.2, float("nan")], [0.5, 9.0, 9.0, 9.0]])
    p = mismatch_by_position(train, rollout, mask, token_kl=kl, edges=[0, 1, 4])
    assert p.stats["tokens"].tolist() == [2.0, 2.0]
    torch.testing.assert_close(p.stats["kl_exact"], torch.tensor([(0.3 + 0.5) / 2, (0.1 + 0.2) / 2]))
    torch.testing.assert_close(p.stats["kl"], torch.tensor([(-1.0 - 2.0) / 2, 0.0]))
    # by depth in the context: prompts of 2 and 0 tokens → row 0 sits at positions 2, 3, 4 (4 beyond the edges)
    d = mismatch_by_position(train, rollout, mask, start=torch.tensor([2, 0]), edges=[0, 1, 4])
    assert d.stats["tokens"].tolist() == [1.0, 2.0]  # row 1's token at 0; row 0's at 2 and 3; position 4 left out
    torch.testing.assert_close(d.stats["kl"], torch.tensor([-2.0, -0.5]))
    # default edges reach the deepest position
    assert mismatch_by_position(train, rollout, mask, start=torch.tensor([30, 0])).edges == [0, 8, 16, 32, 64]


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 5), st.integers(1, 40), st.sampled_from([1e-4, 0.1, 1.0]))
def test_the_bins_partition_the_batch_and_ignore_padding(seed, b, t, scale):
    g = torch.Generator().manual_seed(seed)
    train = -3 * torch.rand(b, t, generator=g)
    rollout = train + scale * torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) < 0.7
    p = mismatch_by_position(train, rollout, mask)
    whole = offpolicy_metrics(train, rollout, mask, prefix="")
    n = p.stats["tokens"]
    assert n.sum().item() == mask.sum().item()
    for name in ("kl", "k2_kl", "k3_kl", "logp_abs_diff_mean"):
        pooled = (p.stats[name] * n).sum() / n.sum().clamp(min=1)
        torch.testing.assert_close(pooled, whole[name], rtol=1e-4, atol=1e-7)
    junk = torch.tensor([float("nan"), float("inf"), -1e30])[torch.randint(0, 3, (b, t), generator=g)]
    q = mismatch_by_position(torch.where(mask, train, junk), torch.where(mask, rollout, junk), mask)
    assert all(torch.equal(p.stats[k], q.stats[k]) for k in p.stats)
    # on-policy: every bin 0
    z = mismatch_by_position(train, train.clone(), mask)
    assert all(bool((z.stats[k] == 0).all()) for k in ("kl", "k2_kl", "k3_kl", "logp_abs_diff_mean"))


def test_metrics_keys_and_bf16():
    m = position_metrics(torch.zeros(2, 20, dtype=torch.bfloat16), torch.full((2, 20), -0.5, dtype=torch.bfloat16),
                         torch.ones(2, 20))
    assert sorted({k.split("/")[-1] for k in m}) == ["pos00000-00007", "pos00008-00015", "pos00016-00031"]
    assert m["mismatch/by_position/kl/pos00016-00031"].item() == pytest.approx(-0.5)
    assert m["mismatch/by_position/tokens/pos00016-00031"].item() == 8.0  # positions 16 … 19 of two rows
    assert all(v.dtype == torch.float32 and v.dim() == 0 for v in m.values())
    empty = position_metrics(torch.zeros(0, 0), torch.zeros(0, 0), torch.zeros(0, 0))
    assert set(empty) == {f"mismatch/by_position/{s}/pos00000-00007" for s in
                          ("kl", "k2_kl", "k3_kl", "logp_abs_diff_mean", "tokens")}
    assert all(v.item() == 0.0 for v in empty.values())


def test_errors_name_the_argument():
    x = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="edges must be increasing ints starting at 0"):
        mismatch_by_position(x, x, torch.ones(1, 3), edges=[1, 2])
    with pytest.raises(ValueError, match=r"start must be \[B=1\]"):
        mismatch_by_position(x, x, torch.ones(1, 3), start=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="token_kl"):
        mismatch_by_position(x, x, torch.ones(1, 3), token_kl=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="first must be an int >= 1"):
        position_bin_edges(10, first=0)
    assert bin_label(0, 8) == "pos00000-00007"

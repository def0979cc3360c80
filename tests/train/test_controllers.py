"""The adaptive controllers against hand-built sequences of metrics (arithmetic in the comments)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.train.controllers import AcceptanceController, LRGuard, RatioBandController

# -- AcceptanceController ------------------------------------------------------------------------------------------


def test_acceptance_keeps_the_floor_while_the_mismatch_is_small():
    c = AcceptanceController(floor=0.05, target=0.7, window=2)
    for _ in range(5):
        assert c.update(torch.full((8,), 0.01)) == 0.05


def test_acceptance_relaxes_to_the_window_quantile_and_back():
    c = AcceptanceController(floor=0.05, target=0.5, window=2)
    # quantiles are order statistics, position q·(n − 1) rounded up (so ≥ target of the window is accepted)
    # step 1: stats 0.1, 0.2, 0.3, 0.4 → median at position 1.5 → index 2 → 0.3
    assert c.update(torch.tensor([0.1, 0.2, 0.3, 0.4])) == pytest.approx(0.3)
    # step 2: pooled with 0.5, 0.6, 0.7, 0.8 → eight values, position 3.5 → index 4 → 0.5
    assert c.update(torch.tensor([0.5, 0.6, 0.7, 0.8])) == pytest.approx(0.5)
    # step 3: the first step leaves the window: (0.01 × 4, 0.5 … 0.8) → position 3.5 → index 4 → 0.5
    assert c.update(torch.full((4,), 0.01)) == pytest.approx(0.5)
    # step 4: only small stats in the window → back at the floor
    assert c.update(torch.full((4,), 0.01)) == 0.05


def test_acceptance_is_causal_and_reaches_its_target_on_a_stationary_stream():
    gen = torch.Generator().manual_seed(0)
    c = AcceptanceController(floor=1e-3, target=0.7, window=5)
    accepted = []
    for _ in range(60):
        stats = torch.rand(64, generator=gen) * 0.1  # uniform on [0, 0.1]: Q_0.7 = 0.07 ≫ floor
        threshold = c.threshold  # what this step uses: fitted to earlier steps only
        accepted.append(float((stats <= threshold).float().mean()))
        c.update(stats)
    assert 0.68 < sum(accepted[10:]) / 50 < 0.76  # at the target, a little above (order-statistic quantile)


def test_acceptance_ignores_sequences_without_a_statistic_and_validates():
    c = AcceptanceController(floor=0.05, target=0.5, window=1)
    # finite: (0.2, 0.4) → median position 0.5 rounded up → 0.4
    assert c.update(torch.tensor([float("nan"), 0.2, float("-inf"), 0.4]), None) == pytest.approx(0.4)
    assert c.update(torch.tensor([float("nan")])) == pytest.approx(0.4)  # nothing finite: keep the threshold
    with pytest.raises(ValueError, match="floor"):
        AcceptanceController(floor=0.0)
    with pytest.raises(ValueError, match="target"):
        AcceptanceController(floor=0.1, target=1.0)


def test_acceptance_state_round_trips():
    a = AcceptanceController(floor=0.05, target=0.5, window=2)
    a.update(torch.tensor([0.1, 0.9]))
    b = AcceptanceController(floor=0.05, target=0.5, window=2)
    b.load_state_dict(a.state_dict())
    x = torch.tensor([0.3, 0.7])
    assert a.update(x) == b.update(x)


# -- RatioBandController -------------------------------------------------------------------------------------------


def test_band_stays_configured_when_ratios_are_inside():
    c = RatioBandController(lower=0.5, upper=2.0, max_masked=0.05, window=1)
    log_ratio = torch.log(torch.tensor([[0.9, 1.0, 1.1, 1.2]]))
    assert c.update(log_ratio, torch.ones(1, 4)) == (0.5, 2.0)


def test_band_widens_two_sided_to_the_quantiles():
    c = RatioBandController(lower=0.5, upper=2.0, max_masked=0.5, window=1)
    # log₂ρ = (−3, −1, 0, 1, 3); 0.25 on each side: Q_0.25 at position 1 → −1 → ρ 0.5 (not below 0.5: kept 0.5);
    # Q_0.75 at position 3 → 1 → ρ = 2 → U = max(2, 2) = 2. Add spread: log₂ρ = (−4, −3, 0, 3, 4):
    # Q_0.25 → −3 → L = min(0.5, 1/8) = 0.125; Q_0.75 → 3 → U = max(2, 8) = 8
    ratios = torch.tensor([[1 / 16, 1 / 8, 1.0, 8.0, 16.0]])
    lower, upper = c.update(torch.log(ratios), torch.ones(1, 5))
    assert lower == pytest.approx(0.125) and upper == pytest.approx(8.0)


def test_band_ignores_padding_even_when_it_holds_huge_values():
    c = RatioBandController(lower=None, upper=2.0, max_masked=0.1, window=1)
    log_ratio = torch.tensor([[0.0, 0.0, 50.0, float("inf")]])
    mask = torch.tensor([[1, 1, 0, 0]])
    assert c.update(log_ratio, mask) == (None, 2.0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-3, 3), min_size=20, max_size=200), st.floats(0.01, 0.3))
def test_band_masks_at_most_its_budget_on_the_data_it_was_fitted_to(logs, budget):
    c = RatioBandController(lower=None, upper=1.5, max_masked=budget, window=1)
    x = torch.tensor([logs], dtype=torch.float64).float()
    _, upper = c.update(x, torch.ones_like(x))
    masked = float((x.exp() > upper * (1 + 1e-6)).float().mean())
    assert masked <= budget + 1e-9


# -- LRGuard ---------------------------------------------------------------------------------------------------------


def test_lr_guard_cuts_on_a_rising_trend_and_needs_a_new_window_for_the_next_cut():
    g = LRGuard(window=4, rise=2.0, factor=0.5, patience=100)
    # log k3 rises by log 2 per step: across the window (3 steps) by 8× > 2× → one cut at the 4th update
    scales = [g.update(1e-4 * 2**i) for i in range(8)]
    assert scales == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.25]


def test_lr_guard_ignores_noise_without_trend_and_recovers_after_patience():
    g = LRGuard(window=4, rise=2.0, factor=0.5, patience=3)
    # zig-zag log k3 = (0, a, 0, a) + c with a = log 1.5: slope = cov/var = a / 5, growth across 3 steps
    # exp(3a/5) = 1.5^0.6 = 1.28 < 2: no cut (a ×4 zig-zag would give 4^0.6 = 2.3 and cut)
    assert [g.update(k) for k in (1e-4, 1.5e-4, 1e-4, 1.5e-4)] == [1.0] * 4
    g2 = LRGuard(window=2, rise=2.0, factor=0.5, patience=3)
    assert g2.update(1e-4) == 1.0 and g2.update(1e-3) == 0.5  # ×10 across the window: cut
    # then flat: three calm updates → recover to 1.0
    assert [g2.update(1e-3) for _ in range(3)] == [0.5, 0.5, 1.0]


def test_lr_guard_trend_is_the_least_squares_growth_factor():
    g = LRGuard(window=3, rise=100.0)
    for k in (1.0, math.e, math.e**2):
        g.update(k)
    assert g.trend() == pytest.approx(math.e**2)  # slope 1 per step × 2 steps


def test_lr_guard_skips_on_policy_steps_and_validates():
    g = LRGuard(window=2, rise=2.0)
    assert g.update(0.0) == 1.0 and g.update(float("nan")) == 1.0 and len(g.state_dict()["logs"]) == 0
    with pytest.raises(ValueError, match="rise"):
        LRGuard(rise=1.0)
    with pytest.raises(ValueError, match="factor"):
        LRGuard(factor=1.0)

"""Drift counts and the per-turn mismatch, with the arithmetic written out."""

from __future__ import annotations

import math

import pytest
import torch

from offpolicy.rollout.conversation import Conversation, Segment
from offpolicy.rollout.turn_drift import (
    DriftReport,
    differing_positions,
    segment_roles,
    turn_metrics,
    turn_mismatch,
    view_drift,
)


@pytest.mark.parametrize("engine, trainer, expected", [
    ([1, 2, 3], [1, 2, 3], (0, -1)),
    ([1, 2, 3], [1, 9, 3], (1, 1)),
    ([1, 2, 3], [9, 2], (2, 0)),        # position 0 differs, position 2 only the engine has
    ([], [4, 5], (2, 0)),
    ([], [], (0, -1)),
])
def test_differing_positions(engine, trainer, expected):
    assert differing_positions(engine, trainer) == expected


def test_report_metrics_are_row_means():
    report = DriftReport(["prompt", "turn1", "tool1", "turn2"], torch.tensor([[0, 1, 3, 0], [0, 0, 0, 0]]),
                         torch.tensor([[-1, 6, 0, -1], [-1, -1, -1, -1]]), torch.tensor([1, 0]))
    m = report.metrics("d")
    assert float(m["d_positions"]) == 2.0     # (4 + 0) / 2
    assert float(m["d_rows"]) == 0.5
    assert float(m["d/tool1"]) == 1.5 and float(m["d/turn1"]) == 0.5 and float(m["d/prompt"]) == 0.0


def test_roles_and_mismatched_layouts():
    a = Conversation((Segment("prompt", (1,), "p"), Segment("policy", (2,), "x", (-1.0,)), Segment("tool", (3,), "t"),
                      Segment("policy", (4,), "y", (-1.0,))))
    b = Conversation((Segment("prompt", (1,), "p"), Segment("policy", (2,), "x", (-1.0,))))
    assert segment_roles(a) == ["prompt", "turn1", "tool1", "turn2"]
    from offpolicy.rollout.conversation import trainer_view

    with pytest.raises(ValueError, match=r"conversations\[1\]"):
        view_drift([a, b], [trainer_view(a, "engine"), trainer_view(b, "engine")])
    with pytest.raises(ValueError, match="views"):
        view_drift([a], [])


def test_turn_mismatch_by_hand():
    # row 0: turn 0 at t=0,1 (r = 0, −0.5), a tool token at t=2, turn 1 at t=3 (r = 1); row 1: turn 0 only (r = 0.2),
    # then padding (turn −1, whatever the log-probs hold there)
    logp = torch.tensor([[-1.0, -2.0, 5.0, -1.0], [-0.8, 9.0, 9.0, 9.0]])
    mu = torch.tensor([[-1.0, -1.5, 0.0, -2.0], [-1.0, 0.0, 0.0, 0.0]])
    turn = torch.tensor([[0, 0, -1, 1], [0, -1, -1, -1]])
    first = torch.tensor([[True, False, False, True], [True, False, False, False]])
    out = turn_mismatch(logp, mu, turn, first, 3)
    k3 = lambda r: math.exp(r) - 1 - r  # noqa: E731
    assert out["tokens"].tolist() == [3.0, 1.0, 0.0]
    assert out["abs_logp_diff"][0].item() == pytest.approx((0 + 0.5 + 0.2) / 3)
    assert out["k3"][0].item() == pytest.approx((k3(0) + k3(-0.5) + k3(0.2)) / 3, rel=1e-5)
    assert out["k3"][1].item() == pytest.approx(k3(1.0), rel=1e-5)
    assert out["first_abs_logp_diff"][0].item() == pytest.approx((0 + 0.2) / 2)
    assert out["first_k3"][1].item() == pytest.approx(k3(1.0), rel=1e-5)
    assert all(math.isnan(out[name][2].item()) for name in ("k3", "abs_logp_diff", "first_k3"))  # no turn 3
    flat = turn_metrics(out)
    assert flat["multi_turn/turn2/k3"].item() == pytest.approx(k3(1.0), rel=1e-5)
    assert len(flat) == 5 * 3


def test_turn_mismatch_shapes_are_checked():
    with pytest.raises(ValueError, match="logp, rollout_logp, turn, first"):
        turn_mismatch(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 2, dtype=torch.long),
                      torch.zeros(2, 3, dtype=torch.bool), 1)

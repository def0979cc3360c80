"""The delight gate (arXiv 2603.20521): w_t = σ(A_t · (−log π(y_t)) / η), by hand, without μ, and its properties
(padding never counts, the weight carries no gradient, rare failures are suppressed and rare successes are not)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.delight import delight, delight_gate
from offpolicy.corrections.importance import tis
from offpolicy.losses import needs_rollout_logp, policy_loss
from offpolicy.registry import build_correction


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _batch(p, adv, mask=None, old=None):
    logp = torch.log(torch.tensor(p))
    return LogProbBatch(logp=logp, old_logp=None if old is None else torch.log(torch.tensor(old)),
                        mask=torch.ones_like(logp) if mask is None else torch.tensor(mask, dtype=torch.float32),
                        advantages=torch.tensor(adv))


def test_by_hand_without_mu():
    # p = (0.5, 0.5, 0.01, 1.0 | 0.01, 0.9, ·, ·), A = (+1 | −2) per sequence, η = 1
    # ℓ = (ln 2, ln 2, ln 100, 0 | ln 100, ln(1/0.9)); χ = A·ℓ
    b = _batch([[0.5, 0.5, 0.01, 1.0], [0.01, 0.9, 0.3, 0.3]], [1.0, -2.0], mask=[[1, 1, 1, 1], [1, 1, 0, 0]])
    assert b.rollout_logp is None
    r = delight()(b)
    ln2, ln100, l09 = math.log(2), math.log(100), -math.log(0.9)
    expected = [[sigmoid(ln2), sigmoid(ln2), sigmoid(ln100), 0.5], [sigmoid(-2 * ln100), sigmoid(-2 * l09), 0, 0]]
    torch.testing.assert_close(r.weights, torch.tensor(expected))
    assert r.weights[0, 2].item() == pytest.approx(100 / 101)  # a rare success kept ≈ whole
    assert r.weights[1, 0].item() == pytest.approx(1 / 10001)  # a rare failure suppressed
    assert r.keep.tolist() == [[True] * 4, [True, True, False, False]]
    m = {k.split("/")[1]: v.item() for k, v in r.metrics.items()}
    assert m["suppressed_frac"] == pytest.approx(2 / 6) and m["kept_frac"] == 1.0 and m["masked_frac"] == 0.0
    assert m["capped_frac"] == 0.0 and m["nonfinite_frac"] == 0.0  # a gated token is reweighted, not capped
    assert m["surprisal_mean"] == pytest.approx((2 * ln2 + 2 * ln100 + l09) / 6, rel=1e-5)
    assert m["delight_mean"] == pytest.approx((2 * ln2 + ln100 - 2 * ln100 - 2 * l09) / 6, rel=1e-5)
    assert m["weight_mean"] == pytest.approx(sum(map(sum, expected)) / 6, rel=1e-5)


def test_temperature_and_policy():
    b = _batch([[0.5]], [-1.0], old=[[0.25]])
    # policy="old" reads π_old: χ = −ln 4; η = 2: σ(−ln 4 / 2) = σ(−ln 2) = 1/3
    assert delight(temperature=2.0)(b).weights.item() == pytest.approx(1 / 3)
    # policy="current" reads π_θ: χ = −ln 2: σ(−ln 2) = 1/3 at η = 1
    assert delight(policy="current")(b).weights.item() == pytest.approx(1 / 3)
    assert delight()(b).weights.item() == pytest.approx(1 / 5)  # σ(−ln 4)
    torch.testing.assert_close(delight_gate(torch.log(torch.tensor([0.5])), torch.tensor([2.0]), 0.5),
                               torch.tensor([sigmoid(4 * math.log(2))]))


def test_undefined_tokens_are_dropped_and_bad_input_refused():
    b = _batch([[0.5, 0.5, 0.5]], [1.0], old=[[0.5, float("nan"), 0.5]])
    r = delight()(b)
    assert r.keep.tolist() == [[True, False, True]] and r.weights[0, 1].item() == 0.0
    assert r.metrics["delight/nonfinite_frac"].item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="^advantages"):
        delight()(b.replace(advantages=None))


@pytest.mark.parametrize("kw, named", [({"temperature": 0.0}, "temperature"), ({"temperature": -1.0}, "temperature"),
                                       ({"temperature": float("inf")}, "temperature"), ({"policy": "mu"}, "policy")])
def test_bad_parameters_are_refused_naming_them(kw, named):
    with pytest.raises(ValueError, match=rf"^{named}"):
        delight(**kw)


def test_needs_no_rollout_logprobs_and_builds_by_name():
    assert needs_rollout_logp(build_correction(["delight"]), "ppo") == []
    assert needs_rollout_logp(build_correction(["delight", "m2po"]), "ppo") == ["m2po"]
    assert repr(build_correction({"name": "delight", "temperature": 0.5})) == "delight(temperature=0.5, policy='old')"


def test_the_gradient_is_the_gated_objectives_and_none_flows_through_the_gate():
    # current policy: the gate reads π_θ, which carries the gradient; the weight must still be detached
    logp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_(True)
    b = LogProbBatch(logp=logp, mask=torch.ones(1, 2), advantages=torch.tensor([[1.0, -1.0]]))
    r = delight(policy="current")(b)
    assert not r.weights.requires_grad
    loss, _ = policy_loss(b, correction=r, objective="reinforce")
    (g,) = torch.autograd.grad(loss, logp)
    # −A·w·log π per token, mean over 2: ∂/∂log π = −A·w/2 with w = (σ(ln 2), σ(−ln 4)) = (2/3, 1/5)
    torch.testing.assert_close(g, torch.tensor([[-1 / 3, 0.1]]))


@st.composite
def batches(draw):
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, 10))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logp = torch.log_softmax(3 * torch.randn(b, t, 5, generator=g), -1)[..., 0]
    mask = torch.rand(b, t, generator=g) > draw(st.sampled_from([0.0, 0.4]))
    adv = torch.randn(b, generator=g) if draw(st.booleans()) else torch.randn(b, t, generator=g)
    old = (logp + 0.1 * torch.randn(b, t, generator=g)).clamp(max=0.0)  # a log-probability
    return LogProbBatch(logp=logp, old_logp=old, mask=mask, advantages=adv)


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from([0.25, 1.0, 4.0]))
def test_properties(batch, eta):
    r = delight(temperature=eta)(batch)
    valid = batch.bool_mask
    a = batch.token_advantages()
    chi = a * -batch.old_logp
    torch.testing.assert_close(r.weights[valid], torch.sigmoid(chi / eta)[valid])
    assert torch.equal(r.keep, valid) and (r.weights[~valid] == 0).all()
    assert ((r.weights >= 0) & (r.weights <= 1)).all()
    # the sign of A decides the side of ½: failures below, successes above
    assert (r.weights[valid & (a < 0)] <= 0.5).all() and (r.weights[valid & (a > 0)] >= 0.5).all()
    # μ does not enter: the same with any engine log-probs
    with_mu = delight(temperature=eta)(batch.replace(rollout_logp=batch.logp - 2.0))
    assert torch.equal(with_mu.weights, r.weights)
    # padding junk changes nothing; chained with TIS the weights multiply
    junk = batch.replace(old_logp=torch.where(valid, batch.old_logp, torch.tensor(float("nan"))))
    again = delight(temperature=eta)(junk)
    assert torch.equal(again.weights, r.weights) and torch.equal(again.keep, r.keep)
    assert all(torch.isfinite(v) for v in again.metrics.values())
    mu_batch = batch.replace(rollout_logp=batch.old_logp - 0.3)
    chained = build_correction([{"name": "delight", "temperature": eta}, "tis"])(mu_batch)
    torch.testing.assert_close(chained.weights, r.weights * tis()(mu_batch).weights)

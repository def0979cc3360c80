"""Calibrated importance sampling (arXiv 2609.32444): w_t = min(ρ_t, 1 + λ·max(1 − p_t, κ)), by hand, against TIS,
and its properties (on policy the weights are 1, padding never counts, no gradient through the weight)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.calibrated import calibrated_cap, calibrated_is
from offpolicy.corrections.importance import tis
from offpolicy.losses import policy_loss
from offpolicy.registry import build_correction

LN = math.log


def _batch(p_old, mu, mask=None, logp=None):
    old = torch.log(torch.tensor(p_old))
    return LogProbBatch(logp=old.clone() if logp is None else logp, old_logp=old, rollout_logp=torch.log(torch.tensor(mu)),
                        mask=torch.ones_like(old) if mask is None else torch.tensor(mask, dtype=torch.float32),
                        advantages=torch.ones(old.shape[0]))


def test_by_hand():
    # p_old = (0.5, 0.999, 0.1, 0.8), μ = (0.2, 0.9, 0.2, 0.4): ρ = (2.5, 1.11, 0.5, 2.0)
    # caps (λ = 1, κ = 5e-3): 1 + max(1 − p, κ) = (1.5, 1.005, 1.9, 1.2)  → w = (1.5, 1.005, 0.5, 1.2)
    r = calibrated_is()(_batch([[0.5, 0.999, 0.1, 0.8]], [[0.2, 0.9, 0.2, 0.4]]))
    torch.testing.assert_close(r.weights, torch.tensor([[1.5, 1.005, 0.5, 1.2]]))
    assert r.keep.all()
    m = {k.split("/")[1]: v.item() for k, v in r.metrics.items()}
    assert m["capped_frac"] == pytest.approx(3 / 4)  # all but the 0.5
    assert m["kept_frac"] == pytest.approx(1 / 4) and m["masked_frac"] == 0.0 and m["nonfinite_frac"] == 0.0
    assert m["cap_mean"] == pytest.approx((1.5 + 1.005 + 1.9 + 1.2) / 4)
    assert m["weight_mean"] == pytest.approx((1.5 + 1.005 + 0.5 + 1.2) / 4)
    assert m["raw_ratio_max"] == pytest.approx(2.5, rel=1e-6) and m["raw_ratio_min"] == pytest.approx(0.5, rel=1e-6)
    # λ = 2, κ = 0.1: caps 1 + 2·max(1 − p, 0.1) = (2, 1.2, 2.8, 1.4) → w = (2, 1.11, 0.5, 1.4)
    r2 = calibrated_is(lam=2.0, kappa=0.1)(_batch([[0.5, 0.999, 0.1, 0.8]], [[0.2, 0.9, 0.2, 0.4]]))
    torch.testing.assert_close(r2.weights, torch.tensor([[2.0, 0.999 / 0.9, 0.5, 1.4]]))


def test_source_total_reads_the_current_policy_for_the_ratio_and_pi_old_for_the_cap():
    # π_θ = 0.6, π_old = 0.5, μ = 0.2: total ρ = 3 (mismatch 2.5); the cap reads π_old: 1.5 either way
    b = _batch([[0.5]], [[0.2]], logp=torch.log(torch.tensor([[0.6]])))
    assert calibrated_is(source="total")(b).weights.item() == pytest.approx(1.5)
    b = _batch([[0.5]], [[0.45]], logp=torch.log(torch.tensor([[0.6]])))  # total ρ = 1.333 < 1.5: untouched
    assert calibrated_is(source="total")(b).weights.item() == pytest.approx(0.6 / 0.45, rel=1e-6)
    assert calibrated_is()(b).weights.item() == pytest.approx(0.5 / 0.45, rel=1e-6)


def test_padding_and_undefined_tokens():
    b = _batch([[0.5, 0.5, 0.5]], [[0.2, 0.2, 0.2]], mask=[[1, 1, 0]])
    old = b.old_logp.clone()
    old[0, 1] = float("nan")
    r = calibrated_is()(b.replace(old_logp=old))
    assert r.keep.tolist() == [[True, False, False]] and r.weights.tolist()[0][1:] == [0.0, 0.0]
    assert r.metrics["calibrated_is/nonfinite_frac"].item() == pytest.approx(1 / 2)
    m = {k: v.item() for k, v in r.metrics.items()}  # of the two valid tokens one capped, one dropped
    assert (m["calibrated_is/capped_frac"], m["calibrated_is/masked_frac"], m["calibrated_is/kept_frac"]) == (0.5, 0.5, 0)
    with pytest.raises(ValueError, match="rollout_logp"):
        calibrated_is()(b.replace(rollout_logp=None))


@pytest.mark.parametrize("kw, named", [({"lam": 0.0}, "lam"), ({"lam": -1.0}, "lam"), ({"lam": float("nan")}, "lam"),
                                       ({"kappa": 0.0}, "kappa"), ({"kappa": 1.5}, "kappa"),
                                       ({"source": "bypass"}, "source"), ({"lam": "1"}, "lam")])
def test_bad_parameters_are_refused_naming_them(kw, named):
    with pytest.raises(ValueError, match=rf"^{named}"):
        calibrated_is(**kw)


def test_by_name_and_the_cap_function():
    assert repr(build_correction({"name": "calibrated_is", "lam": 0.5})) == repr(calibrated_is(lam=0.5))
    torch.testing.assert_close(calibrated_cap(torch.tensor([0.0, 0.9975, 1.0]), lam=2.0, kappa=0.01),
                               torch.tensor([3.0, 1.02, 1.02]))


def test_the_weight_carries_no_gradient_and_scales_the_ppo_gradient():
    logp = torch.log(torch.tensor([[0.5, 0.8]])).requires_grad_(True)
    b = _batch([[0.5, 0.8]], [[0.2, 0.79]], logp=logp)
    r = calibrated_is()(b)
    assert not r.weights.requires_grad
    loss, _ = policy_loss(b, correction=r)
    (g,) = torch.autograd.grad(loss, logp)
    # r = π_θ/π_old = 1: d(−r·A·w)/dlogp = −w / 2 per token; w = (1.5, 0.8/0.79)
    torch.testing.assert_close(g, torch.tensor([[-0.75, -0.5 * 0.8 / 0.79]]))


@st.composite
def batches(draw):
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, 10))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    old = torch.log_softmax(3 * torch.randn(b, t, 5, generator=g), -1)[..., 0]
    mu = old + draw(st.sampled_from([0.0, 0.1, 1.0])) * torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) > draw(st.sampled_from([0.0, 0.4]))
    return LogProbBatch(logp=old.clone(), old_logp=old, rollout_logp=mu, mask=mask, advantages=torch.randn(b, generator=g))


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from([0.5, 1.0, 3.0]), st.sampled_from([5e-3, 0.1, 1.0]))
def test_properties(batch, lam, kappa):
    r = calibrated_is(lam=lam, kappa=kappa)(batch)
    valid = batch.bool_mask
    rho = torch.exp(batch.old_logp - batch.rollout_logp)
    cap = 1 + lam * (1 - batch.old_logp.exp()).clamp(min=kappa)
    # the formula on every valid token; padding 0 and not kept
    torch.testing.assert_close(r.weights[valid], torch.minimum(rho, cap)[valid])
    assert torch.equal(r.keep, valid) and (r.weights[~valid] == 0).all()
    # never above TIS at the loosest cap 1 + λ, and equal to it where the cap is loose enough
    t = tis(upper=1 + lam)(batch)
    assert (r.weights <= t.weights + 1e-6).all()
    # on policy every weight is 1 (the cap is ≥ 1 + λκ > 1)
    on = calibrated_is(lam=lam, kappa=kappa)(batch.replace(rollout_logp=batch.old_logp.clone()))
    assert torch.equal(on.weights, valid.float()) and on.metrics["calibrated_is/kept_frac"].item() == 1.0
    # what padding holds does not matter
    junk = batch.replace(rollout_logp=torch.where(valid, batch.rollout_logp, torch.tensor(float("nan"))),
                         old_logp=torch.where(valid, batch.old_logp, torch.tensor(float("inf"))))
    again = calibrated_is(lam=lam, kappa=kappa)(junk)
    assert torch.equal(again.weights, r.weights) and torch.equal(again.keep, r.keep)
    assert all(torch.isfinite(v) for v in again.metrics.values())

"""DPPO-TV and DPPO-KL (arXiv 2602.04879): a trust region on the binary divergence of the sampled token, by hand and
against verl 0.9's ``dppo_tv`` / ``dppo_kl`` losses."""

from __future__ import annotations

import math

import pytest
import torch

from offpolicy.batch import LogProbBatch
from offpolicy.losses import policy_loss
from offpolicy.objectives.dppo import binary_kl


def _batch(p, p_old, advantages):
    """Probabilities of the sampled tokens under π_θ (``p``) and π_old (``p_old``)."""
    logp = torch.tensor([[math.log(x) for x in p]], requires_grad=True)
    return LogProbBatch(logp=logp, mask=torch.ones(1, len(p)), old_logp=torch.tensor([[math.log(x) for x in p_old]]),
                        advantages=torch.tensor([advantages])), logp


def test_dppo_tv_by_hand():
    # p − p_old = (0.2, −0.2, 0.05, 0.3); A = (1, −1, −1, −1); δ = 0.15 both sides
    b, logp = _batch([0.6, 0.2, 0.5, 0.9], [0.4, 0.4, 0.45, 0.6], [1.0, -1.0, -1.0, -1.0])
    loss, m = policy_loss(b, objective={"name": "dppo_tv", "delta_low": 0.15})
    # t0: A > 0 and 0.2 > 0.15 → masked; t1: A < 0 and −0.2 < −0.15 → masked; t2: A < 0 and 0.05 ≥ −0.15 → kept;
    # t3: A < 0 and 0.3 ≥ −0.15 → kept (only a move in the direction the advantage pushes is bounded, as in PPO)
    # L = −A·sg(r)·log p: t2: r = 0.5/0.45, L = 1.111111·log 0.5 = −0.770164; t3: r = 1.5, L = 1.5·log 0.9 = −0.158040
    want = (0.5 / 0.45 * math.log(0.5) + 1.5 * math.log(0.9)) / 4
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert m["loss/clipfrac_high"].item() == 0.25 and m["loss/clipfrac_low"].item() == 0.25
    # gradient −A·r/4 on kept tokens, 0 on masked ones
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.tensor([[0.0, 0.0, 0.5 / 0.45 / 4, 1.5 / 4]]))


def test_binary_kl_by_hand():
    # KL((0.25, 0.75) ‖ (0.5, 0.5)) = 0.25·log(0.25/0.5) + 0.75·log(0.75/0.5) = −0.173287 + 0.304099 = 0.130812
    assert binary_kl(torch.tensor(0.5).log(), torch.tensor(0.25).log()).item() == pytest.approx(0.130812, abs=1e-6)


def test_dppo_kl_by_hand():
    # p_old = 0.25 everywhere; p = (0.5, 0.1, 0.5); A = (1, 1, −1); δ = 0.05
    # t0: KL = 0.130812 > 0.05 and p > p_old with A > 0 → masked
    # t1: p < p_old: an A > 0 update moving back into the region is kept whatever the KL
    # t2: A < 0 and p ≥ p_old → kept
    b, logp = _batch([0.5, 0.1, 0.5], [0.25, 0.25, 0.25], [1.0, 1.0, -1.0])
    loss, m = policy_loss(b, objective="dppo_kl")
    want = (-1 * 0.4 * math.log(0.1) + 1 * 2.0 * math.log(0.5)) / 3  # −A·r·log p: r = 0.4 and 2
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert m["loss/clipfrac_high"].item() == pytest.approx(1 / 3) and m["loss/clipfrac_low"].item() == 0.0


def test_the_ratio_cap_truncates_the_weight_and_is_counted():
    b, logp = _batch([0.5], [0.4], [-1.0])  # r = 1.25 > cap 1.1; A < 0 with p − p_old = 0.1 ≥ −0.15 → kept
    loss, m = policy_loss(b, objective={"name": "dppo_tv", "ratio_cap": 1.1})
    assert loss.item() == pytest.approx(1.1 * math.log(0.5), rel=1e-6)  # −A·1.1·log 0.5
    assert m["loss/ratio_capped_frac"].item() == 1.0


@pytest.mark.parametrize("loss_mode", ["dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("low, high, cap", [(0.15, 0.15, 1e4), (0.05, 0.2, 3.0)])
def test_dppo_equals_verls(loss_mode, low, high, cap, verl_policy_loss, random_batch):
    b = random_batch(seed=5, b=4, t=9, scale=0.6)
    logp = b.logp.clone().requires_grad_(True)
    objective = {"name": loss_mode, "delta_low": low, "delta_high": high, "ratio_cap": cap}
    ours, m = policy_loss(b.replace(logp=logp), objective=objective)
    logp_verl = b.logp.clone().requires_grad_(True)
    theirs, verl_metrics = verl_policy_loss(loss_mode, b.old_logp, logp_verl, b.token_advantages(), b.mask,
                                            clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=cap)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp_verl)[0],
                               rtol=1e-6, atol=1e-7)
    masked = (m["loss/clipfrac_low"] + m["loss/clipfrac_high"]).item()
    assert 0 < masked < 1 and masked == pytest.approx(verl_metrics["actor/pg_clipfrac"])

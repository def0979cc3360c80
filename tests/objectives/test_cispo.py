"""CISPO (MiniMax-M1, arXiv 2506.13585 §3.1): the clipped importance weight times the score function, by hand and
against verl 0.9's ``cispo`` loss. TRL 1.16's ``loss_type="cispo"`` is compared end to end in tests/integrations."""

from __future__ import annotations

import math

import pytest
import torch

from offpolicy.batch import LogProbBatch
from offpolicy.losses import policy_loss


def _batch(ratios, advantages):
    """log π_θ = −1 everywhere and π_old chosen so that r = π_θ/π_old equals ``ratios``."""
    logp = torch.full((1, len(ratios)), -1.0, requires_grad=True)
    old = torch.tensor([[-1.0 - math.log(r) for r in ratios]])
    return LogProbBatch(logp=logp, mask=torch.ones(1, len(ratios)), old_logp=old,
                        advantages=torch.tensor([advantages])), logp


def test_cispo_by_hand():
    b, logp = _batch([1.5, 0.5, 1.1], [1.0, -1.0, 1.0])
    loss, m = policy_loss(b, objective="cispo", clip_low=0.2, clip_high=0.2)
    # weights sg(clip(r, 0.8, 1.2)) = (1.2, 0.8, 1.1); L_t = −w·A·log π = −w·A·(−1) = w·A
    # = (1.2, −0.8, 1.1) → token mean (1.2 − 0.8 + 1.1) / 3 = 0.5
    assert loss.item() == pytest.approx(0.5, abs=1e-6)
    # gradient −w·A/3 on every token, clipped or not (CISPO keeps the gradient of a clipped token):
    # (−1.2·1, −0.8·(−1), −1.1·1) / 3 = (−0.4, 0.2667, −0.3667)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[-0.4, 0.8 / 3, -1.1 / 3]]))
    assert m["loss/clipfrac_high"].item() == pytest.approx(1 / 3)  # r = 1.5 moved down to 1.2
    assert m["loss/clipfrac_low"].item() == pytest.approx(1 / 3)  # r = 0.5 moved up to 0.8
    assert m["loss/ratio_max"].item() == pytest.approx(1.5, rel=1e-6)


def test_cispo_as_trl_and_minimax_run_it_has_no_lower_bound():
    # TRL: w = min(r, epsilon_high), here epsilon_high = 1.3 → clip_low = 1 (1 − 1 = 0 ≤ r), clip_high = 0.3
    b, logp = _batch([2.0, 0.1], [1.0, 1.0])
    loss, m = policy_loss(b, objective="cispo", clip_low=1.0, clip_high=0.3)
    # w = (min(2, 1.3), 0.1) = (1.3, 0.1); L = w·A → mean (1.3 + 0.1) / 2 = 0.7
    assert loss.item() == pytest.approx(0.7, abs=1e-6)
    assert m["loss/clipfrac_low"].item() == 0.0 and m["loss/clipfrac_high"].item() == 0.5


def test_cispo_on_policy_is_reinforce():
    b, logp = _batch([1.0, 1.0, 1.0], [1.0, -2.0, 0.5])
    g_cispo = torch.autograd.grad(policy_loss(b, objective="cispo")[0], logp)[0]
    g_reinforce = torch.autograd.grad(policy_loss(b, objective="reinforce")[0], logp)[0]
    torch.testing.assert_close(g_cispo, g_reinforce)


@pytest.mark.parametrize("low, high", [(0.2, 0.2), (0.2, 0.28), (1.0, 4.0)])
def test_cispo_equals_verls(low, high, verl_policy_loss, random_batch):
    b = random_batch(seed=3, b=4, t=9, scale=0.5)
    adv = b.token_advantages()
    logp = b.logp.clone().requires_grad_(True)
    ours, m = policy_loss(b.replace(logp=logp), objective="cispo", clip_low=low, clip_high=high)
    (g_ours,) = torch.autograd.grad(ours, logp)
    logp_verl = b.logp.clone().requires_grad_(True)
    theirs, verl_metrics = verl_policy_loss("cispo", b.old_logp, logp_verl, adv, b.mask, clip_ratio_low=low,
                                            clip_ratio_high=high)
    (g_theirs,) = torch.autograd.grad(theirs, logp_verl)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-6, atol=1e-7)
    # verl's pg_clipfrac: the fraction of valid tokens whose ratio the clip changed
    assert (m["loss/clipfrac_low"] + m["loss/clipfrac_high"]).item() == pytest.approx(verl_metrics["actor/pg_clipfrac"])

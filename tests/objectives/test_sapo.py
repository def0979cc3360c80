"""SAPO (arXiv 2511.20347): a sigmoid gate on the ratio, by hand and against verl 0.9's ``sapo`` loss. TRL 1.16's
``loss_type="sapo"`` is compared end to end in tests/integrations."""

from __future__ import annotations

import math

import pytest
import torch

from offpolicy.batch import LogProbBatch
from offpolicy.losses import policy_loss


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_sapo_by_hand():
    ratios, adv = [1.0, 2.0, 0.5], [1.0, 1.0, -1.0]
    logp = torch.full((1, 3), -1.0, requires_grad=True)
    b = LogProbBatch(logp=logp, mask=torch.ones(1, 3), old_logp=torch.tensor([[-1.0 - math.log(r) for r in ratios]]),
                     advantages=torch.tensor([adv]))
    loss, m = policy_loss(b, objective={"name": "sapo", "tau_pos": 1.0, "tau_neg": 2.0})
    # f_τ(r) = (4/τ)·σ(τ(r − 1)); A > 0 → τ = 1, A < 0 → τ = 2:
    # t0: 4·σ(0) = 2;  t1: 4·σ(1) = 2.924234;  t2: 2·σ(−1) = 0.537883
    # L = −f·A = (−2, −2.924234, +0.537883) → mean −1.462117
    f = [4 * _sigmoid(0.0), 4 * _sigmoid(1.0), 2 * _sigmoid(2 * (0.5 - 1))]
    want = (-f[0] - f[1] + f[2]) / 3
    assert loss.item() == pytest.approx(want, rel=1e-6)
    # d/dlog π of −f(r)·A = −A·4σ(τ(r−1))(1 − σ(τ(r−1)))·r, then / 3
    def dgate(r, tau):
        s = _sigmoid(tau * (r - 1))
        return 4 * s * (1 - s) * r
    want_grad = [-1 * dgate(1.0, 1.0) / 3, -1 * dgate(2.0, 1.0) / 3, 1 * dgate(0.5, 2.0) / 3]
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.tensor([want_grad]))
    assert m["loss/clipfrac_low"].item() == m["loss/clipfrac_high"].item() == 0.0  # nothing is clipped


def test_sapo_on_policy_gradient_is_reinforces(random_batch):
    b = random_batch(seed=1, b=3, t=5)
    b = b.replace(old_logp=b.logp.clone())  # r = 1: the gate's slope is 1 for every τ
    logp = b.logp.clone().requires_grad_(True)
    g_sapo = torch.autograd.grad(policy_loss(b.replace(logp=logp), objective="sapo")[0], logp)[0]
    g_reinforce = torch.autograd.grad(policy_loss(b.replace(logp=logp), objective="reinforce")[0], logp)[0]
    torch.testing.assert_close(g_sapo, g_reinforce)


@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (0.5, 3.0)])
def test_sapo_equals_verls(tau_pos, tau_neg, verl_policy_loss, random_batch):
    b = random_batch(seed=4, b=4, t=9, scale=0.5)
    logp = b.logp.clone().requires_grad_(True)
    # verl aggregates SAPO with seq-mean-token-mean whatever loss_agg_mode says
    ours, _ = policy_loss(b.replace(logp=logp), objective={"name": "sapo", "tau_pos": tau_pos, "tau_neg": tau_neg},
                          aggregation="seq_mean_token_mean")
    logp_verl = b.logp.clone().requires_grad_(True)
    theirs, _ = verl_policy_loss("sapo", b.old_logp, logp_verl, b.token_advantages(), b.mask, tau_pos=tau_pos,
                                 tau_neg=tau_neg)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp_verl)[0],
                               rtol=1e-5, atol=1e-7)

"""IPO (prime-rl ``ipo_loss_fn``, commit 559b447): by hand, against a transcription of prime-rl's per-sample loss,
and its properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.batch import LogProbBatch
from offpolicy.losses import policy_loss


def _batch(p, p_mu, advantages):
    logp = torch.tensor([[math.log(x) for x in p]], requires_grad=True)
    return LogProbBatch(logp=logp, mask=torch.ones(1, len(p)), rollout_logp=torch.tensor([[math.log(x) for x in p_mu]]),
                        advantages=torch.tensor([advantages])), logp


def test_by_hand():
    # p = (0.5, 0.9, 0.2, 0.3), p_μ = (0.42, 0.5, 0.6, 0.3), A = (1, 1, −1, −1), δ = 0.1, τ_kl = 0.01
    # |p − p_μ| = (0.08, 0.4, 0.4, 0): masked = (no, yes, yes, no) — the third whatever A's sign (DPPO-TV would keep
    # an A < 0 token whose probability fell; IPO does not)
    # r = (1.190476, 1.8, 1/3, 1), log r = (0.174353, 0.587787, −1.098612, 0)
    # L = (−1.190476 + 0.01·0.030399, 0.01·0.345493, 0.01·1.206949, 1 + 0) → mean
    b, logp = _batch([0.5, 0.9, 0.2, 0.3], [0.42, 0.5, 0.6, 0.3], [1.0, 1.0, -1.0, -1.0])
    loss, m = policy_loss(b, objective={"name": "ipo", "kl_tau": 0.01})
    lr = [math.log(0.5 / 0.42), math.log(1.8), math.log(1 / 3), 0.0]
    want = (-0.5 / 0.42 + 1.0 + 0.01 * sum(x * x for x in lr)) / 4
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert m["loss/ipo_masked"].item() == 0.5
    # gradient per token: −A·r·1[kept] + 2 τ log r, over 4 tokens
    grad = [(-0.5 / 0.42 + 0.02 * lr[0]) / 4, 0.02 * lr[1] / 4, 0.02 * lr[2] / 4, (1.0 + 0.0) / 4]
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.tensor([grad]))


def prime_rl_ipo(trainer_logprobs, inference_logprobs, advantages, loss_mask, ipo_threshold, adv_tau, kl_tau):
    """prime-rl's ``ipo_loss_fn`` (src/prime_rl/trainer/rl/loss.py @ 559b447) for one packed sample, transcribed:
    the summed per-token loss; ``compute_loss`` divides by the token count."""
    log_importance_ratio = trainer_logprobs - inference_logprobs
    importance_ratio = torch.exp(log_importance_ratio)
    abs_probs_diff = torch.abs(torch.exp(trainer_logprobs) - torch.exp(inference_logprobs))
    is_masked = abs_probs_diff > ipo_threshold
    keep_mask = loss_mask & ~is_masked
    pg_loss = keep_mask * (adv_tau * advantages) * importance_ratio
    kl_loss = loss_mask * log_importance_ratio**2
    return (-pg_loss + kl_tau * kl_loss).sum()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), delta=st.sampled_from([0.05, 0.1, 0.3]), kl_tau=st.sampled_from([0.0, 1e-3, 0.1]),
       adv_tau=st.sampled_from([1.0, 0.5]))
def test_matches_prime_rl(seed, delta, kl_tau, adv_tau):
    g = torch.Generator().manual_seed(seed)
    b, t = 3, 6
    logp = torch.log(torch.rand(b, t, generator=g).clamp(min=1e-3))
    mu = torch.log(torch.rand(b, t, generator=g).clamp(min=1e-3))
    mask = torch.rand(b, t, generator=g) > 0.3
    adv = torch.randn(b, generator=g)
    ours_logp = logp.clone().requires_grad_(True)
    batch = LogProbBatch(logp=ours_logp, mask=mask, rollout_logp=mu, advantages=adv)
    loss, _ = policy_loss(batch, objective={"name": "ipo", "threshold": delta, "kl_tau": kl_tau, "adv_tau": adv_tau})
    theirs_logp = logp.clone().requires_grad_(True)
    total = sum(prime_rl_ipo(theirs_logp[i], mu[i], adv[i].expand(t), mask[i], delta, adv_tau, kl_tau) for i in range(b))
    theirs = total / mask.sum().clamp(min=1)
    torch.testing.assert_close(loss, theirs, rtol=1e-5, atol=1e-6)
    ours_grad = torch.autograd.grad(loss, ours_logp)[0]
    theirs_grad = torch.autograd.grad(theirs, theirs_logp)[0] if mask.any() else torch.zeros_like(logp)
    torch.testing.assert_close(ours_grad, theirs_grad * mask, rtol=1e-5, atol=1e-6)


def test_on_policy_is_plain_policy_gradient_and_padding_is_ignored():
    # μ = π_θ: r = 1, nothing masked, no penalty: L = −mean A, gradient −A/N on valid tokens, 0 on padding
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.7]])).requires_grad_(True)
    mu = torch.where(torch.tensor([[True, True, False]]), logp.detach(), torch.tensor(float("nan")))
    b = LogProbBatch(logp=logp, mask=torch.tensor([[1, 1, 0]]), rollout_logp=mu, advantages=torch.tensor([2.0]))
    loss, m = policy_loss(b, objective="ipo")
    assert loss.item() == pytest.approx(-2.0)
    assert m["loss/ipo_masked"].item() == 0.0
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.tensor([[-1.0, -1.0, 0.0]]))


def test_errors():
    b, _ = _batch([0.5], [0.4], [1.0])
    with pytest.raises(ValueError, match="threshold"):
        policy_loss(b, objective={"name": "ipo", "threshold": -0.1})
    with pytest.raises(ValueError, match="kl_tau"):
        policy_loss(b, objective={"name": "ipo", "kl_tau": float("nan")})
    with pytest.raises(ValueError, match="rollout_logp"):
        policy_loss(LogProbBatch(logp=torch.zeros(1, 1), mask=torch.ones(1, 1), advantages=torch.ones(1)),
                    objective="ipo")


def test_reachable_by_name_from_trl():
    # TRL's sampling_per_token_logps (vLLM) is μ, which IPO's ratio reads
    from offpolicy.integrations.trl import trl_policy_loss

    lp = torch.log(torch.tensor([[0.5, 0.9]])).requires_grad_(True)
    inputs = {"completion_mask": torch.ones(1, 2), "advantages": torch.tensor([1.0]),
              "sampling_per_token_logps": torch.log(torch.tensor([[0.45, 0.5]]))}
    loss, m = trl_policy_loss(lp, inputs, objective={"name": "ipo", "kl_tau": 0.0}, aggregation="token_mean")
    assert loss.item() == pytest.approx(-0.5 / 0.45 / 2, rel=1e-6)  # the second token is masked (|0.9 − 0.5| > 0.1)
    assert m["loss/ipo_masked"].item() == 0.5

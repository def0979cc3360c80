"""policy_loss against a textbook reference written independently here, value and gradient.

The reference is the loss written the obvious way — torch.where for invalid tokens, min of the unclipped and clipped
products, dual clip as min(L, c·|A|), the ±20 log-ratio clamp — and differentiated by autograd. policy_loss (the
registered objectives, the cleaning of the inputs, the correction coefficient and the aggregations) must agree with it
on value and gradient for every PPO-family objective, level, aggregation, dual clip, correction weights and
non-finite inputs.
At ``sequence``/``geometric`` level the textbook form is GSPO-token's, log r_t = sg[log s_i] + lp_t − sg[lp_t]: its
value is the sequence ratio and its gradient the per-token policy gradient s_i·∇log π_t (a finite difference of the
value would instead see all of the sequence's tokens move s_i).
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import CorrectionResult
from offpolicy.losses import policy_loss
from offpolicy.registry import AGGREGATIONS

BOUND = 20.0


def reference_loss(logp, old, rollout, mask, adv, coef, objective, level, eps_low, eps_high, dual, aggregation, t_max):
    """The textbook per-token loss, aggregated; every step differentiable by autograd."""
    adv_t = adv[:, None].expand_as(logp)
    finite = torch.isfinite(logp) & torch.isfinite(adv_t)
    # only the log-probs the objective reads: π_old for the ratio objectives, μ for bypass / decoupled without weights
    used = [old] if objective in ("ppo", "gspo", "decoupled") else []
    if objective == "bypass" or (objective == "decoupled" and coef is None):
        used.append(rollout)
    for x in used:
        if x is not None:
            finite = finite & torch.isfinite(x)
    valid = mask & finite
    zero = torch.zeros_like(logp)
    lp = torch.where(valid, logp, zero)
    a = torch.where(valid, adv_t, zero)
    if objective == "reinforce":
        per_token = -a * lp
    else:
        den = rollout if objective == "bypass" else old
        den = lp.detach() if den is None else torch.where(valid, den, zero)
        log_r = torch.where(valid, lp - den, zero)
        if level != "token":
            seq = log_r.detach().sum(-1, keepdim=True)
            if level == "geometric":
                seq = seq / valid.sum(-1, keepdim=True).clamp(min=1)
            # GSPO-token: value exactly seq, gradient per token; the ±20 clamp below then bounds it like a token ratio
            log_r = torch.where(valid, seq + (lp - lp.detach()), zero)
        r = torch.exp(log_r.clamp(-BOUND, BOUND))
        per_token = -torch.minimum(r * a, r.clamp(1 - eps_low, 1 + eps_high) * a)
        if dual is not None:
            per_token = torch.where(a < 0, torch.minimum(per_token, dual * a.abs()), per_token)
    if coef is not None:
        per_token = per_token * coef
    elif objective == "decoupled":
        w = torch.where(valid, old - rollout, zero).clamp(-BOUND, BOUND)
        per_token = per_token * torch.exp(w)
    m = mask.float()
    if aggregation == "token_mean":
        return per_token.sum() / m.sum().clamp(min=1)
    if aggregation == "seq_mean_token_mean":
        tokens = m.sum(-1)
        return (per_token.sum(-1) / tokens.clamp(min=1)).sum() / (tokens > 0).sum().clamp(min=1)
    if aggregation == "token_sum":
        return per_token.sum()
    return per_token.sum() / (logp.shape[0] * t_max)


@st.composite
def cases(draw):
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 7))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    spread = draw(st.sampled_from([0.05, 0.5, 3.0, 30.0]))  # 30: log-ratios beyond the ±20 clamp
    logp = old + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    rollout = old + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.8
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    adv[torch.rand(B, generator=g) < 0.2] = 0.0
    if draw(st.booleans()):  # non-finite values, at valid and padded positions
        for x in (logp, old, rollout):
            x[torch.rand(B, T, generator=g) < 0.1] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    coef = None
    if draw(st.booleans()):
        coef = torch.rand(B, T, generator=g, dtype=torch.float64) * 2 * (torch.rand(B, T, generator=g) < 0.8)
    objective = draw(st.sampled_from(["ppo", "decoupled", "bypass", "gspo", "reinforce"]))
    level = "token" if objective == "reinforce" else draw(st.sampled_from(["token", "sequence", "geometric"]))
    if objective == "gspo":
        level = "geometric"
    no_old = objective in ("ppo", "gspo", "reinforce") and draw(st.booleans())
    return dict(
        logp=logp, old=None if no_old else old, rollout=rollout, mask=mask, adv=adv, coef=coef, objective=objective,
        level=level, eps_low=draw(st.sampled_from([0.1, 0.2, 0.5])), eps_high=draw(st.sampled_from([0.2, 0.28, 3.0])),
        dual=None if objective == "reinforce" else draw(st.sampled_from([None, 3.0, 10.0])),
        aggregation=draw(st.sampled_from(AGGREGATIONS.names())), t_max=T + draw(st.integers(0, 3)),
    )


def run_policy_loss(c):
    logp = c["logp"].float().requires_grad_(True)
    cast = lambda x: None if x is None else x.float()  # noqa: E731
    # non-finite μ on purpose (it must never reach the loss): the batch-level limit off
    batch = LogProbBatch(logp=logp, mask=c["mask"], old_logp=cast(c["old"]), rollout_logp=cast(c["rollout"]),
                         max_nonfinite_rollout=None,
                         advantages=c["adv"].float())
    correction = None
    if c["coef"] is not None:
        correction = CorrectionResult(c["coef"].float(), c["coef"] > 0)
    clipping = {} if c["objective"] == "reinforce" else dict(  # reinforce has no ratio to clip or aggregate
        level=c["level"], clip_low=c["eps_low"], clip_high=c["eps_high"], dual_clip=c["dual"])
    loss, _ = policy_loss(batch, correction=correction, objective=c["objective"], aggregation=c["aggregation"],
                          max_tokens=c["t_max"], **clipping)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, grad


@settings(max_examples=300, deadline=None)
@given(cases())
def test_policy_loss_equals_the_textbook_loss_and_its_gradient(c):
    loss, grad = run_policy_loss(c)
    logp = c["logp"].float().requires_grad_(True)
    f32 = lambda x: None if x is None else x.float()  # noqa: E731
    ref = reference_loss(logp, f32(c["old"]), f32(c["rollout"]), c["mask"], c["adv"].float(),
                         None if c["coef"] is None else (c["coef"] * (c["coef"] > 0)).float(), c["objective"],
                         c["level"], c["eps_low"], c["eps_high"], c["dual"], c["aggregation"], c["t_max"])
    (ref_grad,) = torch.autograd.grad(ref, logp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)


def test_gradient_keeps_the_dtype_of_logp_and_scales_with_the_upstream_gradient():
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16, requires_grad=True)
    b = LogProbBatch(logp=logp, mask=torch.ones(1, 2), old_logp=torch.tensor([[-1.1, -2.0]]), advantages=torch.tensor([1.0]))
    loss, _ = policy_loss(b)
    (3.0 * loss).backward()
    assert logp.grad.dtype == torch.bfloat16
    # r = (e^0.1 ≈ 1.105 ≤ 1.2: unclipped, 1): dL/dlp = −A·r/2 → ×3 = (−1.658, −1.5)
    torch.testing.assert_close(logp.grad.float(), torch.tensor([[-1.5 * math.exp(0.1), -1.5]]), rtol=1e-2, atol=0)


def test_no_grad_input_gives_a_plain_tensor():
    b = LogProbBatch(logp=torch.zeros(1, 2), mask=torch.ones(1, 2), advantages=torch.tensor([1.0]))
    loss, _ = policy_loss(b)
    assert not loss.requires_grad and loss.item() == -1.0  # r = 1 on both tokens: L = −A·1

"""Every hot-path function compiles with ``torch.compile(fullgraph=True)`` (no graph break: no .item(), no Python
branch on tensor values, no host sync) and gives the same numbers as eager."""

from __future__ import annotations

import pytest
import torch

from offpolicy.advantages import dr_grpo_advantages, grpo_advantages, rloo_advantages
from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import chain
from offpolicy.corrections.importance import icepop, importance_weights, mis, tis
from offpolicy.corrections.sequence_masks import opsm, opsm_mask, token_veto, veto
from offpolicy.corrections.trust_region import ln_trm, ln_trm_mask, ser, ser_mask, trm, trust_region_mask
from offpolicy.losses import policy_loss
from offpolicy.metrics import offpolicy_metrics
from offpolicy.ratios import aggregate_log_ratio
from offpolicy.registry import OBJECTIVES


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="eager")


def make_inputs(seed: int = 0, B: int = 4, T: int = 7):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g) * 3
    old = logp + 0.05 * torch.randn(B, T, generator=g)
    rollout = old + 0.3 * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[-1] = False  # one empty sequence
    adv = torch.randn(B, generator=g)
    logp[0, 1] = float("nan")  # a non-finite valid token (if mask[0, 1]) and junk padding
    rollout[~mask] = float("inf")
    return logp, old, rollout, mask, adv


def assert_same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        torch.testing.assert_close(a, b, equal_nan=True)


def forward_backward(fn, logp0, old, rollout, mask, adv):
    """(loss, metrics, ∂loss/∂logp) of ``fn`` on a fresh leaf copy of ``logp0``: the eager/compiled comparison."""
    logp = logp0.clone().requires_grad_(True)
    loss, metrics = fn(logp, old, rollout, mask, adv)
    loss.backward()
    return loss.detach(), metrics, logp.grad


@pytest.mark.parametrize("objective", OBJECTIVES.names())
def test_policy_loss_with_correction_chain(objective):
    logp0, old, rollout, mask, adv = make_inputs()
    correction = chain(tis(upper=2.0), icepop(), opsm(delta=0.1), trm())

    def step(logp, old, rollout, mask, adv):
        b = LogProbBatch(logp=logp, mask=mask, old_logp=old, rollout_logp=rollout, advantages=adv)
        clip = {"clip_high": 0.28} if "clip_high" in OBJECTIVES[objective].parameters() else {}
        loss, metrics = policy_loss(b, correction=correction, objective=objective, aggregation="seq_mean_token_mean", **clip)
        return loss, metrics

    args = (logp0, old, rollout, mask, adv)
    assert_same(forward_backward(step, *args), forward_backward(compiled(step), *args))


def test_importance_weights_all_levels_and_modes():
    logp, old, rollout, mask, _ = make_inputs(1)

    def fn(lr, mask):
        out = []
        for level in ("token", "sequence", "geometric"):
            out.append(importance_weights(lr, mask, level=level, mode="truncate", upper=2.0, normalize=True))
            out.append(importance_weights(lr, mask, level=level, mode="mask", lower=0.5, upper=2.0))
        return out

    lr = old - rollout
    assert_same(fn(lr, mask), compiled(fn)(lr, mask))


def test_masks():
    logp, old, rollout, mask, adv = make_inputs(2)

    def fn(logp, old, rollout, mask, adv):
        lr = old - rollout
        return (
            opsm_mask(logp, rollout, mask, adv, delta=0.1),
            trust_region_mask(0.5 * lr * lr, mask, max_kl=0.05, avg_kl=0.01),
            token_veto(lr, mask, threshold=0.5),
        )

    assert_same(fn(logp, old, rollout, mask, adv), compiled(fn)(logp, old, rollout, mask, adv))


def test_offpolicy_metrics():
    logp, old, rollout, mask, _ = make_inputs(3)
    weights = torch.rand(logp.shape)

    def fn(a, b, m, w):
        return offpolicy_metrics(a, b, m), offpolicy_metrics(a, b, m, w, level="geometric")

    assert_same(fn(old, rollout, mask, weights), compiled(fn)(old, rollout, mask, weights))


def test_aggregate_log_ratio():
    _, old, rollout, mask, _ = make_inputs(4)

    def fn(lr, m):
        return [aggregate_log_ratio(lr, m, level) for level in ("token", "sequence", "geometric")]

    lr = old - rollout
    assert_same(fn(lr, mask), compiled(fn)(lr, mask))


def test_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, -1.0])

    def fn(r):
        return grpo_advantages(r, 3), dr_grpo_advantages(r, 2), rloo_advantages(r, 3)

    assert_same(fn(rewards), compiled(fn)(rewards))


@pytest.mark.parametrize("pass_result", [False, True])
def test_full_offpolicy_chain_of_every_correction(pass_result):
    """The benchmark's path: tis + geometric mis + icepop + opsm + veto + trm, metrics and the loss in one graph, with
    the same numbers and the same bool ``keep`` as eager."""
    logp0, old, rollout, mask, adv = make_inputs(5)
    correction = chain(tis(upper=2.0), mis(level="geometric", lower=0.5, upper=2.0), icepop(), opsm(delta=0.1), veto(), trm())

    def step(logp, old, rollout, mask, adv):
        b = LogProbBatch(logp=logp, mask=mask, old_logp=old, rollout_logp=rollout, advantages=adv)
        result = correction(b)
        metrics = offpolicy_metrics(old, rollout, mask, result if pass_result else result.coefficient)
        loss, lm = policy_loss(b, correction=result, dual_clip=3.0)
        return loss, {**metrics, **lm, "keep": result.keep.float().sum()}

    args = (logp0, old, rollout, mask, adv)
    assert_same(forward_backward(step, *args), forward_backward(compiled(step), *args))


def test_length_neutral_masks():
    """LN-TRM and SER masks (arXiv 2512.23075 App. F) on a batch with a NaN valid token and junk padding."""
    _, old, rollout, mask, _ = make_inputs(6)

    def fn(lr, m):
        return ln_trm_mask(lr, m, eps=5e-3, delta=1e-4, threshold=0.05), ser_mask(lr, m, threshold=0.05)

    lr = old - rollout
    lr[0, 2] = float("nan")
    assert_same(fn(lr, mask), compiled(fn)(lr, mask))


@pytest.mark.parametrize("source", ["mismatch", "total"])
def test_length_neutral_presets_in_a_chain(source):
    """ln_trm / ser presets chained with tis, on either source, in one graph."""
    logp, old, rollout, mask, adv = make_inputs(7)
    correction = chain(ln_trm(source=source), ser(threshold=0.2, source=source), tis(upper=2.0, source=source))

    def fn(logp, old, rollout, mask, adv):
        b = LogProbBatch(logp=logp, mask=mask, old_logp=old, rollout_logp=rollout, advantages=adv)
        r = correction(b)
        return r.weights, r.keep, r.metrics

    assert_same(fn(logp, old, rollout, mask, adv), compiled(fn)(logp, old, rollout, mask, adv))

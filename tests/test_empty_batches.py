"""A batch with no row or no column (B = 0 or T = 0, e.g. after DAPO-style filtering) behaves like an all-masked one:
loss 0 with an empty gradient, ``loss/empty_batch = 1``, every metric present and equal to the all-masked batch's.
(max/min reductions have no identity on an empty tensor: without the padding they would raise.)"""

from __future__ import annotations

import pytest
import torch

import offpolicy as op

SHAPES = [(0, 4), (3, 0), (0, 0)]


def _batch(shape, *, requires_grad=False):
    z = torch.zeros(shape)
    return op.LogProbBatch(logp=z.clone().requires_grad_(requires_grad), old_logp=z.clone(), rollout_logp=z.clone(),
                           mask=torch.zeros(shape, dtype=torch.bool), advantages=torch.zeros(shape[0]))


def _all_masked_like(shape):
    """The all-masked [max(B, 1), max(T, 1)] batch the empty one must match."""
    return _batch((max(shape[0], 1), max(shape[1], 1)))


def _presets():
    return [op.tis(), op.mis(level="geometric"), op.geo_mask(), op.icepop(), op.opsm(delta=0.1), op.veto(), op.trm(),
            op.ln_trm(), op.ser(), op.kl_rejection("seq_max_k2", upper=0.1), op.kl_rejection("token_k3", upper=0.1),
            op.gated_is(), op.gated_is(level="geometric", gating="binary_kl")]


@pytest.mark.parametrize("shape", SHAPES)
def test_every_correction_gives_empty_weights_and_the_all_masked_metrics(shape):
    for c in _presets() + [op.chain(op.tis(), op.icepop(), op.opsm(delta=0.1), op.trm())]:
        r = c(_batch(shape))
        assert r.weights.shape == shape and r.keep.shape == shape and r.keep.dtype == torch.bool, c
        want = c(_all_masked_like(shape)).metrics
        assert r.metrics.keys() == want.keys(), c
        for k in want:
            assert torch.equal(r.metrics[k], want[k]), (c, k)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("objective", op.OBJECTIVES)
def test_policy_loss_is_zero_with_an_empty_gradient(shape, objective):
    b = _batch(shape, requires_grad=True)
    loss, m = op.policy_loss(b, objective=objective, correction=op.chain(op.icepop(), op.opsm(delta=0.1)))
    loss.backward()
    assert loss.item() == 0.0 and b.logp.grad.shape == shape
    assert m["loss/empty_batch"].item() == 1.0
    assert all(bool(torch.isfinite(v)) for v in m.values())


@pytest.mark.parametrize("shape", SHAPES)
def test_metrics_and_functional_masks(shape):
    z = torch.zeros(shape)
    got = op.offpolicy_metrics(z, z, z, op.tis()(_batch(shape)))
    full = _all_masked_like(shape)
    want = op.offpolicy_metrics(full.logp, full.rollout_logp, full.mask, op.tis()(full))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    for out in op.importance_weights(z, z, upper=2.0) + (op.trust_region_mask(z, z, max_kl=0.1),):
        assert out.shape == shape

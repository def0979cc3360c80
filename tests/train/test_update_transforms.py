"""The reference trainer's update runs score centering's batch step and the plug-ins through
:func:`offpolicy.transforms.apply_transforms`: the centred gradient against the hand-computed onehot(y) − q."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from offpolicy.batch import LogProbBatch
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.train.presets import PRESETS
from offpolicy.train.update import _score_centered, _transforms
from offpolicy.transforms import SCORE_CENTER, apply_transforms


def _state(preset: str, plugins=None):
    return SimpleNamespace(preset=PRESETS[preset], sampling=SamplingConfig(temperature=1.0),
                           cfg=SimpleNamespace(algorithm=SimpleNamespace(transforms=plugins)))


def test_the_run_transforms_of_a_preset():
    assert [t.name for t in _transforms(_state("score_centering"))] == ["score_centering"]
    assert _transforms(_state("score_centering_topk"))[0].params["source"] == "topk"
    assert _transforms(_state("score_centering_tis")) == []  # the IS rule's weighted centre is in the log-probs
    assert _transforms(_state("naive")) == []


def test_the_exact_centre_reaches_the_gradient_through_the_batch_step():
    # z = (1, 0, −1), y = 1, the sampler's logits give q = softmax((0, 1, 0)) = (0.2119, 0.5761, 0.2119)
    z = torch.tensor([[[1.0, 0.0, -1.0]]], requires_grad=True)
    sampler = torch.tensor([[[0.0, 1.0, 0.0]]])
    logp = torch.log_softmax(z, -1)[..., 1]
    state = _state("score_centering")
    out, extras = _score_centered(state, logp, z, sampler, {}, rollout_logp=logp.detach())
    assert out is logp and SCORE_CENTER in extras and "score_centering/drift_tv" in extras
    batch = apply_transforms(LogProbBatch(logp=out, mask=torch.ones(1, 1), extras=extras), _transforms(state))
    assert batch.logp.item() == logp.item() and SCORE_CENTER not in batch.extras
    q = torch.softmax(sampler, -1)
    assert torch.allclose(torch.autograd.grad(batch.logp.sum(), z)[0], torch.tensor([[[0.0, 1.0, 0.0]]]) - q,
                          atol=1e-6)

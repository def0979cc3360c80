"""Fixtures for the whole suite: offline, one intra-op thread, and a random-init tiny model built once per module."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in these tests may touch the network

import pytest

from offpolicy.models.tiny import build_tiny_model
from offpolicy.models.warm_start import torch_threads


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny matmuls: one thread is as fast as two, and avoids 10x slow-downs when the 2-core machine is shared.
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def tiny():
    """(model, tokenizer): random init, fp32, eval."""
    return build_tiny_model(seed=0)


# -- shared helpers (fixtures that return functions: the suite imports test modules by path, not as a package) ---------


@pytest.fixture
def random_batch():
    """``make(seed, B, T, scale=0.1, mask_frac=0.8)`` → a :class:`~offpolicy.LogProbBatch` of random log-probs: π_old
    and μ drift from π_θ by ``scale`` (normal noise), about ``mask_frac`` of the tokens are valid, [B] advantages."""
    import torch

    from offpolicy.batch import LogProbBatch

    def make(seed: int, b: int, t: int, scale: float = 0.1, mask_frac: float = 0.8) -> LogProbBatch:
        g = torch.Generator().manual_seed(seed)
        logp = -3 * torch.rand(b, t, generator=g)
        old = logp + scale * torch.randn(b, t, generator=g)
        rollout = old + scale * torch.randn(b, t, generator=g)
        mask = torch.rand(b, t, generator=g) < mask_frac
        return LogProbBatch(logp=logp, old_logp=old, rollout_logp=rollout, mask=mask,
                            advantages=torch.randn(b, generator=g))

    return make


@pytest.fixture
def verl_policy_loss():
    """``loss(loss_mode, old_logp, logp, advantages [B, T], mask, loss_agg_mode="token-mean", **actor_config)`` →
    verl 0.9's own registered policy loss (``core_algos.get_policy_loss_fn``), with an ``ActorConfig`` built from
    ``actor_config``. Skips the test when verl is not installed."""
    pytest.importorskip("verl")
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config.actor import ActorConfig

    def loss(loss_mode, old_logp, logp, advantages, mask, loss_agg_mode="token-mean", **actor_config):
        config = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, **actor_config)
        return get_policy_loss_fn(loss_mode)(old_logp, logp, advantages, mask.float(), loss_agg_mode, config)

    return loss

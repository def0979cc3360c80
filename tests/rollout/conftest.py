"""Shared fixtures for the rollout tests: a random-init tiny model (built once per module), offline."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in these tests may touch the network

import pytest
import torch

from offpolicy.models.tiny import build_tiny_model
from offpolicy.models.warm_start import torch_threads


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny matmuls: one thread is as fast as two, and avoids 10x slow-downs when the 2-core box is shared.
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def tiny():
    """(model, tokenizer): random init, fp32, eval."""
    return build_tiny_model(seed=0)


@pytest.fixture(scope="module")
def sharp(tiny):
    """The tiny model with logits scaled ×30 (final-norm weight), so next-token distributions have a head with
    p > 0.5 *and* a long tail with p < 1e-3 — the shape of a trained policy, without training."""
    import copy

    model = copy.deepcopy(tiny[0])
    with torch.no_grad():
        model.model.norm.weight.mul_(30.0)
    return model, tiny[1]


@pytest.fixture(scope="module")
def prompts(tiny):
    tok = tiny[1]
    texts = ["12+34=", "5-7=", "Use 3 5 7 to make 22:", "99+1=", "1=", "Use 10 2 4 to make 9:"]
    return [tok(t)["input_ids"] for t in texts]

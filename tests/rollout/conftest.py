"""Fixtures for the rollout tests: a sharpened tiny model and a few prompts (the plain `tiny` model is in tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch


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

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

"""Fixtures for the rollout tests: a few prompts (the `tiny` and `sharp` models are in tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def prompts(tiny):
    tok = tiny[1]
    texts = ["12+34=", "5-7=", "Use 3 5 7 to make 22:", "99+1=", "1=", "Use 10 2 4 to make 9:"]
    return [tok(t)["input_ids"] for t in texts]

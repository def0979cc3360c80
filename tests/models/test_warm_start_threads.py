"""The warm start's thread count: two on an idle machine, one on a busy one — and the weights do not depend on it."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

ws = importlib.import_module("offpolicy.models.warm_start")  # the package re-exports a function of that name


@pytest.mark.parametrize("cores, load, expected", [(2, 0.3, 2), (2, 1.9, 2), (2, 2.0, 1), (2, 22.0, 1), (1, 0.0, 1),
                                                   (16, 3.0, 2)])
def test_threads_follow_the_load(cores, load, expected, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    assert ws.warm_start_threads() == expected


def test_no_load_average_means_not_busy(monkeypatch):
    def unavailable():
        raise OSError("no load average")

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", unavailable)
    assert ws.warm_start_threads() == 2


def test_the_weights_do_not_depend_on_the_threads(monkeypatch):
    from offpolicy.models.tiny import build_tiny_model

    weights = []
    for threads in (1, 2):
        monkeypatch.setattr(ws, "warm_start_threads", lambda threads=threads: threads)
        model, tok = build_tiny_model(0, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=2, num_key_value_heads=1)
        ws.warm_start(model, tok, steps=3, batch_size=8)
        weights.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))

"""Metric logging: one sync, JSONL lines (NaN kept as null), resume truncation."""

from __future__ import annotations

import math

import torch

from offpolicy.train.logging import MetricLogger, read_metrics, to_floats


def test_to_floats_and_jsonl(tmp_path):
    assert to_floats({}) == {}
    log = MetricLogger(tmp_path, tensorboard=False)
    out = log.log(1, {"a": torch.tensor(0.25), "b": torch.tensor(float("nan")), "c": 3})
    log.log(2, {"a": torch.tensor(0.5)})
    log.log(3, {"a": torch.tensor(0.75)})
    assert out["a"] == 0.25 and math.isnan(out["b"]) and out["c"] == 3.0
    log.truncate_after(2)
    log.log(3, {"a": torch.tensor(1.0)})
    log.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows == [{"step": 1, "a": 0.25, "b": None, "c": 3.0}, {"step": 2, "a": 0.5}, {"step": 3, "a": 1.0}]


def test_tensorboard_written_when_available(tmp_path):
    log = MetricLogger(tmp_path, tensorboard=True)
    log.log(1, {"x": torch.tensor(1.0)})
    log.close()
    if log.has_tensorboard:
        assert any((tmp_path / "tensorboard").iterdir())

"""Metric logging: one sync, JSONL lines (NaN kept as null), resume truncation."""

from __future__ import annotations

import math

import pytest
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


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_a_half_written_last_line_is_skipped_with_a_warning_naming_the_file(tmp_path):
    # Expected: what a killed run leaves (half a JSON line at the end) is ignored with a warning naming the path;
    # it used to raise a bare JSONDecodeError ("Expecting ',' delimiter …") that blocked resume, fresh runs and
    # diagnose.
    path = _write(tmp_path / "metrics.jsonl", '{"step": 1, "a": 0.5}\n{"step": 2, "a": 0.25}\n{"step": 3, "a": 0.0')
    with pytest.warns(UserWarning, match=r"metrics\.jsonl.*last line 3"):
        assert read_metrics(path) == [{"step": 1, "a": 0.5}, {"step": 2, "a": 0.25}]
    # resume: truncate_after drops the half line too, and the next record starts on a line of its own
    log = MetricLogger(tmp_path, tensorboard=False)
    with pytest.warns(UserWarning, match="last line"):
        log.truncate_after(2)
    log.log(3, {"a": torch.tensor(1.0)})
    log.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]


def test_a_damaged_line_before_the_last_is_an_error_naming_file_and_line(tmp_path):
    # Expected: damage in the middle is not what a kill leaves: ValueError with the path and the line number.
    path = _write(tmp_path / "metrics.jsonl", '{"step": 1}\n\n{"step": 2, "a": \n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl.*line 3"):
        read_metrics(path)
    _write(path, '{"step": 1}\n[1, 2]\n{"step": 3}\n')  # valid JSON, but not a record
    with pytest.raises(ValueError, match=r"line 2: not a JSON record"):
        read_metrics(path)


def test_reset_empties_the_log_without_reading_it(tmp_path):
    # Expected: a fresh run's log starts empty even when the old file is damaged beyond its last line.
    _write(tmp_path / "metrics.jsonl", "garbage\nmore garbage\n")
    log = MetricLogger(tmp_path, tensorboard=False)
    log.reset()
    log.log(1, {"a": torch.tensor(1.0)})
    log.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "a": 1.0}]

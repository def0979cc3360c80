"""offpolicy.resume_settings: flat settings, the comparison a resume runs, and the append-only record of changes."""

from __future__ import annotations

import json
import os

import pytest

from offpolicy.registry import build_correction
from offpolicy.resume_settings import (
    check_resume,
    correction_settings,
    flatten,
    read_changes,
    read_settings,
    record_changes,
    write_json_atomic,
)


def _hint(keys):
    return "allow " + ",".join(keys)


def test_equal_settings_are_no_change_whatever_their_int_or_tuple_form():
    assert check_resume({"a": 2, "b": (0, 1)}, {"a": 2.0, "b": [0, 1]}, allowed=(), where="w", step=1,
                        allow_hint=_hint) == []


def test_every_refused_key_is_named_with_both_values_in_one_line():
    with pytest.raises(ValueError) as err:
        check_resume({"a.x": 1.0, "a.y": "tis", "c[0].name": "opsm"}, {"a.x": 2.0, "a.y": "mis"}, allowed=(),
                     where="ckpt", step=7, allow_hint=_hint)
    assert str(err.value) == ("ckpt: a.x is 1.0 here but 2.0 in the checkpoint, a.y is 'tis' here but 'mis' in the "
                              "checkpoint, c[0].name is 'opsm' here but unset in the checkpoint (step 7); allow "
                              "a.x,a.y,c[0].name to resume with the new values")


def test_a_section_allows_its_keys_and_only_those():
    here, stored = {"a.x": 1.0, "a[0].y": 2, "ab": 3}, {"a.x": 0.0, "a[0].y": 1, "ab": 4}
    with pytest.raises(ValueError, match=r"ab is 3 here but 4"):
        check_resume(here, stored, allowed=("a",), where="w", step=1, allow_hint=_hint)
    changes = check_resume(here, stored, allowed=("a", "ab"), where="w", step=1, allow_hint=_hint)
    assert changes == [{"key": "a.x", "old": 0.0, "new": 1.0}, {"key": "a[0].y", "old": 1, "new": 2},
                       {"key": "ab", "old": 4, "new": 3}]
    with pytest.raises(ValueError, match=r"'a\.z' is not a setting a resume compares"):
        check_resume(here, stored, allowed=("a.z",), where="w", step=1, allow_hint=_hint)


def test_correction_settings_hold_the_effective_parameters():
    flat = correction_settings(build_correction({"name": "tis"}))
    assert flat["correction.name"] == "tis" and flat["correction.upper"] == 2.0  # tis's default, written out
    assert correction_settings(None) == {"correction": None}
    chain = correction_settings(build_correction(["icepop", {"name": "opsm", "delta": 0.5}]), key="c")
    assert chain["c[0].name"] == "icepop" and chain["c[1].delta"] == 0.5
    assert flatten({"x": {}}) == {"x": {}} and flatten({"x": [1, {"a": 1}]}) == {"x[0]": 1, "x[1].a": 1}


def test_the_record_is_appended_whole_lines_atomically(tmp_path, monkeypatch):
    path = tmp_path / "changes.jsonl"
    record_changes(path, [], step=1, checkpoint="c")
    assert not path.exists()  # nothing changed: no record
    record_changes(path, [{"key": "a", "old": 1, "new": 2}], step=3, checkpoint="c3")
    first = path.read_text()
    record_changes(path, [{"key": "b", "old": None, "new": "x"}, {"key": "c", "old": 0.5, "new": 1e-4}], step=5,
                   checkpoint="c5")
    assert path.read_text().startswith(first)
    assert [(r["step"], r["key"], r["old"], r["new"], r["checkpoint"]) for r in read_changes(path)] == [
        (3, "a", 1, 2, "c3"), (5, "b", None, "x", "c5"), (5, "c", 0.5, 1e-4, "c5")]
    assert all("time" in r for r in read_changes(path))
    # a write that fails midway leaves the earlier record as it was, and no temp file behind
    before = path.read_bytes()

    def broken(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        record_changes(path, [{"key": "d", "old": 1, "new": 2}], step=6, checkpoint="c6")
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["changes.jsonl"]


def test_stored_settings_round_trip_and_a_damaged_file_is_named(tmp_path):
    path = tmp_path / "s.json"
    assert read_settings(path) is None
    write_json_atomic(path, {"step": 4, "settings": {"a": 1e-4}})
    assert read_settings(path) == {"step": 4, "settings": {"a": 1e-4}}
    path.write_text("[1, 2")
    with pytest.raises(ValueError, match="s.json"):
        read_settings(path)
    path.write_text(json.dumps([1]))
    with pytest.raises(ValueError, match="must hold a JSON mapping"):
        read_settings(path)

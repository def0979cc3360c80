"""Nothing lost: a fresh run into a folder that holds an earlier run is refused before any work, with one line naming
the folder and what it holds; ``overwrite=True`` (``--overwrite``) replaces it. The CLI's side (exit 2, files
untouched) is in tests/test_cli.py::test_reusing_an_out_dir_needs_overwrite_and_resume_checks_the_run."""

from __future__ import annotations

import re

import pytest
import torch

from offpolicy.train.checkpoint import save_checkpoint
from offpolicy.train.config import load_config
from offpolicy.train.run_folder import RunFolder, describe_earlier_run


def _earlier_run(folder, *, steps_done: int, planned: int, preset: str = "tis", seed: int = 3) -> None:
    """What a run of ``planned`` steps leaves after ``steps_done``: its config, checkpoints and metrics rows."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(f"algorithm:\n  preset: {preset}\nrun:\n  steps: {planned}\n  seed: {seed}\n")
    for step in range(1, steps_done + 1):
        save_checkpoint(folder / "checkpoints", step=step, model=torch.nn.Linear(2, 2),
                        metadata={"preset": preset, "seed": seed})
    (folder / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(1, steps_done + 1)))


def test_an_empty_or_new_folder_holds_nothing(tmp_path):
    assert describe_earlier_run(tmp_path / "absent") is None
    assert describe_earlier_run(tmp_path) is None
    (tmp_path / "metrics.jsonl").write_text("")  # an emptied log and a killed save's leftover are nothing to lose
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / ".tmp_x.safetensors").write_bytes(b"half")
    assert describe_earlier_run(tmp_path) is None


def test_a_finished_and_an_unfinished_run_are_named_as_such(tmp_path):
    _earlier_run(tmp_path / "done", steps_done=2, planned=2)
    assert describe_earlier_run(tmp_path / "done") == \
        "a finished run (preset 'tis', seed 3, step 2 of 2; 2 checkpoints, 2 metrics rows)"
    _earlier_run(tmp_path / "half", steps_done=1, planned=5, preset="mis", seed=0)
    assert describe_earlier_run(tmp_path / "half") == \
        "an unfinished run (preset 'mis', seed 0, step 1 of 5; 1 checkpoint, 1 metrics row)"


def test_damaged_files_are_counted_not_read(tmp_path):
    # a truncated checkpoint and an unreadable config.yaml: the folder is still described (and still refused)
    _earlier_run(tmp_path, steps_done=1, planned=1)
    (tmp_path / "checkpoints" / "step_00000002.safetensors").write_bytes(b"truncated")
    (tmp_path / "config.yaml").write_text("run: [1,\n")
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"x")
    assert describe_earlier_run(tmp_path) == "an earlier run (2 checkpoints, 1 metrics row, TensorBoard logs)"


def _cfg(folder):
    return load_config(None, ["algorithm.preset=tis", f"run.out_dir={folder}", "run.steps=2", "run.seed=3"])


def test_the_run_folder_refuses_an_earlier_run_unless_overwrite(tmp_path):
    _earlier_run(tmp_path, steps_done=2, planned=2)
    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=re.escape(
            f"run.out_dir '{tmp_path}' holds a finished run (preset 'tis', seed 3, step 2 of 2; 2 checkpoints, "
            "2 metrics rows): pass --overwrite to replace it, --resume to continue it, or choose another "
            "run.out_dir")) as err:
        RunFolder(_cfg(tmp_path))
    assert "\n" not in str(err.value)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != ".run.lock"} == files
    with RunFolder(_cfg(tmp_path), overwrite=True) as folder:  # accepted: open() would replace the run
        assert folder.resume_from is None
    with RunFolder(_cfg(tmp_path), resume=True) as folder:  # or continue it
        assert folder.resume_from.name == "step_00000002.safetensors"
    with pytest.raises(ValueError, match="pass one of them"):
        RunFolder(_cfg(tmp_path), resume=True, overwrite=True)

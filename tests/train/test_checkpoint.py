"""Checkpoints: atomic safetensors with model, optimizer, RNG and extra modules; exact round trip."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from offpolicy.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight  # tied, like the tiny model's embeddings


def _train_step(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = m.head(m.emb(torch.tensor([1, 2]))).pow(2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_round_trip_model_optimizer_rng_and_extra(tmp_path):
    torch.manual_seed(0)
    m, extra = Tied(), nn.Linear(2, 2)
    opt = torch.optim.AdamW(list(m.parameters()) + list(extra.parameters()), lr=0.1)
    _train_step(m, opt)
    gen = torch.Generator().manual_seed(5)
    torch.rand(1, generator=gen)
    random.seed(3)
    np.random.seed(4)
    path = save_checkpoint(tmp_path, step=7, model=m, optimizer=opt, extra_modules={"x": extra},
                           generators={"engine": gen}, metadata={"note": "hi"})
    expect = (torch.rand(3), random.random(), np.random.rand(), torch.rand(2, generator=gen))
    # continue training the original: the reference for "resume reproduces"
    _train_step(m, opt)
    ref = m.emb.weight.detach().clone()

    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    m2, extra2 = Tied(), nn.Linear(2, 2)
    opt2 = torch.optim.AdamW(list(m2.parameters()) + list(extra2.parameters()), lr=0.1)
    gen2 = torch.Generator().manual_seed(0)
    info = load_checkpoint(path, model=m2, optimizer=opt2, extra_modules={"x": extra2}, generators={"engine": gen2})
    assert info["step"] == 7 and info["metadata"] == {"note": "hi"}
    got = (torch.rand(3), random.random(), np.random.rand(), torch.rand(2, generator=gen2))
    assert torch.equal(got[0], expect[0]) and got[1] == expect[1] and got[2] == expect[2] and torch.equal(got[3], expect[3])
    assert torch.equal(extra2.weight, extra.weight)
    assert m2.head.weight is m2.emb.weight  # tying survives loading
    _train_step(m2, opt2)
    assert torch.equal(m2.emb.weight, ref)  # identical optimizer state ⇒ identical next step


def test_atomic_write_and_latest(tmp_path):
    m = nn.Linear(2, 2)
    for step in (1, 10, 2):
        save_checkpoint(tmp_path, step=step, model=m, keep_last=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step_00000002.safetensors", "step_00000010.safetensors"]  # no temp files, oldest pruned
    assert latest_checkpoint(tmp_path).name == "step_00000010.safetensors"
    assert latest_checkpoint(tmp_path / "none") is None


def test_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    import safetensors.torch

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, step=1, model=nn.Linear(2, 2))
    assert list(tmp_path.iterdir()) == []


def test_load_errors_name_the_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.safetensors", model=nn.Linear(2, 2))
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(1)}, str(tmp_path / "foreign.safetensors"))
    with pytest.raises(ValueError, match="not an offpolicy checkpoint"):
        load_checkpoint(tmp_path / "foreign.safetensors", model=nn.Linear(2, 2))


def test_corrupt_or_truncated_checkpoint_is_a_value_error_naming_the_file(tmp_path):
    # Expected: ValueError naming the file; safetensors' own SafetensorError ("incomplete metadata, file not fully
    # covered") named none and reached the CLI user as a traceback.
    from offpolicy.train.checkpoint import read_checkpoint_info

    m = nn.Linear(2, 2)
    path = save_checkpoint(tmp_path, step=1, model=m, metadata={"preset": "mis", "seed": 0})
    assert read_checkpoint_info(path)["user"] == {"preset": "mis", "seed": 0}
    data = path.read_bytes()
    for damaged in (data[: len(data) // 2], data[:5], b"\x00" * 64, data[:-8]):
        path.write_bytes(damaged)
        with pytest.raises(ValueError, match=r"step_00000001\.safetensors.*cannot be read"):
            load_checkpoint(path, model=nn.Linear(2, 2))


def test_checkpoint_of_another_model_shape_is_a_value_error(tmp_path):
    # Expected: a clear ValueError naming the file (torch's RuntimeError listed every key over many lines).
    path = save_checkpoint(tmp_path, step=1, model=nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"step_00000001\.safetensors.*does not fit this model"):
        load_checkpoint(path, model=nn.Linear(3, 2))


def test_checkpoint_and_temp_file_listing(tmp_path):
    from offpolicy.train.checkpoint import checkpoint_files, temp_files

    m = nn.Linear(2, 2)
    for step in (10, 2):
        save_checkpoint(tmp_path, step=step, model=m)
    (tmp_path / ".tmp_abc123.safetensors").write_bytes(b"half")  # what a kill during a save leaves
    (tmp_path / "notes.txt").write_text("x")
    assert [p.name for p in checkpoint_files(tmp_path)] == ["step_00000002.safetensors", "step_00000010.safetensors"]
    assert [p.name for p in temp_files(tmp_path)] == [".tmp_abc123.safetensors"]
    assert checkpoint_files(tmp_path / "none") == [] and temp_files(tmp_path / "none") == []

"""The reload folder: a folder of the project's own, written atomically shard by shard, never a model directory."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file

from offpolicy.rollout.weight_sync import INDEX, ReloadFolder, check_reload_folder, tensor_names


def _read(folder) -> dict[str, torch.Tensor]:
    index = json.loads((folder / INDEX).read_text())
    out: dict[str, torch.Tensor] = {}
    for shard in set(index["weight_map"].values()):
        out.update(load_file(str(folder / shard)))
    assert set(out) == set(index["weight_map"])
    return out


def _tensors(n: int, size: int = 100) -> list[tuple[str, torch.Tensor]]:
    return [(f"layer{i}.weight", torch.full((size,), float(i))) for i in range(n)]


def test_every_tensor_round_trips_and_an_alias_is_written_under_its_own_name(tmp_path):
    folder = ReloadFolder(tmp_path / "reload")
    named = _tensors(3)
    folder.write(iter(named), aliases={"layer0.weight": ["head.weight"]})
    got = _read(tmp_path / "reload")
    assert set(got) == {"layer0.weight", "layer1.weight", "layer2.weight", "head.weight"}
    for name, t in named:
        assert torch.equal(got[name], t)
    assert torch.equal(got["head.weight"], named[0][1])


def test_shards_hold_at_most_max_shard_bytes_or_one_tensor_and_old_shards_go(tmp_path):
    folder = ReloadFolder(tmp_path, max_shard_bytes=800)  # two 400-byte tensors a shard
    folder.write(iter(_tensors(5)))
    first = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(first) == 3 and folder.peak_pending_bytes == 800
    folder.write(iter(_tensors(5)))
    second = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(second) == 3 and not set(first) & set(second)  # the previous generation removed
    one = ReloadFolder(tmp_path / "one", max_shard_bytes=0)  # one tensor a shard: memory of the largest tensor
    one.write(iter(_tensors(4) + [("big", torch.zeros(1000))]))
    assert one.peak_pending_bytes == 4000 and len(list((tmp_path / "one").glob("*.safetensors"))) == 5


def test_the_stream_is_consumed_once_and_lazily(tmp_path):
    seen = []

    def stream():
        for name, t in _tensors(3):
            seen.append(name)
            yield name, t

    ReloadFolder(tmp_path, max_shard_bytes=0).write(stream())
    assert seen == ["layer0.weight", "layer1.weight", "layer2.weight"]


def test_a_folder_with_foreign_files_is_refused_and_left_untouched(tmp_path):
    from offpolicy.models import load_model

    model, _ = load_model("tiny")
    model.save_pretrained(tmp_path, max_shard_size="200KB")  # a sharded model directory
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.iterdir()}
    assert (tmp_path / INDEX).exists() and len(before) > 3
    with pytest.raises(ValueError, match="holds files this project did not write.*never written"):
        ReloadFolder(tmp_path)
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.iterdir()} == before


def test_write_model_names_the_tied_head_and_the_folder_passes_its_own_check(tmp_path):
    from offpolicy.models import load_model

    model, _ = load_model("tiny")
    folder = ReloadFolder(tmp_path / "r").write_model(model)
    names = tensor_names(folder)
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
    assert names == set(model.state_dict())
    got = _read(folder)
    for name, t in model.state_dict().items():
        assert torch.equal(got[name], t)
    model.config.save_pretrained(folder)  # a config saying the head is tied: the head is there under its name
    check_reload_folder(folder)


def test_check_refuses_save_pretrained_layout_and_an_empty_folder(tmp_path):
    from offpolicy.models import load_model

    model, _ = load_model("tiny")
    model.save_pretrained(tmp_path / "m")
    assert "lm_head.weight" not in tensor_names(tmp_path / "m")
    with pytest.raises(ValueError, match="head is stored once"):
        check_reload_folder(tmp_path / "m")
    (tmp_path / "e").mkdir()
    with pytest.raises(ValueError, match="no safetensors weights"):
        check_reload_folder(tmp_path / "e")


def test_bad_arguments_name_themselves(tmp_path):
    with pytest.raises(ValueError, match="max_shard_bytes"):
        ReloadFolder(tmp_path, max_shard_bytes=-1)
    with pytest.raises(ValueError, match="given twice"):
        ReloadFolder(tmp_path / "a").write(iter([("x", torch.zeros(1)), ("x", torch.ones(1))]))
    with pytest.raises(ValueError, match="no tensor"):
        ReloadFolder(tmp_path / "b").write(iter([]))
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        ReloadFolder(tmp_path / "f")

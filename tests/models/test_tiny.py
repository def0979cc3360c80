import json
import os

import pytest
import torch

from offpolicy.models.cache import INFO_FILE, cache_root, load_tiny_model, tiny_model_dir, tiny_model_path
from offpolicy.models.tiny import build_tiny_model
from offpolicy.models.warm_start import encode_examples, warm_start


def test_build_is_deterministic_and_small(tiny):
    model, tok = tiny
    again, _ = build_tiny_model(seed=0)
    other, _ = build_tiny_model(seed=1)
    sd, sd_again, sd_other = model.state_dict(), again.state_dict(), other.state_dict()
    assert all(torch.equal(sd[k], sd_again[k]) for k in sd)
    assert any(not torch.equal(sd[k], sd_other[k]) for k in sd)
    n = sum(p.numel() for p in model.parameters())
    assert 1_000_000 < n < 5_000_000
    assert model.dtype == torch.float32 and not model.training
    assert model.config.vocab_size == len(tok) and model.config.eos_token_id == tok.eos_token_id


def test_build_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_save_pretrained_roundtrip(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    model, tok = tiny
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([tok("12+34=")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("OFFPOLICY_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"  # the argument wins
    monkeypatch.delenv("OFFPOLICY_CACHE")
    assert cache_root() == __import__("pathlib").Path.home() / ".cache" / "offpolicy"
    # the directory name changes with the recipe
    assert tiny_model_dir(tmp_path, steps=3) != tiny_model_dir(tmp_path, steps=4)
    assert tiny_model_dir(tmp_path, steps=3) == tiny_model_dir(tmp_path, steps=3)


def test_warm_start_lowers_the_loss(tiny):
    import copy

    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    prompt_ids, answer_ids = encode_examples(tok, ["12+34="], ["46"])
    assert tok.decode(answer_ids[0]) == "46<|eos|>"
    stats = warm_start(model, tok, steps=15, batch_size=16)
    # random init predicts ~uniformly: loss ≈ ln(4099) = 8.32; 15 steps must already learn the digit/eos format
    assert stats["loss"] < 6.0
    assert not model.training


def test_warm_start_validates():
    with pytest.raises(ValueError, match="steps"):
        warm_start(None, None, steps=-1)


@pytest.mark.slow
def test_cached_build_and_load(tmp_path):
    """The whole cache path with a 5-step warm start: atomic build, reuse, force, load via Auto* classes."""
    path = tiny_model_path(tmp_path, steps=5)
    assert path.parent == tmp_path and path.name.startswith("tiny-")
    for name in ("config.json", "model.safetensors", "tokenizer.json", INFO_FILE):
        assert (path / name).is_file(), name
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary directories left behind
    info = json.loads((path / INFO_FILE).read_text())
    assert info["recipe"]["warm_start"]["steps"] == 5
    assert 0.0 <= info["stats"]["reward"] <= 1.0 and info["stats"]["seconds"] > 0

    mtime = os.path.getmtime(path / "model.safetensors")
    assert tiny_model_path(tmp_path, steps=5) == path
    assert os.path.getmtime(path / "model.safetensors") == mtime  # reused, not rebuilt

    model, tok = load_tiny_model(tmp_path, steps=5)
    assert model.dtype == torch.float32 and not model.training and len(tok) >= 4096
    rebuilt, _ = build_tiny_model(seed=0)
    warm_start(rebuilt, tok, steps=5)
    for (name, a), b in zip(model.state_dict().items(), rebuilt.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)  # deterministic: a rebuild gives the cached weights

    assert tiny_model_path(tmp_path, steps=5, force=True) == path
    assert [p.name for p in tmp_path.iterdir()] == [path.name]

"""The embedded models do not depend on the machine they are used on: the default recipes ship with the package, and
a warm start runs with one fixed thread count whatever the machine's load."""

from __future__ import annotations

import importlib
import json
import os

import pytest
import torch

ws = importlib.import_module("offpolicy.models.warm_start")  # the package re-exports a function of that name
cache = importlib.import_module("offpolicy.models.cache")
RECIPES = importlib.import_module("offpolicy.models.recipes").RECIPES


@pytest.mark.parametrize("load", [0.0, 1.9, 2.0, 22.0])
def test_the_warm_start_uses_a_fixed_thread_count(load, monkeypatch):
    # A thread count picked from the load average made the weights depend on how busy the machine was (float
    # reductions of a matmul differ between 1 and 2 threads on some CPUs).
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    seen = []
    monkeypatch.setattr(ws, "_train", lambda *a, **k: seen.append(torch.get_num_threads()) or {})
    before = torch.get_num_threads()
    ws.warm_start(torch.nn.Linear(1, 1), None, recipe=ws.WarmStartRecipe(steps=0))
    assert seen == [ws.WARM_START_THREADS]
    assert torch.get_num_threads() == before  # restored


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_builds_at_the_fixed_thread_count(name, tmp_path, monkeypatch):
    # each default recipe (the MoE one too) goes through the same warm start, at WARM_START_THREADS
    seen = []
    monkeypatch.setattr(ws, "_train", lambda *a, **k: seen.append(torch.get_num_threads()) or {})
    monkeypatch.setattr(cache, "evaluate_reward", lambda *a, **k: {})
    with ws.torch_threads(1):
        cache.build_model(name, tmp_path)
    assert seen == [ws.WARM_START_THREADS]


@pytest.mark.parametrize("name", ["tiny", "lab", "lab-moe"])
def test_every_default_recipe_ships_with_the_package(name):
    # Fails when a default recipe, the architecture or the tokenizer changes without `python scripts/ship_models.py`.
    shipped = cache.shipped_dir(name)
    assert shipped is not None, f"{name}: no shipped model for the current recipe; run scripts/ship_models.py"
    info = json.loads((shipped / cache.INFO_FILE).read_text())
    assert info["recipe"] == cache._description(cache.get_recipe(name))
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in shipped.iterdir()}


def test_a_first_use_copies_the_shipped_model_instead_of_building(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    def no_build(*args, **kwargs):
        raise AssertionError("the shipped model was rebuilt")

    monkeypatch.setattr(cache, "build_model", no_build)
    path = cache.model_path("tiny", tmp_path)
    assert path.parent == tmp_path and path.name == cache.shipped_dir("tiny").name
    ours, shipped = (load_file(p / "model.safetensors") for p in (path, cache.shipped_dir("tiny")))
    assert ours.keys() == shipped.keys() and all(torch.equal(ours[k], shipped[k]) for k in ours)
    model, _ = cache.load_model("tiny", tmp_path)  # and transformers loads it as is
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], shipped["model.embed_tokens.weight"])


def test_the_shipped_tokenizer_is_the_one_the_project_builds():
    # The tokenizer is trained locally (byte-level BPE); the shipped files must encode as the builder does.
    from transformers import AutoTokenizer

    from offpolicy.models.tokenizer import build_tokenizer

    shipped = AutoTokenizer.from_pretrained(cache.shipped_dir("lab"))
    built = build_tokenizer()
    text = "Use 12 and 7 to make 19: 12+7=19 bakodu Bakodu,"
    assert shipped(text)["input_ids"] == built(text)["input_ids"]
    vocab = shipped.get_vocab()
    assert all(vocab.get(token) == i for token, i in built.get_vocab().items())


def test_a_recipe_that_does_not_ship_is_built(tmp_path):
    recipe = cache.get_recipe("tiny").with_overrides({"num_hidden_layers": 1, "hidden_size": 32,
                                                      "intermediate_size": 64, "num_attention_heads": 2,
                                                      "num_key_value_heads": 1}, steps=2, batch_size=4)
    assert cache.shipped_dir(recipe) is None
    info = json.loads((cache.model_path(recipe, tmp_path) / cache.INFO_FILE).read_text())
    assert info["recipe"]["warm_start"]["steps"] == 2

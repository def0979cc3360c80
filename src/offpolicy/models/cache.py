"""Build-once cache of the warm-started embedded models (``save_pretrained`` safetensors + tokenizer files).

Directory: ``<root>/<recipe name>-<hash>`` where ``root`` is the ``cache_dir`` argument, else ``$OFFPOLICY_CACHE``,
else ``~/.cache/offpolicy``, and ``hash`` covers everything that changes the weights (model version, architecture,
vocab size, warm-start task and recipe). The directory is written under a temporary name and renamed into place, so
a reader never sees a half-written model and two concurrent builders (parallel lab runs) do not corrupt each other:
the second one's rename loses and its identical copy is discarded.

The default recipes (``tiny`` and ``lab``) ship with the package, built once (``scripts/ship_models.py``), in
``offpolicy/models/data/<name>-<hash>``: a first use copies them into the cache instead of warm-starting. A warm start
is deterministic on one machine but not across CPUs (float reductions differ between instruction sets), so shipped
weights make the embedded models — and every number measured on them — the same on every machine, and spare a fresh
machine the two minutes of building. Other recipes (architecture or warm-start overrides) are built on first use.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from offpolicy.models.recipes import ModelRecipe, get_recipe
from offpolicy.models.tiny import TINY_CONFIG, TINY_MODEL_VERSION, build_tiny_model
from offpolicy.models.tokenizer import VOCAB_SIZE
from offpolicy.models.warm_start import evaluate_reward, torch_threads, warm_start

CACHE_ENV = "OFFPOLICY_CACHE"
INFO_FILE = "offpolicy_tiny.json"
SHIPPED_DIR = Path(__file__).parent / "data"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir`` if given, else ``$OFFPOLICY_CACHE``, else ``~/.cache/offpolicy``.

    >>> str(cache_root("/tmp/x"))
    '/tmp/x'
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "offpolicy"


def _description(recipe: ModelRecipe) -> dict:
    """What the weights depend on (hashed into the directory name, stored next to the weights)."""
    # The default architecture is left out, so the dense recipes keep the hash (and shipped folder) they had.
    architecture = {} if recipe.architecture == "qwen2" else {"architecture": recipe.architecture}
    return {
        "version": TINY_MODEL_VERSION,
        "name": recipe.name,
        **architecture,
        "config": {**TINY_CONFIG, **recipe.config},
        "vocab_size": VOCAB_SIZE,
        "task": {"name": recipe.task_name, **recipe.task_args},
        "warm_start": dataclasses.asdict(recipe.warm),
    }


def model_dir(recipe: str | ModelRecipe = "tiny", cache_dir: str | os.PathLike | None = None) -> Path:
    """Where a recipe's warm-started model lives (no building): ``<root>/<name>-<12 hex of the recipe hash>``.

    >>> model_dir("lab", "/tmp/c").name.startswith("lab-")
    True
    """
    recipe = get_recipe(recipe)
    digest = hashlib.sha256(json.dumps(_description(recipe), sort_keys=True).encode()).hexdigest()[:12]
    return cache_root(cache_dir) / f"{recipe.name}-{digest}"


def model_path(recipe: str | ModelRecipe = "tiny", cache_dir: str | os.PathLike | None = None, *,
               force: bool = False) -> Path:
    """Directory of a recipe's warm-started model, building it first if missing (or if ``force``).

    ``AutoModelForCausalLM.from_pretrained(path)`` and ``AutoTokenizer.from_pretrained(path)`` load it; its
    ``offpolicy_tiny.json`` records the recipe and the warm-start numbers (loss, seconds, sampled reward, accuracy).
    A recipe that ships with the package (:func:`shipped_dir`) is copied, not built, unless ``force``.
    """
    recipe = get_recipe(recipe)
    final = model_dir(recipe, cache_dir)
    if final.is_dir() and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        shipped = shipped_dir(recipe)
        if shipped is not None and not force:
            shutil.copytree(shipped, tmp, dirs_exist_ok=True)
        else:
            build_model(recipe, tmp)
        if force and final.is_dir():
            trash = Path(tempfile.mkdtemp(prefix=f".{final.name}-old-", dir=final.parent))
            os.replace(final, trash / "old")
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            # A concurrent builder won the rename; its copy is identical (deterministic build).
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_model(recipe: str | ModelRecipe, out: str | os.PathLike) -> Path:
    """Warm-start ``recipe``'s model from its seed and write it (weights, tokenizer, ``offpolicy_tiny.json``) into
    ``out``, an existing directory. Deterministic on one machine; see the module docstring for across machines."""
    recipe, out = get_recipe(recipe), Path(out)
    model, tokenizer = build_tiny_model(recipe.warm.seed, architecture=recipe.architecture, **recipe.config)
    task = recipe.task()
    stats = warm_start(model, tokenizer, task=task, recipe=recipe.warm)
    with torch_threads(1):
        stats.update(evaluate_reward(model, tokenizer, task=task, n=256))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / INFO_FILE).write_text(json.dumps({"recipe": _description(recipe), "stats": stats}, indent=2))
    return out


def shipped_dir(recipe: str | ModelRecipe) -> Path | None:
    """The package's copy of ``recipe``'s model (same ``<name>-<hash>`` as :func:`model_dir`), or None.

    >>> shipped_dir("lab") is not None, shipped_dir(get_recipe("lab").with_overrides(seed=7))
    (True, None)
    """
    path = SHIPPED_DIR / model_dir(recipe, "/").name
    return path if (path / INFO_FILE).is_file() else None


def load_model(recipe: str | ModelRecipe = "tiny", cache_dir: str | os.PathLike | None = None, *,
               force: bool = False):  # -> (PreTrainedModel, PreTrainedTokenizerFast)
    """A recipe's warm-started model (built and cached on first use) and its tokenizer, fp32, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(recipe, cache_dir, force=force)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer


def _tiny(steps: int | None, seed: int | None) -> ModelRecipe:
    warm = {k: v for k, v in {"steps": steps, "seed": seed}.items() if v is not None}
    return get_recipe("tiny").with_overrides(None, **warm)


def tiny_model_dir(cache_dir: str | os.PathLike | None = None, *, steps: int | None = None,
                   seed: int | None = None) -> Path:
    """:func:`model_dir` of the ``tiny`` recipe (``steps`` / ``seed`` override its warm start).

    >>> tiny_model_dir("/tmp/c").name.startswith("tiny-")
    True
    """
    return model_dir(_tiny(steps, seed), cache_dir)


def tiny_model_path(cache_dir: str | os.PathLike | None = None, *, force: bool = False, steps: int | None = None,
                    seed: int | None = None) -> Path:
    """:func:`model_path` of the ``tiny`` recipe (``steps`` overrides the warm-start length; tests use a few)."""
    return model_path(_tiny(steps, seed), cache_dir, force=force)


def load_tiny_model(cache_dir: str | os.PathLike | None = None, *, warm_start: bool = True, force: bool = False,
                    steps: int | None = None):  # -> (PreTrainedModel, PreTrainedTokenizerFast)
    """The embedded tiny model and its tokenizer, fp32, eval mode.

    ``warm_start=True``: the cached warm-started model (built on first use, ≈1 min on 2 CPU cores). ``False``: a
    fresh random init (``build_tiny_model(seed=0)``, nothing cached). No network access in either case.
    """
    if not warm_start:
        return build_tiny_model(seed=0)
    return load_model(_tiny(steps, None), cache_dir, force=force)


def tiny_model_info(path: str | os.PathLike) -> dict:
    """The recipe and warm-start statistics stored next to a cached model."""
    return json.loads((Path(path) / INFO_FILE).read_text())

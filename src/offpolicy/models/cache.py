"""Build-once cache of the warm-started tiny model (``save_pretrained`` safetensors + tokenizer files).

Directory: ``<root>/tiny-<hash>`` where ``root`` is the ``cache_dir`` argument, else ``$OFFPOLICY_CACHE``, else
``~/.cache/offpolicy``, and ``hash`` covers everything that changes the weights (model version, config, vocab
size, warm-start recipe). The directory is written under a temporary name and renamed into place, so a reader
never sees a half-written model and two concurrent builders do not corrupt each other (the second one's rename
loses and its copy is discarded).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from offpolicy.models.tiny import TINY_CONFIG, TINY_MODEL_VERSION, build_tiny_model
from offpolicy.models.tokenizer import VOCAB_SIZE
from offpolicy.models.warm_start import (
    WARM_START_BATCH,
    WARM_START_LR,
    WARM_START_STEPS,
    evaluate_reward,
    torch_threads,
    warm_start,
)

CACHE_ENV = "OFFPOLICY_CACHE"
INFO_FILE = "offpolicy_tiny.json"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir`` if given, else ``$OFFPOLICY_CACHE``, else ``~/.cache/offpolicy``.

    >>> str(cache_root("/tmp/x"))
    '/tmp/x'
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "offpolicy"


def _recipe(steps: int, seed: int) -> dict:
    return {
        "version": TINY_MODEL_VERSION,
        "config": TINY_CONFIG,
        "vocab_size": VOCAB_SIZE,
        "warm_start": {"steps": steps, "batch_size": WARM_START_BATCH, "lr": WARM_START_LR, "seed": seed},
    }


def tiny_model_dir(cache_dir: str | os.PathLike | None = None, *, steps: int = WARM_START_STEPS, seed: int = 0) -> Path:
    """Where the warm-started tiny model lives (no building): ``<root>/tiny-<12 hex of the recipe hash>``.

    >>> tiny_model_dir("/tmp/c").name.startswith("tiny-")
    True
    """
    digest = hashlib.sha256(json.dumps(_recipe(steps, seed), sort_keys=True).encode()).hexdigest()[:12]
    return cache_root(cache_dir) / f"tiny-{digest}"


def tiny_model_path(
    cache_dir: str | os.PathLike | None = None,
    *,
    force: bool = False,
    steps: int = WARM_START_STEPS,
    seed: int = 0,
) -> Path:
    """Directory of the warm-started tiny model, building it first if missing (or if ``force``).

    ``AutoModelForCausalLM.from_pretrained(path)`` and ``AutoTokenizer.from_pretrained(path)`` load it; its
    ``offpolicy_tiny.json`` records the recipe and the warm-start numbers (loss, seconds, reward, accuracy).
    ``steps`` overrides the warm-start length (a different cache entry; tests use a few steps).
    """
    final = tiny_model_dir(cache_dir, steps=steps, seed=seed)
    if final.is_dir() and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        model, tokenizer = build_tiny_model(seed=seed)
        stats = warm_start(model, tokenizer, steps=steps, seed=seed)
        with torch_threads(1):
            stats.update(evaluate_reward(model, tokenizer, n=256))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / INFO_FILE).write_text(json.dumps({"recipe": _recipe(steps, seed), "stats": stats}, indent=2))
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


def load_tiny_model(
    cache_dir: str | os.PathLike | None = None,
    *,
    warm_start: bool = True,
    force: bool = False,
    steps: int = WARM_START_STEPS,
):  # -> (PreTrainedModel, PreTrainedTokenizerFast)
    """The embedded tiny model and its tokenizer, fp32, eval mode.

    ``warm_start=True``: the cached warm-started model (built on first use, ≈1 min on 2 CPU cores — see
    :func:`tiny_model_path`). ``warm_start=False``: a fresh random init (``build_tiny_model(seed=0)``, nothing
    cached). No network access in either case.
    """
    if not warm_start:
        return build_tiny_model(seed=0)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_path(cache_dir, force=force, steps=steps)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer


def tiny_model_info(path: str | os.PathLike) -> dict:
    """The recipe and warm-start statistics stored next to a cached tiny model."""
    return json.loads((Path(path) / INFO_FILE).read_text())

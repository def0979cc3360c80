"""Weights on their way into an engine that cannot take tensors: a reload folder of the project's own.

A server (vLLM, SGLang) reloads weights from disk. :class:`ReloadFolder` is where they go — never the model directory
the server was started on: writing ``model.safetensors`` into a user's model folder overwrites their base weights,
and beside a sharded checkpoint (``model.safetensors.index.json``) vLLM reads the indexed shards, ignores the new
file, answers 200 and keeps the old weights. A reload folder holds only what this module wrote (a marker file says
so; a folder with anything else in it is refused), and each write replaces the whole set atomically:

1. the tensors stream to new shard files ``w{generation}-{i}.safetensors``, one shard at a time — at most
   ``max_shard_bytes`` (or the one tensor larger than that) is held in memory beyond the model's own, never a clone of
   the whole state dict;
2. ``model.safetensors.index.json`` (the weight map a sharded Hugging Face checkpoint has) is written to a temporary
   file and renamed over the previous one: a server reading the folder sees the old set or the new, never half;
3. the previous generation's shards are removed.

vLLM's loader reads the ``*.safetensors`` files the index names (the others are left out), so the folder can be handed
to ``reload_weights(weights_path=folder)`` as it is. :func:`check_reload_folder` refuses a folder an engine cannot
take as a whole model — no weights, or a tied output head stored once (what ``save_pretrained`` writes: vLLM's CPU
backend then keeps its old, repacked head) — with one line that says what to write instead.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch

MARKER = ".offpolicy-reload-folder"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 64 * 2**20


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ReloadFolder:
    """A folder the engine reloads from, written only by this class (see the module docstring).

    Args:
        path: the folder; created if missing. An existing folder must be empty or one this class made.
        max_shard_bytes: a shard is written once it holds this many bytes (a larger tensor gets a shard of its own).

    After :meth:`write`, ``peak_pending_bytes`` is the most this writer held in memory at once (the copies in the
    shard being filled): the figure the memory claim above is about.
    """

    def __init__(self, path: str | os.PathLike, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        if not (isinstance(max_shard_bytes, int) and max_shard_bytes >= 0):
            raise ValueError(f"max_shard_bytes must be an int >= 0, got {max_shard_bytes!r}")
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"reload folder {str(self.path)!r} is a file, not a folder")
        self.path.mkdir(parents=True, exist_ok=True)
        marker = self.path / MARKER
        if not marker.exists():
            others = sorted(p.name for p in self.path.iterdir())
            if others:
                raise ValueError(f"reload folder {str(self.path)!r} holds files this project did not write "
                                 f"({', '.join(others[:3])}{', …' if len(others) > 3 else ''}): a model directory is "
                                 "never written; give an empty folder (e.g. inside the run folder)")
            marker.write_text("weights written by offpolicy.rollout.weight_sync.ReloadFolder; safe to delete\n")
        self.max_shard_bytes = max_shard_bytes
        self.generation = self._current_generation()
        self.peak_pending_bytes = 0

    def _current_generation(self) -> int:
        index = self.path / INDEX
        if not index.exists():
            return 0
        return int(json.loads(index.read_text()).get("metadata", {}).get("offpolicy_generation", 0))

    def write(self, named: Iterable[tuple[str, torch.Tensor]], *, aliases: dict[str, list[str]] | None = None
              ) -> Path:
        """Write ``(name, tensor)`` pairs (consumed once, lazily: a tensor gathered or merged in place by the caller
        is copied while it is valid) as the folder's new weights; ``aliases`` maps a name to further names the same
        tensor is written under (a tied head: ``{"model.embed_tokens.weight": ["lm_head.weight"]}``). Returns the
        folder. A name given twice is refused (the engine would load one of them, unsaid which)."""
        from safetensors.torch import save_file

        generation = self.generation + 1
        weight_map: dict[str, str] = {}
        shard: dict[str, torch.Tensor] = {}
        pending = 0
        shards: list[str] = []

        def flush() -> None:
            nonlocal shard, pending
            if not shard:
                return
            name = f"w{generation}-{len(shards):05d}.safetensors"
            tmp = self.path / f".{name}.tmp"
            save_file(shard, str(tmp), metadata={"format": "pt"})
            os.replace(tmp, self.path / name)
            shards.append(name)
            for key in shard:
                weight_map[key] = name
            shard, pending = {}, 0

        aliases = aliases or {}
        for name, tensor in named:
            for key in (name, *aliases.get(name, ())):
                if key in weight_map or key in shard:
                    raise ValueError(f"reload folder: tensor {key!r} given twice")
                copy = tensor.detach().to("cpu").contiguous().clone()  # tied aliases share storage: one copy each
                if shard and pending + _nbytes(copy) > self.max_shard_bytes:
                    flush()
                shard[key] = copy
                pending += _nbytes(copy)
                self.peak_pending_bytes = max(self.peak_pending_bytes, pending)
        flush()
        if not weight_map:
            raise ValueError("reload folder: no tensor to write")
        total = sum(os.path.getsize(self.path / s) for s in shards)
        index = {"metadata": {"total_size": total, "offpolicy_generation": generation}, "weight_map": weight_map}
        tmp = self.path / f".{INDEX}.tmp"
        tmp.write_text(json.dumps(index, indent=1))
        os.replace(tmp, self.path / INDEX)
        for old in self.path.glob("w*-*.safetensors"):
            if old.name not in shards:
                old.unlink()
        self.generation = generation
        return self.path

    def write_model(self, model: torch.nn.Module) -> Path:
        """Every parameter and buffer of ``model`` under its own name, a tied output head under each of its names
        (``named_parameters`` yields it once, under the embedding's name)."""
        seen: dict[int, str] = {}
        aliases: dict[str, list[str]] = {}
        named: list[tuple[str, torch.Tensor]] = []
        for name, tensor in model.state_dict(keep_vars=True).items():
            if id(tensor) in seen:
                aliases.setdefault(seen[id(tensor)], []).append(name)
                continue
            seen[id(tensor)] = name
            named.append((name, tensor))
        with torch.no_grad():
            return self.write(iter(named), aliases=aliases)


def tensor_names(folder: str | os.PathLike) -> set[str]:
    """The tensor names a Hugging Face-style folder holds: its index's weight map, else the headers of its
    ``*.safetensors`` files (read without loading a tensor)."""
    folder = Path(folder)
    index = folder / INDEX
    if index.exists():
        return set(json.loads(index.read_text()).get("weight_map", {}))
    names: set[str] = set()
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        names.update(k for k in header if k != "__metadata__")
    return names


def check_reload_folder(folder: str | os.PathLike) -> None:
    """Refuse a folder an engine cannot reload as a whole model: none of its weights, or a config that ties the
    output head to the embedding while the head is not stored under its own name (``save_pretrained``'s layout;
    vLLM's CPU backend then keeps its previous head and answers 200)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"reload folder {str(folder)!r} is not a folder")
    names = tensor_names(folder)
    if not names:
        raise ValueError(f"reload folder {str(folder)!r} has no safetensors weights")
    config = folder / "config.json"
    tied = False
    if config.exists():
        cfg = json.loads(config.read_text())
        tied = bool(cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings", False)))
    if tied and "lm_head.weight" not in names:
        raise ValueError(f"reload folder {str(folder)!r}: its config ties the output head to the embedding and the "
                         "head is stored once (save_pretrained's layout), which leaves an engine's separate head at "
                         "its old weights; write the folder with offpolicy.rollout.weight_sync.ReloadFolder")

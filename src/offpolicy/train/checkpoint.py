"""Checkpoints: one safetensors file per save, written atomically (temp file + ``os.replace``).

A checkpoint holds everything a resumed run needs to continue *bit for bit*: model weights, optimizer state, the
ALP log σ, RNG states (torch, python ``random``, numpy when importable, extra generators such as the rollout
engine's) and the step. Tensors go in the safetensors body; non-tensor state (optimizer hyper-parameters, the python
RNG tuple) goes in its string metadata as JSON, so the file needs no pickle to load.

>>> import tempfile, torch
>>> m = torch.nn.Linear(2, 2); opt = torch.optim.AdamW(m.parameters())
>>> m(torch.ones(1, 2)).sum().backward(); opt.step()
>>> d = tempfile.mkdtemp(); path = save_checkpoint(d, step=3, model=m, optimizer=opt)
>>> m2 = torch.nn.Linear(2, 2); opt2 = torch.optim.AdamW(m2.parameters())
>>> load_checkpoint(path, model=m2, optimizer=opt2)["step"]
3
>>> torch.equal(m.weight, m2.weight), latest_checkpoint(d) == path
(True, True)
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from offpolicy.atomic_files import replacing

_NAME = re.compile(r"^step_(\d+)\.safetensors$")
_TMP = re.compile(r"^\.tmp_.*\.safetensors$")  # what a save killed between mkstemp and os.replace leaves behind


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}.safetensors"


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The highest-step ``step_*.safetensors`` in ``directory`` (None if there is none)."""
    found = checkpoint_files(directory)
    return found[-1] if found else None


def checkpoint_files(directory: str | Path) -> list[Path]:
    """Every complete ``step_*.safetensors`` in ``directory``, lowest step first (empty if there is none)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), d / f) for f in os.listdir(d) if (m := _NAME.match(f))]
    return [p for _, p in sorted(found)]


def temp_files(directory: str | Path) -> list[Path]:
    """Leftover ``.tmp_*.safetensors`` of saves that were killed mid-write (never a usable checkpoint)."""
    d = Path(directory)
    return [d / f for f in sorted(os.listdir(d)) if _TMP.match(f)] if d.is_dir() else []


def _unique_tensors(state: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    # safetensors refuses tensors that share storage (tied embeddings): store an independent contiguous copy each.
    return {f"{prefix}{k}": v.detach().to("cpu").contiguous().clone() for k, v in state.items()}


def _optimizer_to_flat(opt: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
    sd = opt.state_dict()
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, st in sd["state"].items():
        for key, value in st.items():
            if isinstance(value, Tensor):
                tensors[f"optim.{pid}.{key}"] = value.detach().to("cpu").contiguous().clone()
            else:
                scalars.setdefault(str(pid), {})[key] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_from_flat(tensors: dict[str, Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if name.startswith("optim."):
            _, pid, key = name.split(".", 2)
            state.setdefault(int(pid), {})[key] = value
    for pid, extra in meta.get("scalars", {}).items():
        state.setdefault(int(pid), {}).update(extra)
    return {"state": state, "param_groups": meta["param_groups"]}


def rng_state(generators: dict[str, torch.Generator] | None = None) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Snapshot of every RNG a run uses: tensors (torch CPU/CUDA, extra generators) and JSON-able metadata."""
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    for name, g in (generators or {}).items():
        tensors[f"rng.gen.{name}"] = g.get_state()
    meta: dict[str, Any] = {"python": _to_json(random.getstate())}
    try:
        import numpy as np

        state: Any = np.random.get_state()  # the legacy tuple (numpy's stubs also allow its dict form)
        kind, keys, pos, has_gauss, gauss = state
        tensors["rng.numpy.keys"] = torch.from_numpy(keys.astype("int64"))
        meta["numpy"] = [kind, int(pos), int(has_gauss), float(gauss)]
    except ImportError:  # numpy is optional
        pass
    return tensors, meta


def set_rng_state(tensors: dict[str, Tensor], meta: dict[str, Any], generators: dict[str, torch.Generator] | None = None) -> None:
    """Restore what :func:`rng_state` captured (missing entries are left alone)."""
    if "rng.torch" in tensors:
        torch.set_rng_state(tensors["rng.torch"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted(k for k in tensors if k.startswith("rng.cuda."))]
        if states:
            torch.cuda.set_rng_state_all(states)
    for name, g in (generators or {}).items():
        if f"rng.gen.{name}" in tensors:
            g.set_state(tensors[f"rng.gen.{name}"])
    if "python" in meta:
        random.setstate(_from_json(meta["python"]))
    if "numpy" in meta and "rng.numpy.keys" in tensors:
        import numpy as np

        kind, pos, has_gauss, gauss = meta["numpy"]
        np.random.set_state((kind, tensors["rng.numpy.keys"].numpy().astype("uint32"), pos, has_gauss, gauss))


def _to_json(x: Any) -> Any:
    return [_to_json(v) for v in x] if isinstance(x, (tuple, list)) else x


def _from_json(x: Any) -> Any:
    return tuple(_from_json(v) for v in x) if isinstance(x, list) else x


def save_checkpoint(
    directory: str | Path,
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra_modules: dict[str, nn.Module] | None = None,
    generators: dict[str, torch.Generator] | None = None,
    extra_tensors: dict[str, Tensor] | None = None,
    metadata: dict[str, Any] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Write ``directory/step_XXXXXXXX.safetensors`` atomically and return its path.

    ``extra_modules`` (e.g. ``{"alp": alp}``) are stored under their name; ``generators`` (e.g. the rollout engine's)
    are saved with the global RNG states; ``metadata`` must be JSON-serialisable. ``keep_last`` prunes older files.
    """
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = _unique_tensors(model.state_dict(), "model.")
    for name, module in (extra_modules or {}).items():
        tensors.update(_unique_tensors(module.state_dict(), f"module.{name}."))
    meta: dict[str, Any] = {"step": step, "user": metadata or {}}
    if optimizer is not None:
        t, m = _optimizer_to_flat(optimizer)
        tensors.update(t)
        meta["optimizer"] = m
    t, m = rng_state(generators)
    tensors.update(t)
    meta["rng"] = m
    for name, value in (extra_tensors or {}).items():
        tensors[f"extra.{name}"] = value.detach().to("cpu").contiguous().clone()
    target = checkpoint_path(d, step)
    # a crash leaves either the old file or the new one, never half (a killed save: a .tmp_*.safetensors leftover)
    with replacing(target, prefix=".tmp_", suffix=".safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"offpolicy": json.dumps(meta)})
    if keep_last is not None and keep_last > 0:
        olds = sorted((p for p in d.glob("step_*.safetensors") if _NAME.match(p.name)), key=lambda p: p.name)
        for old in olds[:-keep_last]:
            if old != target:
                old.unlink(missing_ok=True)
    return target


def _unreadable(p: Path, err: BaseException) -> ValueError:
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    return ValueError(f"checkpoint {str(p)!r} cannot be read (corrupt or truncated?): {first}")


def read_checkpoint_info(path: str | Path) -> dict[str, Any]:
    """The JSON header of a checkpoint (``step``, ``user`` metadata, …) without loading any tensor.

    Raises ``ValueError`` naming ``path`` when the file is missing, unreadable (a truncated or corrupt file raises
    safetensors' own ``SafetensorError``, which names no file) or not an offpolicy checkpoint.
    """
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"checkpoint path {str(p)!r} does not exist")
    try:
        with safe_open(str(p), framework="pt") as f:
            header = (f.metadata() or {}).get("offpolicy")
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise _unreadable(p, err) from None
    if header is None:
        raise ValueError(f"checkpoint path {str(p)!r} is not an offpolicy checkpoint (no metadata)")
    try:
        meta = json.loads(header)
        int(meta["step"])
    except (ValueError, KeyError, TypeError) as err:
        raise _unreadable(p, err) from None
    return meta


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra_modules: dict[str, nn.Module] | None = None,
    generators: dict[str, torch.Generator] | None = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint into the given objects; returns ``{"step", "metadata", "extra"}``.

    Raises ``ValueError`` naming ``path`` when the file is missing, corrupt or truncated, not an offpolicy
    checkpoint, or written for a model of another shape.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    meta = read_checkpoint_info(p)
    try:
        tensors = load_file(str(p))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:  # header fine, body truncated
        raise _unreadable(p, err) from None
    device = next(iter(model.parameters())).device

    def sub(prefix: str) -> dict[str, Tensor]:
        return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}

    try:
        model.load_state_dict({k: v.to(device) for k, v in sub("model.").items()})
        for name, module in (extra_modules or {}).items():
            module.load_state_dict({k: v.to(device) for k, v in sub(f"module.{name}.").items()})
    except RuntimeError as err:  # torch lists every missing / mismatched key: keep the start of it
        gist = " ".join(str(err).split())
        gist = gist if len(gist) <= 200 else gist[:200] + " …"
        raise ValueError(f"checkpoint {str(p)!r} does not fit this model (another model.path or model.tiny_config?): "
                         f"{gist}") from None
    if optimizer is not None:
        if "optimizer" not in meta:
            raise ValueError(f"checkpoint path {str(p)!r} has no optimizer state")
        optimizer.load_state_dict(_optimizer_from_flat(tensors, meta["optimizer"]))
    if restore_rng:
        set_rng_state(tensors, meta.get("rng", {}), generators)
    return {"step": meta["step"], "metadata": meta.get("user", {}), "extra": sub("extra.")}

"""A resumed run keeps its method's settings unless the user names the ones that may change — for every host.

Each host (the reference trainer, TRL, verl) stores the settings of its recipe — every setting of the correction,
objective and transforms and their thresholds, flattened to dotted keys (``algorithm.is_upper``,
``correction.upper``, ``correction[1].delta``), not logging options — with each checkpoint, and on resume compares
them with the run's own (:func:`check_resume`). A difference is refused in one line naming each key with both
values and how to allow it; an allowed difference (the host's explicit option naming the keys) is appended to the
run folder's record of changes (:func:`record_changes`, one JSON line per key: step, key, old, new), written
atomically as the run folder's other files are (temp file + ``os.replace``).

>>> check_resume({"a.x": 3.0}, {"a.x": 2.0}, allowed=(), where="--resume runs/x", step=40,
...              allow_hint=lambda keys: "pass " + " ".join(f"--allow-changed {k}" for k in keys))
Traceback (most recent call last):
...
ValueError: --resume runs/x: a.x is 3.0 here but 2.0 in the checkpoint (step 40); pass --allow-changed a.x to resume with the new value
>>> check_resume({"a.x": 3.0}, {"a.x": 2.0}, allowed=("a",), where="w", step=40, allow_hint=str)
[{'key': 'a.x', 'old': 2.0, 'new': 3.0}]
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from offpolicy.atomic_files import write_atomic

SETTINGS_FILE = "offpolicy_settings.json"  # beside a TRL / verl checkpoint: the recipe it was trained with
CHANGES_FILE = "offpolicy_settings_changes.jsonl"  # in the run folder: every allowed change, one line per key

_UNSET = object()


def jsonable(value: Any) -> Any:
    """``value`` as JSON stores it (tuples → lists; an object JSON cannot hold → its repr), so that a stored setting
    and a live one compare equal when they are."""
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a nested mapping: ``{"a": {"b": 1}}`` → ``{"a.b": 1}``; a list holding mappings gives
    ``key[i].…``; any other list is one value.

    >>> flatten({"correction": [{"name": "tis", "upper": 2.0}, {"name": "opsm"}], "alp": {"layers": [0, 1]}})
    {'correction[0].name': 'tis', 'correction[0].upper': 2.0, 'correction[1].name': 'opsm', 'alp.layers': [0, 1]}
    """
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        elif isinstance(value, (list, tuple)) and any(isinstance(v, Mapping) for v in value):
            for i, item in enumerate(value):
                if isinstance(item, Mapping):
                    out.update(flatten(item, f"{name}[{i}]."))
                else:
                    out[f"{name}[{i}]"] = jsonable(item)
        else:
            out[name] = jsonable(value)
    return out


def correction_settings(correction: Any, key: str = "correction") -> dict[str, Any]:
    """A built correction's effective parameters (defaults included) under ``key``: ``correction.name``,
    ``correction.upper`` …; a chain's parts as ``correction[i].…``; None → ``{key: None}``."""
    if correction is None:
        return {key: None}
    parts = getattr(correction, "parts", ())
    items = [{"name": c.name, **c.config} for c in parts] if parts else {"name": correction.name, **correction.config}
    return flatten({key: items})


def covers(allowed: str, key: str) -> bool:
    """Whether the allowed name ``allowed`` covers ``key``: the key itself or a section above it (``correction``
    covers ``correction.upper`` and ``correction[1].delta``)."""
    return key == allowed or key.startswith(allowed + ".") or key.startswith(allowed + "[")


def _shown(value: Any) -> str:
    return "unset" if value is _UNSET else repr(value)


def check_resume(here: Mapping[str, Any], stored: Mapping[str, Any], *, allowed: Iterable[str], where: str,
                 step: int | None, allow_hint: Callable[[list[str]], str]) -> list[dict[str, Any]]:
    """The differences between the run's settings ``here`` and the checkpoint's ``stored`` (flat, JSON values) that
    ``allowed`` names, as ``[{"key", "old", "new"}]`` (``None`` for a key one side lacks); a ``ValueError`` naming
    each other difference with both values, ``where`` (the checkpoint as the user named it) and ``step``, ending with
    ``allow_hint(keys)`` (the host's own way to allow them). An allowed name that is no setting is refused too (a
    typo would otherwise allow nothing, silently)."""
    allowed = list(allowed)
    keys = sorted(set(here) | set(stored))
    for name in allowed:
        if not any(covers(name, k) for k in keys):
            raise ValueError(f"{where}: {name!r} is not a setting a resume compares; settings: {', '.join(keys)}")
    changed = [k for k in keys if jsonable(here.get(k, _UNSET)) != stored.get(k, _UNSET)]
    refused = [k for k in changed if not any(covers(a, k) for a in allowed)]
    if refused:
        at = f" (step {step})" if step is not None else ""
        what = ", ".join(f"{k} is {_shown(here.get(k, _UNSET))} here but {_shown(stored.get(k, _UNSET))} in the "
                         "checkpoint" for k in refused)
        plural = "s" if len(refused) > 1 else ""
        raise ValueError(f"{where}: {what}{at}; {allow_hint(refused)} to resume with the new value{plural}")
    return [{"key": k, "old": stored.get(k), "new": jsonable(here.get(k))} for k in changed]


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """``obj`` as JSON at ``path``, atomically: a crash leaves the old file or the new one, never half."""
    _replace(Path(path), (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def read_settings(path: str | Path) -> dict[str, Any] | None:
    """The settings stored at ``path`` (None when there is no such file: a checkpoint written without them).
    Raises ``ValueError`` naming the file when it is not a JSON mapping."""
    p = Path(path)
    if not p.is_file():
        return None
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{str(p)!r} cannot be read: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{str(p)!r} must hold a JSON mapping of settings, got {type(data).__name__}")
    return data


def record_changes(path: str | Path, changes: list[dict[str, Any]], *, step: int | None, checkpoint: str) -> None:
    """Append one JSON line per change (``step``, ``key``, ``old``, ``new``, ``checkpoint``, ``time``) to ``path``:
    the earlier lines and the new ones are written to a temp file that replaces ``path`` (never a half line)."""
    if not changes:
        return
    p = Path(path)
    earlier = p.read_bytes() if p.is_file() else b""
    if earlier and not earlier.endswith(b"\n"):
        earlier += b"\n"
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    lines = "".join(json.dumps({"step": step, **c, "checkpoint": checkpoint, "time": stamp}) + "\n" for c in changes)
    _replace(p, earlier + lines.encode())


def read_changes(path: str | Path) -> list[dict[str, Any]]:
    """The rows :func:`record_changes` wrote (empty when there is no record)."""
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


def _replace(path: Path, data: bytes) -> None:
    write_atomic(path, data, prefix=".tmp_", suffix=path.suffix)


__all__ = ["CHANGES_FILE", "SETTINGS_FILE", "check_resume", "correction_settings", "covers", "flatten", "jsonable",
           "read_changes", "read_settings", "record_changes", "write_json_atomic"]

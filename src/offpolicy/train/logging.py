"""Per-step metric logging: one host sync per step, JSONL always, TensorBoard when importable.

The trainer collects 0-d metric tensors from the corrections, the loss and the diagnostics all step long without
touching the host; :func:`to_floats` stacks them and syncs once. Non-finite values are kept as ``null`` in JSON
(never dropped: a NaN metric is a finding).

>>> to_floats({"a": torch.tensor(1.5), "b": torch.tensor(float("nan")), "c": 2})
{'a': 1.5, 'b': nan, 'c': 2.0}
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


def to_floats(metrics: dict[str, Any]) -> dict[str, float]:
    """0-d tensors / numbers → python floats with a single device→host transfer."""
    names = list(metrics)
    tensors = [torch.as_tensor(metrics[k], dtype=torch.float32).detach().reshape(()) for k in names]
    if not tensors:
        return {}
    values = torch.stack([t.to(tensors[0].device) for t in tensors]).cpu().tolist()
    return dict(zip(names, (float(v) for v in values)))


def _json_safe(value: float) -> float | None:
    return value if math.isfinite(value) else None


class MetricLogger:
    """Append one JSON line per logged step to ``out_dir/metrics.jsonl`` and mirror it to TensorBoard.

    ``tensorboard=True`` silently degrades to JSONL only when ``torch.utils.tensorboard`` (the ``tensorboard``
    package) is missing.
    """

    def __init__(self, out_dir: str | Path, *, tensorboard: bool = True, filename: str = "metrics.jsonl") -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / filename
        self._file = self.path.open("a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.dir / "tensorboard"))
            except Exception:  # tensorboard not installed (or broken): JSONL is the source of truth anyway
                self._tb = None

    @property
    def has_tensorboard(self) -> bool:
        return self._tb is not None

    def log(self, step: int, metrics: dict[str, Tensor | float]) -> dict[str, float]:
        """Sync ``metrics`` once, write them, and return the floats."""
        floats = to_floats(metrics)
        record = {"step": step, **{k: _json_safe(v) for k, v in floats.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in floats.items():
                if math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        return floats

    def truncate_after(self, step: int) -> None:
        """Drop lines with ``step`` > the given one (a resumed run rewrites the steps after its checkpoint).

        A half-written last line (a killed run) is dropped with a warning, see :func:`read_metrics`.
        """
        self._file.close()
        kept = [ln for ln, row in _parse_lines(self.path) if row.get("step", 0) <= step]
        self.path.write_text("".join(ln + "\n" for ln in kept), encoding="utf-8")
        self._file = self.path.open("a", encoding="utf-8")

    def reset(self) -> None:
        """Start an empty log (a fresh run replaces an earlier run's file; its content is not even parsed)."""
        self._file.close()
        self.path.write_text("", encoding="utf-8")
        self._file = self.path.open("a", encoding="utf-8")

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()


def _parse_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(line, record)`` for each non-blank line of a metrics file.

    A killed run can leave its last line half-written: that one line is skipped with a warning naming the file. An
    unparsable line anywhere else means the file is damaged: ``ValueError`` naming the file and the line number.
    """
    try:  # errors="replace": a cut multi-byte character must not raise a UnicodeDecodeError that names no file
        lines = [(i, ln) for i, ln in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
                 if ln.strip()]
    except OSError as err:
        raise ValueError(f"metrics file {str(path)!r} cannot be read: {err.strerror or err}") from None
    out = []
    for k, (number, line) in enumerate(lines):
        try:
            record = json.loads(line)
            problem = None if isinstance(record, dict) else f"a JSON {type(record).__name__}, not an object"
        except json.JSONDecodeError as err:
            problem = str(err)
        if problem is None:
            out.append((line, record))
        elif k == len(lines) - 1:
            warnings.warn(f"metrics file {str(path)!r}: ignoring its last line {number}, which is incomplete "
                          "(left by a killed run?)", stacklevel=3)
        else:
            raise ValueError(f"metrics file {str(path)!r}, line {number}: not a JSON record ({problem})")
    return out


def read_metrics(path: str | Path) -> list[dict[str, float | None]]:
    """Read a ``metrics.jsonl`` back (one dict per step); a half-written last line is skipped with a warning.

    Raises ``ValueError`` naming the file (and the line) when it cannot be read or a line before the last is damaged.
    """
    return [row for _, row in _parse_lines(Path(path))]

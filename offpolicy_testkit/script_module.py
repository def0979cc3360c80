"""A repository script (benchmarks/, scripts/) loaded as a module by its path, for the tests that call its functions
(those folders are not packages)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """``relative`` (e.g. ``"benchmarks/param_check_cost.py"``, from the repository root) executed as a module."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"load_script: {relative!r} is not a Python file under {ROOT}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

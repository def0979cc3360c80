"""The JSON record an overhead benchmark writes (``--json``): its arguments, the load averages, every repeat's
numbers and the table the docs quote — written atomically, so a page never reads half a record."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_record(path: str | os.PathLike, args: Any, loads: list[float], runs: Any, table: Any) -> None:
    """``{"args", "loads", "runs", "table"}`` to ``path`` through a temporary file renamed into place."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"args": vars(args), "loads": loads, "runs": runs, "table": table}, indent=1))
    os.replace(tmp, target)

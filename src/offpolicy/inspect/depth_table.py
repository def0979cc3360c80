"""``python -m offpolicy.inspect.depth_table REPORT.json …``: the mismatch by depth of several inspections (the
``by_position`` part of each ``report.json``, :mod:`offpolicy.inspect.depth`) as one Markdown table, a row per engine
and position bin — e.g. the transformers engine's bf16, llama.cpp's and vLLM's profiles on the same task::

    offpolicy inspect --model DIR --task T --ignore-eos --max-new-tokens N --rollout backend=vllm --out depth/vllm
    python -m offpolicy.inspect.depth_table depth/*/report.json
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from offpolicy.inspect.depth import TABLE_STATS


def depth_table(summaries: dict[str, dict[str, Any]]) -> str:
    """A Markdown table of several inspections' profiles: one row per engine and bin (``summaries``: label → the
    ``report.json`` dict)."""
    lines = ["| engine | positions | tokens | " + " | ".join(label for _, label, _ in TABLE_STATS) + " |",
             "|---|---|---|" + "---|" * len(TABLE_STATS)]
    for label, summary in summaries.items():
        depth = summary.get("by_position")
        if not depth:
            continue
        for i, (lo, hi) in enumerate(zip(depth["edges"][:-1], depth["edges"][1:])):
            if depth["tokens"][i] == 0:
                continue
            cells = []
            for name, _, fmt in TABLE_STATS:
                value = None if depth.get(name) is None else depth[name][i]
                cells.append("–" if value is None or not math.isfinite(value) else fmt.format(value))
            lines.append(f"| {label} | {lo}–{hi - 1} | {depth['tokens'][i]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _engine_label(summary: dict[str, Any], path: Path) -> str:
    meta = summary.get("meta") or {}
    return (meta.get("rollout") or {}).get("description") or path.parent.name


def main(argv: list[str] | None = None) -> int:
    """``python -m offpolicy.inspect.depth REPORT.json …``: the profiles of several inspections as one table."""
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print(__doc__)
        return 2
    summaries = {}
    for p in paths:
        summary = json.loads(p.read_text())
        if "by_position" not in summary:
            raise ValueError(f"{p}: no by_position in this report (written by an older offpolicy inspect?)")
        summaries[f"{_engine_label(summary, p)} ({p.parent.name})"] = summary
    sys.stdout.write(depth_table(summaries))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

"""The tables of the docs that the code can write: methods, presets, the version matrix and the metrics glossary.

A page holds a block between two markers::

    <!-- generated: presets -->
    ... (rewritten) ...
    <!-- end generated -->

``python docs/_ext/generated.py`` rewrites every block of README.md and docs/**.md from the code
(:mod:`offpolicy.catalog`, :data:`offpolicy.train.presets.PRESETS`, :mod:`offpolicy.integrations.versions`,
:mod:`offpolicy.glossary`); ``--check`` only reports the pages whose blocks are out of date (exit 1), which is what
tests/test_docs_generated.py asserts. A block may take one argument, ``prefix=PATH``: where the method pages are,
relative to the page (README.md: ``docs/methods/``).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"(<!-- generated: (\w+)((?: \w+=\S+)*) -->\n)(.*?)(<!-- end generated -->)", re.S)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def methods(prefix: str = "") -> str:
    from offpolicy.catalog import methods_table

    return methods_table(prefix)


def presets(prefix: str = "") -> str:
    from offpolicy.train.presets import PRESETS, AlgorithmDefaults, chain_specs

    rows = ["| preset | what it does | corrections at the defaults | objective | the trainer also computes |",
            "|---|---|---|---|---|"]
    for p in PRESETS.values():
        specs = chain_specs(p, AlgorithmDefaults())
        chain = ", ".join(_spec(s) for s in specs) or "none"
        extras = [x for x, on in (("min-p constrained log-probs", p.minp), ("exact KL from the logits", p.divergence),
                                  ("layerwise noise (ALP)", p.alp),
                                  (f"the centred score ({p.score_centering})", p.score_centering is not None)) if on]
        objective = p.objective + (f", dual clip {p.dual_clip:g}" if p.dual_clip else "")
        rows.append(f"| `{p.name}` | {_cell(p.description)} | {_cell(chain)} | {objective} | "
                    f"{', '.join(extras) or '–'} |")
    return "\n".join(rows)


def _spec(spec: dict) -> str:
    params = ", ".join(f"{k}={v}" for k, v in spec.items() if k != "name")
    return f"`{spec['name']}`" + (f" ({params})" if params else "")


def versions(prefix: str = "") -> str:
    from offpolicy.integrations.versions import VERSIONS

    rows = ["| package | supported (a warning outside) | tested | what depends on it |", "|---|---|---|---|"]
    for v in VERSIONS.values():
        rows.append(f"| {v.package} | `{v.range}` | {v.tested} | {_cell(v.where)} |")
    return "\n".join(rows)


def glossary_diagnostics(prefix: str = "") -> str:
    from offpolicy.glossary import DIAGNOSTICS
    from offpolicy.metrics import NAMINGS

    header = {"swift": "the trainer (default), ms-swift", "verl": "verl", "trl": "TRL", "openrlhf": "OpenRLHF",
              "tinker": "Tinker"}
    rows = ["| metric | meaning | measured here |", "|---|---|---|"]
    for name, (means, measured) in DIAGNOSTICS.items():
        rows.append(f"| **{name}** | {_cell(means)} | {_cell(measured) or '–'} |")
    rows += ["", "Each framework's key is its prefix and the metric's name, except where it has a name of its own:", "",
             "| naming | prefix | its own names |", "|---|---|---|"]
    for naming, n in NAMINGS.items():
        own = ", ".join(f"{k} → `{n.prefix}{v}`" for k, v in n.renames.items()) or "–"
        rows.append(f"| {header.get(naming, naming)} (`{naming}`) | `{n.prefix}` | {_cell(own)} |")
    return "\n".join(rows)


def glossary_entries(prefix: str = "") -> str:
    from offpolicy.glossary import ENTRIES, IS_NAMES, KL_MODES

    rows = ["| key | logged by | meaning | measured here |", "|---|---|---|---|"]
    for e in ENTRIES:
        key = e.key.replace("inspect:", "report.json: ")
        rows.append(f"| `{key}` | {e.logged_by} | {_cell(e.means)} | {_cell(e.measured) or '–'} |")
    rows.append("")
    rows.append(f"`<is>` is one of {', '.join(f'`{n}`' for n in IS_NAMES)}; `<kl_mode>` one of "
                f"{', '.join(f'`{n}`' for n in KL_MODES)}; `<layer>` a layer index; `<bin>` a position bin "
                "(`pos00008-00015`). The TRL trainer logs every trainer key above under `offpolicy/` "
                "(`offpolicy/tis/clipped_frac`); verl's driver logs a correction's own keys under `rollout_corr/`.")
    return "\n".join(rows)


def _num(x) -> str:
    return "–" if x is None else f"{x:.2g}"


def sync_check(prefix: str = "") -> str:
    """The sync check against live vLLM, from the JSONs ``benchmarks/sync_check_table.py`` wrote
    (docs/data/sync_check/*.json): false alarms over healthy syncs, detection delays, costs."""
    import json

    rows = ["| model (V) | engine | lr | healthy syncs | false alarms | gap: baseline ± se → threshold | "
            "no-op sync | tied head left | last layer left | wrong dtype | check / push s |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for path in sorted((ROOT / "docs" / "data" / "sync_check").glob("*.json")):
        run = json.loads(path.read_text())
        for row in run["settings"]:
            det = row["detection"]

            def delay(mode: str, det=det, row=row) -> str:
                d = det.get(mode, {})
                return (f"{d['syncs']} ({d['caught_by']})" if d.get("syncs") else
                        f"not in {row.get('max_delay', '?')}")

            rows.append(f"| {run['model']} ({run['vocab']:,}) | vLLM {run['dtype']} | {row['lr']:g} | "
                        f"{row['healthy']} | {row['false_alarms']} | {_num(row['baseline'])} ± "
                        f"{_num(row['standard_error'])} → {_num(row['threshold'])} | {delay('noop')} | "
                        f"{delay('head')} | {delay('layer')} | {delay('dtype')} | "
                        f"{row['check_s_median']:.2f} / {row['push_s_median']:.2f} |")
    return "\n".join(rows)


BLOCKS: dict[str, Callable[..., str]] = {
    "sync_check": sync_check,
    "methods": methods,
    "presets": presets,
    "versions": versions,
    "glossary_diagnostics": glossary_diagnostics,
    "glossary_entries": glossary_entries,
}


def render(text: str) -> str:
    """``text`` with every generated block rewritten."""

    def repl(match: re.Match[str]) -> str:
        name, args = match.group(2), dict(a.split("=", 1) for a in match.group(3).split())
        if name not in BLOCKS:
            raise ValueError(f"unknown generated block {name!r}; known: {', '.join(BLOCKS)}")
        return f"{match.group(1)}{BLOCKS[name](**args)}\n{match.group(5)}"

    return BLOCK.sub(repl, text)


def pages(root: Path = ROOT) -> list[Path]:
    """README.md and every docs page that holds a generated block."""
    found = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    return [p for p in found if p.is_file() and "<!-- generated: " in p.read_text(encoding="utf-8")]


def stale(root: Path = ROOT) -> list[Path]:
    """The pages whose blocks differ from what the code generates."""
    return [p for p in pages(root) if render(p.read_text(encoding="utf-8")) != p.read_text(encoding="utf-8")]


def main(argv: list[str]) -> int:
    if "--check" in argv:
        out = stale()
        for p in out:
            print(f"{p.relative_to(ROOT)}: generated tables out of date (python docs/_ext/generated.py)")
        return 1 if out else 0
    for p in pages():
        text = p.read_text(encoding="utf-8")
        new = render(text)
        if new != text:
            p.write_text(new, encoding="utf-8")
            print(f"rewrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Draw the import graph of src/offpolicy by layer: one row per layer of the import contract (bottom row: kernels and
formulas), one dot per module, downward imports grey, upward imports red, imports inside a cycle orange; prints the
counts (modules, layers, upward imports, cycles).

    PYTHONPATH=. python scripts/module_graph.py                   # docs/img/module_graph.png
    PYTHONPATH=. python scripts/module_graph.py --src /tmp/old/src/offpolicy --out /tmp/before.png   # another tree

From the repository root, with the root on the path: the graph reader is offpolicy_testkit/import_graph.py. The layer table is the one
tests/test_import_contract.py asserts, read from that file as data (``LAYERS`` and ``KNOWN_UPWARD`` are literals): one
table, and no test module imported.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

from offpolicy_testkit.import_graph import build_graph, layer_of, strongly_connected, upward_edges

ROOT = Path(__file__).resolve().parents[1]


def contract_tables(test_file: Path) -> tuple[list[tuple[str, list[str]]], set[tuple[str, str]]]:
    """``LAYERS`` and the keys of ``KNOWN_UPWARD`` from the contract test's source (``ast.literal_eval``)."""
    values = {}
    for node in ast.parse(test_file.read_text(encoding="utf-8")).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id in ("LAYERS", "KNOWN_UPWARD") and node.value is not None:
            values[target.id] = ast.literal_eval(node.value)
    return values["LAYERS"], set(values.get("KNOWN_UPWARD", {}))


def main(argv: list[str] | None = None) -> dict[str, int]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, default=ROOT / "src" / "offpolicy")
    ap.add_argument("--contract", type=Path, default=ROOT / "tests" / "test_import_contract.py")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "module_graph.png")
    a = ap.parse_args(argv)
    layers, known = contract_tables(a.contract)
    graph = build_graph(a.src)
    adj = graph.adjacency()
    cycles = strongly_connected(adj)
    in_cycle = {m: i for i, c in enumerate(cycles) for m in c}
    up = upward_edges(graph.edges, layers)
    rows: dict[int, list[str]] = {}
    for m in sorted(graph.modules):
        rows.setdefault(-1 if (i := layer_of(m, layers)) is None else i, []).append(m)
    counts = {"modules": len(graph.modules), "edges": len({(e.source, e.target) for e in graph.edges}),
              "layers": len(layers), "upward_imports": len({(e.source, e.target) for e in up}),
              "upward_not_listed": len({(e.source, e.target) for e in up} - known),
              "cycles": len(cycles), "modules_in_cycles": len(in_cycle), "unlayered": len(rows.get(-1, []))}

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = max(len(ms) for ms in rows.values())
    pos = {}
    for i, ms in rows.items():
        for j, m in enumerate(ms):  # centred rows, spread to the widest
            pos[m] = ((j + 0.5) * width / len(ms), float(i))
    fig, ax = plt.subplots(figsize=(max(12.0, width * 0.42), 2.2 * (len(layers) + 1)))
    pairs = {(e.source, e.target) for e in graph.edges}
    up_pairs = {(e.source, e.target) for e in up}
    for s, t in sorted(pairs):
        (x0, y0), (x1, y1) = pos[s], pos[t]
        cyclic = s in in_cycle and in_cycle.get(s) == in_cycle.get(t)
        if (s, t) in up_pairs or cyclic:
            ax.annotate("", (x1, y1), (x0, y0), zorder=3, arrowprops={
                "arrowstyle": "-|>", "color": "red" if (s, t) in up_pairs else "darkorange", "lw": 1.6,
                "connectionstyle": "arc3,rad=0.25", "shrinkA": 3, "shrinkB": 3})
        else:
            ax.plot([x0, x1], [y0, y1], color="0.6", lw=0.4, alpha=0.35, zorder=1)
    for m, (x, y) in pos.items():
        ax.plot(x, y, "o", ms=4, color="darkorange" if m in in_cycle else "tab:blue", zorder=4)
        ax.text(x, y + 0.06, m.removeprefix("offpolicy.") if m != "offpolicy" else "offpolicy (__init__)",
                rotation=55, fontsize=6.5, ha="left", va="bottom", zorder=5)
    ax.set_yticks(range(len(layers)), [name for name, _ in layers], fontsize=10)
    ax.set_ylim(-0.5 if -1 not in rows else -1.5, len(layers) - 0.1)
    ax.set_xlim(-0.5, width + 2)
    ax.set_xticks([])
    for spine in ("top", "right", "bottom"):
        ax.spines[spine].set_visible(False)
    ax.set_title(f"src/offpolicy: {counts['modules']} modules, {counts['edges']} imports, "
                 f"{counts['upward_imports']} upward (red), {counts['cycles']} cycle(s) (orange)", fontsize=12)
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(" ".join(f"{k}={v}" for k, v in counts.items()), "→", a.out)
    for e in sorted(up, key=lambda e: (e.source, e.target)):
        print(f"  upward: {e.source} → {e.target} (line {e.line}{', in a function' if e.local else ''})")
    return counts


if __name__ == "__main__":
    main()

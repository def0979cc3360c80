"""The import graph of a package's source tree, read with ``ast`` (nothing is imported), and the checks of the import
contract that tests/test_import_contract.py asserts and scripts/module_graph.py draws.

An edge ``a → b`` is any ``import`` / ``from … import`` in module ``a`` — at module level or inside a function — that
names module ``b`` of the same package. Imports under ``if TYPE_CHECKING:`` are left out: they never run. A
function-local import counts: it runs whenever the function does, so a cycle dodged by one is still a cycle.
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg`` (its ``__init__``); the
implicit import of a parent package's ``__init__`` is not an edge (every module would import the root otherwise).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``line``; ``local``: the import sits inside a function."""

    source: str
    target: str
    line: int
    local: bool


@dataclass
class ImportGraph:
    """Modules (dotted names), their files' line counts and docstrings, and the edges between them."""

    modules: dict[str, Path] = field(default_factory=dict)
    lines: dict[str, int] = field(default_factory=dict)
    docstrings: dict[str, str] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)

    def adjacency(self) -> dict[str, set[str]]:
        adj: dict[str, set[str]] = {m: set() for m in self.modules}
        for e in self.edges:
            adj.setdefault(e.source, set()).add(e.target)
        return adj


def module_name(path: Path, root: Path) -> str:
    """``root/pkg/sub/mod.py`` → ``pkg.sub.mod``; ``…/__init__.py`` → the package's name (``root`` holds ``pkg``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    """Collects (dotted target, imported names, line, inside a function) for every import that can run."""

    def __init__(self, module: str, is_package: bool):
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[tuple[str, list[str], int, bool]] = []
        self.depth = 0

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:  # the `else:` branch of `if TYPE_CHECKING:` does run
                self.visit(child)
            return
        self.generic_visit(node)

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((alias.name, [], node.lineno, self.depth > 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:  # relative: `from . import x` / `from ..a import b`
            anchor = self.package.split(".")
            anchor = anchor[:len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        self.found.append((base, [a.name for a in node.names], node.lineno, self.depth > 0))


def _resolve(name: str, modules: Mapping[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is a module of the graph (``a.b.C`` → ``a.b``), or None."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def build_graph(package_dir: str | Path) -> ImportGraph:
    """The import graph of every ``.py`` file under ``package_dir`` (a package folder, e.g. ``src/offpolicy``)."""
    package_dir = Path(package_dir)
    root = package_dir.parent
    graph = ImportGraph()
    trees = {}
    for path in sorted(package_dir.rglob("*.py")):
        name = module_name(path, root)
        graph.modules[name] = path
        text = path.read_text(encoding="utf-8")
        graph.lines[name] = len(text.splitlines())
        tree = ast.parse(text, filename=str(path))
        graph.docstrings[name] = ast.get_docstring(tree) or ""
        trees[name] = (tree, path.name == "__init__.py")
    for name, (tree, is_package) in trees.items():
        visitor = _Imports(name, is_package)
        visitor.visit(tree)
        seen = set()
        for base, names, line, local in visitor.found:
            targets = []
            for imported in names:
                if f"{base}.{imported}" in graph.modules:  # `from pkg import submodule`
                    targets.append(f"{base}.{imported}")
                else:
                    targets.append(_resolve(base, graph.modules))
            if not names:
                targets.append(_resolve(base, graph.modules))
            for target in targets:
                if target is None or target == name or (target, line) in seen:
                    continue
                seen.add((target, line))
                graph.edges.append(Edge(name, target, line, local))
    return graph


def strongly_connected(adj: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (each an import cycle), sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # recursion depth ≤ number of modules (~150)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in adj.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(adj):
        if v not in index:
            visit(v)
    return sorted(components)


def one_cycle(adj: Mapping[str, Iterable[str]], component: Sequence[str]) -> list[str]:
    """One import cycle through the first module of ``component``: ``[a, b, …, a]`` (for error messages)."""
    members = set(component)
    start = component[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth-first inside the component, back to the start
        nxt = []
        for v in frontier:
            for w in sorted(adj.get(v, ())):
                if w not in members:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]  # start → … → v → start
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return list(component)


def _matches(module: str, pattern: str) -> bool:
    if pattern.endswith(".*"):  # a package and everything in it
        package = pattern[:-2]
        return module == package or module.startswith(package + ".")
    return module == pattern


def layer_of(module: str, layers: Sequence[tuple[str, Sequence[str]]]) -> int | None:
    """The index of the layer holding ``module``: patterns are a module's name (``a.b``: that module only) or a package
    and everything in it (``a.b.*``); the longest matching pattern wins, so one module of a package can sit in
    another layer than its package. None when no pattern matches.

    >>> layers = [("low", ["p.k.*", "p.r.sampling"]), ("mid", ["p.r.*"]), ("top", ["p"])]
    >>> [layer_of(m, layers) for m in ("p.k.fused", "p.r.sampling", "p.r.engine", "p", "p.cli")]
    [0, 0, 1, 2, None]
    """
    best, best_len = None, -1
    for i, (_, patterns) in enumerate(layers):
        for pattern in patterns:
            if _matches(module, pattern) and len(pattern) > best_len:
                best, best_len = i, len(pattern)
    return best


def upward_edges(edges: Iterable[Edge], layers: Sequence[tuple[str, Sequence[str]]]) -> list[Edge]:
    """The edges from a lower layer's module to a higher layer's (layers are listed bottom first)."""
    out = []
    for e in edges:
        a, b = layer_of(e.source, layers), layer_of(e.target, layers)
        if a is not None and b is not None and b > a:
            out.append(e)
    return out

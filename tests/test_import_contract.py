"""The import contract of src/offpolicy: no import cycle, every import points down the layer table, and no module over
500 lines unless its docstring says it is one algorithm.

The graph is read with ``ast`` (offpolicy_testkit/import_graph.py): module-level and function-level imports both count
(a cycle dodged by an import inside a function is still a cycle), ``if TYPE_CHECKING:`` imports do not (they never run).
scripts/module_graph.py draws the same graph (docs/img/module_graph.png); docs/contributing.md ("Structure") says why
the layers are what they are.
"""

from __future__ import annotations

import ast
import doctest
from pathlib import Path

import pytest
from offpolicy_testkit.import_graph import (
    Edge,
    build_graph,
    layer_of,
    one_cycle,
    strongly_connected,
    upward_edges,
)

SRC = Path(__file__).resolve().parents[1] / "src" / "offpolicy"

# The layers, bottom first. A module may import its own layer and the layers below, never a layer above.
# ``a.b.*``: the package ``a.b`` and everything in it; ``a.b``: that module only. The longest pattern wins, so a
# module can sit below its package (``rollout.sampling``: the sampling transform is a formula that corrections replay).
LAYERS: list[tuple[str, list[str]]] = [
    ("kernels and formulas", [
        "offpolicy.kernels.*", "offpolicy.ratios", "offpolicy.batch", "offpolicy.tolerances", "offpolicy.binary", "offpolicy.divergence",
        "offpolicy.bounds", "offpolicy.metrics", "offpolicy.position", "offpolicy.advantages", "offpolicy.topk_advice",
        "offpolicy.glossary", "offpolicy.catalog", "offpolicy.folder_lock", "offpolicy.atomic_files",
        # the user's numbers as written (YAML 1.2 floats) and the settings a resume compares: stdlib and yaml only
        "offpolicy.yaml_numbers", "offpolicy.resume_settings",
        # the types and registries the methods are built on: a CorrectionResult is what metrics read
        "offpolicy.registry", "offpolicy.corrections.base", "offpolicy.objectives.base",
        # temperature / top-k / top-p / min-p as a function of logits: what an engine samples with and what sampling
        # replay and DVP recompute on the trainer's logits
        "offpolicy.rollout.sampling",
    ]),
    ("corrections and objectives", [
        "offpolicy.corrections.*", "offpolicy.objectives.*", "offpolicy.losses", "offpolicy.perturbation",
        # the built-in log-prob transforms' descriptions (registry entries, no computation), and their forward
        # stage in one pass over the logits, which every host's scoring calls
        "offpolicy.transforms", "offpolicy.forward_scores",
    ]),
    # the recipe schema reads the registries; every host (the trainer, the integrations) maps a recipe from it
    ("rollout, models, tasks, recipes", ["offpolicy.rollout.*", "offpolicy.models.*", "offpolicy.tasks.*",
                                         "offpolicy.recipe.*"]),
    # offpolicy/__init__.py: re-exports of the layers below, torch only (the engine factory included: EngineSpec,
    # build_engine, register_engine; no engine module imports more than torch until an engine is built)
    ("public API", ["offpolicy"]),
    ("train", ["offpolicy.train.*"]),
    ("lab, inspect, integrations, diagnose", [
        "offpolicy.lab.*", "offpolicy.inspect.*", "offpolicy.integrations.*", "offpolicy.diagnose.*",
    ]),
    # entry points: the CLI, and the lab's zygote process (it runs `offpolicy train` forked, so it imports the CLI)
    ("CLI", ["offpolicy.cli.*", "offpolicy.lab.zygote"]),
]

# Upward imports that exist today, each with what removing it takes. The list may only shrink: a new upward import
# fails test_no_upward_import, and an entry that no longer exists fails test_known_upward_imports_still_exist.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}

MAX_LINES = 500
ONE_ALGORITHM = "one algorithm"  # in a module's docstring: the module may be longer than MAX_LINES
# Modules over MAX_LINES today, to be split (one family per file). The list may only shrink: a module that drops under
# the limit fails test_long_modules_are_still_long until its entry goes.
LONG_MODULES = {
}


@pytest.fixture(scope="module")
def graph():
    return build_graph(SRC)


def _describe(e: Edge) -> str:
    where = "inside a function" if e.local else "at module level"
    return (f"{e.source} ({LAYERS[layer_of(e.source, LAYERS)][0]}) imports {e.target} "
            f"({LAYERS[layer_of(e.target, LAYERS)][0]}) at line {e.line}, {where}")


def test_the_graph_is_the_source_tree(graph):
    # a graph reader that saw nothing would pass every check below
    assert len(graph.modules) == len(list(SRC.rglob("*.py")))
    edges = {(e.source, e.target) for e in graph.edges}
    assert ("offpolicy.batch", "offpolicy.ratios") in edges  # module level
    assert ("offpolicy.rollout.vllm", "offpolicy.rollout.vllm_server") in edges  # inside VLLMRolloutEngine.__init__
    assert ("offpolicy", "offpolicy.corrections.importance") in edges  # the package's __init__
    assert len(edges) > 300


def test_no_import_cycle(graph):
    adj = graph.adjacency()
    cycles = [" → ".join(one_cycle(adj, c)) for c in strongly_connected(adj)]
    assert not cycles, "import cycles (move the shared code down, not the import into a function):\n" + "\n".join(cycles)


def test_every_module_has_a_layer(graph):
    assert [m for m in graph.modules if layer_of(m, LAYERS) is None] == []


def test_no_upward_import(graph):
    found = [e for e in upward_edges(graph.edges, LAYERS) if (e.source, e.target) not in KNOWN_UPWARD]
    assert not found, "imports up the layer table:\n" + "\n".join(map(_describe, found))


def test_known_upward_imports_still_exist(graph):
    upward = {(e.source, e.target) for e in upward_edges(graph.edges, LAYERS)}
    assert [pair for pair in KNOWN_UPWARD if pair not in upward] == []


def test_no_module_over_the_line_limit(graph):
    long = sorted(m for m, n in graph.lines.items() if n > MAX_LINES and m not in LONG_MODULES
                  and ONE_ALGORITHM not in graph.docstrings[m].lower())
    assert not long, (f"over {MAX_LINES} lines (split by family, or say in the docstring that it is one algorithm): "
                      + ", ".join(f"{m} ({graph.lines[m]})" for m in long))


def test_long_modules_are_still_long(graph):
    assert sorted(m for m in LONG_MODULES if graph.lines.get(m, 0) <= MAX_LINES) == []


# -- the checks themselves, on a synthetic package ------------------------------------------------------------------


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


SYNTHETIC_LAYERS = [("low", ["pkg.low.*"]), ("high", ["pkg.high.*"])]


def test_a_planted_upward_import_is_caught(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from pkg.high.b import g\n    return g\n",  # upward, inside a function
        "high/__init__.py": "",
        "high/b.py": "from pkg.low import a\n\ndef g():\n    return a\n",  # downward: allowed
    })
    g = build_graph(pkg)
    up = upward_edges(g.edges, SYNTHETIC_LAYERS)
    assert [(e.source, e.target, e.line, e.local) for e in up] == [("pkg.low.a", "pkg.high.b", 2, True)]
    # … and the two edges make a cycle, found with its path
    adj = g.adjacency()
    assert strongly_connected(adj) == [["pkg.high.b", "pkg.low.a"]]
    assert one_cycle(adj, ["pkg.high.b", "pkg.low.a"]) == ["pkg.high.b", "pkg.low.a", "pkg.high.b"]


def test_type_checking_imports_and_relative_imports(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "from . import low\n",
        "low/__init__.py": "from .a import f\n",
        "low/a.py": ("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.high.b import g\n"
                     "else:\n    from .. import high\n\ndef f():\n    return 1\n"),
        "high/__init__.py": "",
        "high/b.py": "import pkg.low.a as a\nfrom pkg.low import f\n",
    })
    g = build_graph(pkg)
    edges = sorted((e.source, e.target) for e in g.edges)
    assert edges == [("pkg", "pkg.low"), ("pkg.high.b", "pkg.low"), ("pkg.high.b", "pkg.low.a"),
                     ("pkg.low", "pkg.low.a"), ("pkg.low.a", "pkg.high")]  # the else branch runs: it counts
    assert [(e.source, e.target) for e in upward_edges(g.edges, SYNTHETIC_LAYERS)] == [("pkg.low.a", "pkg.high")]
    assert strongly_connected(g.adjacency()) == []  # pkg.high (its __init__) imports nothing


def test_the_real_layer_table_catches_a_planted_import(graph):
    # the table above, with one planted import of the trainer from a kernel: exactly that edge is reported
    planted = Edge("offpolicy.kernels.chunking", "offpolicy.train.loop", 1, False)
    found = [e for e in upward_edges([*graph.edges, planted], LAYERS) if (e.source, e.target) not in KNOWN_UPWARD]
    assert found == [planted]
    assert "kernels and formulas" in _describe(planted) and "(train)" in _describe(planted)


def test_the_graph_readers_doctests():
    # offpolicy_testkit is outside pytest's doctest paths (src/offpolicy): run its examples here
    from offpolicy_testkit import import_graph

    result = doctest.testmod(import_graph)
    assert result.attempted > 0 and result.failed == 0


# -- no class defined inside a function ---------------------------------------------------------------------------
# A class built by a function is a new class per call, unpicklable under its ``<locals>`` name, and hides what it
# needs from its caller's scope; a base imported late (TRL, transformers, verl) is a mixin in front of it instead
# (``OffPolicyGRPOMixin``), composed at module level or with ``type(...)``.
# Classes inside functions that exist today, each with what removing it takes. The list may only shrink.
KNOWN_CLASSES_IN_FUNCTIONS: dict[str, str] = {}


def classes_in_functions(tree: ast.AST) -> list[tuple[str, int, str]]:
    """``(class, line, function)`` for every ``class`` statement whose nearest enclosing definition is a function
    (through ``if`` / ``try`` / ``with`` blocks too); a class nested in a class is fine."""
    found: list[tuple[str, int, str]] = []

    def visit(node: ast.AST, scope: ast.AST | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef) and isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((child.name, child.lineno, scope.name))
            inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else scope
            visit(child, inner)

    visit(tree, None)
    return found


def _classes_in_functions_under(root: Path, package: str) -> dict[str, str]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        module = ".".join((package, *parts[:-1]) if parts[-1] == "__init__" else (package, *parts))
        for name, line, function in classes_in_functions(ast.parse(path.read_text(), str(path))):
            out[f"{module}:{name}"] = f"{path}:{line}, inside {function}()"
    return out


def test_no_class_defined_inside_a_function():
    found = {k: v for k, v in _classes_in_functions_under(SRC, "offpolicy").items()
             if k not in KNOWN_CLASSES_IN_FUNCTIONS}
    assert not found, ("classes defined inside a function (a module-level class, or a mixin composed with the late "
                       "base):\n" + "\n".join(f"{k} at {v}" for k, v in found.items()))


def test_known_classes_in_functions_still_exist():
    present = _classes_in_functions_under(SRC, "offpolicy")
    assert [k for k in KNOWN_CLASSES_IN_FUNCTIONS if k not in present] == []


def test_a_class_inside_a_function_is_caught():
    code = ("class Top:\n    class Nested:\n        pass\n\n    def method(self):\n        if True:\n"
            "            class InMethod:\n                pass\n\n"
            "def factory(base):\n    class Built(base):\n        pass\n    return Built\n\n"
            "async def later():\n    try:\n        class InTry:\n            pass\n    finally:\n        pass\n\n"
            "def composed(base):\n    return type('Built', (base,), {})\n")
    assert classes_in_functions(ast.parse(code)) == [("InMethod", 7, "method"), ("Built", 11, "factory"),
                                                     ("InTry", 17, "later")]

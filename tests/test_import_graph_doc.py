"""The package-level import graph on docs/architecture.md cannot go stale: the committed docs/img/import_graph.dot is what
scripts/import_graph.py writes for the current source, and the committed .svg draws exactly its packages and edges.
(Regenerate both with ``PYTHONPATH=. python scripts/import_graph.py``, which needs graphviz; this test does not.)"""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
from offpolicy_testkit.script_module import load_script

ROOT = Path(__file__).resolve().parents[1]
IMG = ROOT / "docs" / "img"
script = load_script("scripts/import_graph.py")


def _svg_titles() -> list[str]:
    svg = (IMG / "import_graph.svg").read_text(encoding="utf-8")
    return [html.unescape(t) for t in re.findall(r"<title>(.*?)</title>", svg)]


def test_the_committed_dot_is_the_current_sources_graph():
    nodes, edges = script.package_edges()
    assert (IMG / "import_graph.dot").read_text(encoding="utf-8") == script.dot_text(nodes, edges), (
        "docs/img/import_graph.dot is out of date: run PYTHONPATH=. python scripts/import_graph.py")


def test_the_committed_svg_draws_those_packages_and_edges():
    nodes, edges = script.package_edges()
    titles = _svg_titles()
    drawn_edges = {tuple(t.split("->")) for t in titles if "->" in t}
    drawn_nodes = {t for t in titles if "->" not in t} - {"offpolicy"}  # the graph's own title
    assert drawn_nodes == set(nodes)
    assert drawn_edges == set(edges)


def test_the_graph_by_hand_on_a_small_tree(tmp_path):
    # a top-level module (core), two subpackages; the root __init__ imports everything and is left out
    pkg = tmp_path / "offpolicy"
    for folder in (pkg / "corrections", pkg / "train"):
        folder.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from offpolicy import batch\nfrom offpolicy.train import loop\n")
    (pkg / "batch.py").write_text("")
    (pkg / "corrections" / "__init__.py").write_text("")
    (pkg / "corrections" / "base.py").write_text("from offpolicy.batch import X\n")
    (pkg / "train" / "__init__.py").write_text("")
    (pkg / "train" / "loop.py").write_text("import offpolicy.corrections.base\nfrom offpolicy import batch\n")
    nodes, edges = script.package_edges(pkg)
    assert nodes == ["core", "corrections", "train"]
    assert edges == [("corrections", "core"), ("train", "core"), ("train", "corrections")]
    text = script.dot_text(nodes, edges)
    assert '"train" -> "corrections";' in text and "dashed" not in text  # no cycle between packages here
    # an edge back from core closes cycles through all three: every edge among them is drawn dashed
    cyclic = script.dot_text(nodes, [*edges, ("core", "train")])
    assert cyclic.count("dashed") == 4


def test_a_package_without_a_role_is_refused(tmp_path):
    pkg = tmp_path / "offpolicy"
    (pkg / "newthing").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "newthing" / "__init__.py").write_text("")
    with pytest.raises(ValueError, match=r"no role for offpolicy\.newthing"):
        script.package_edges(pkg)

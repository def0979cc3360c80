"""The method catalog (src/offpolicy/catalog.py) covers every registered method, and every arXiv id the repository
cites is one of its papers — one id per method, everywhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from offpolicy.catalog import METHODS, PAPERS, by_name
from offpolicy.registry import CORRECTIONS, OBJECTIVES
from offpolicy.train.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]
CITATION = re.compile(r"arXiv[: ]+(\d{4}\.\d{4,5})((?:,\s*\d{4}\.\d{4,5})*)")
FOLDERS = ("src", "docs", "examples", "tests", "benchmarks", "scripts")


def _own(registry) -> set[str]:
    """Names registered by offpolicy itself (tests register throw-away entries of their own)."""
    return {n for n in registry.names()
            if getattr(getattr(registry[n], "fn", registry[n]), "__module__", "").startswith("offpolicy.")}


def _texts():
    for path in [ROOT / "README.md", *(p for f in FOLDERS for p in (ROOT / f).rglob("*"))]:
        if path.is_file() and path.suffix in (".py", ".md", ".yaml", ".txt", ".sh") and path.name != "test_catalog.py":
            yield path, path.read_text(encoding="utf-8", errors="replace")


def test_every_registered_method_is_in_the_catalog():
    corrections = {n for m in METHODS for n in m.corrections}
    objectives = {n for m in METHODS for n in m.objectives}
    presets = {n for m in METHODS for n in m.presets}
    assert _own(CORRECTIONS) - corrections == set(), "add a catalog row (src/offpolicy/catalog.py)"
    assert _own(OBJECTIVES) - objectives == set(), "add a catalog row (src/offpolicy/catalog.py)"
    assert set(PRESETS) - presets == set(), "name the preset in a catalog row"
    assert corrections <= set(CORRECTIONS.names()) and objectives <= set(OBJECTIVES.names())
    assert presets <= set(PRESETS)


def test_every_page_and_paper_of_the_catalog_exists():
    for m in METHODS:
        assert (ROOT / "docs" / "methods" / f"{m.page}.md").is_file(), m
        assert m.arxiv is None or m.arxiv in PAPERS, m
        assert m.arxiv or m.source, m


def test_every_cited_arxiv_id_is_a_known_paper():
    unknown = []
    for path, text in _texts():
        for match in CITATION.finditer(text):
            ids = [match.group(1), *re.findall(r"\d{4}\.\d{4,5}", match.group(2))]
            unknown += [f"{path.relative_to(ROOT)}: arXiv {i}" for i in ids if i not in PAPERS]
    assert unknown == [], "cite the paper's one id (src/offpolicy/catalog.py PAPERS)"


@pytest.mark.parametrize("method", [m for m in METHODS if m.arxiv], ids=lambda m: m.name)
def test_a_method_named_beside_an_id_has_its_own(method):
    # "DVP (arXiv 2604.18700)" was in three places while the paper is 2512.23087
    pattern = re.compile(rf"\b{re.escape(method.name)} \(arXiv[: ]+(\d{{4}}\.\d{{4,5}})")
    longer = [m.name for m in METHODS if m.name != method.name and m.name.endswith(" " + method.name)]

    def part_of_a_longer_name(text: str, start: int) -> bool:  # "decoupled PPO" is another method than "PPO"
        return any(text[:start + len(method.name)].endswith(name) for name in longer)

    wrong = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p, text in _texts() for m in pattern.finditer(text)
             if m.group(1) != method.arxiv and not part_of_a_longer_name(text, m.start())]
    assert wrong == []


def test_by_name_names_what_exists():
    assert by_name("IcePop").corrections == ("icepop",)
    with pytest.raises(ValueError, match="no method 'Nope' in the catalog; known: TIS, MIS"):
        by_name("Nope")

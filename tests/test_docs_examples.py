"""The examples on the docs pages run and print what the pages say: every ``pycon`` block is a doctest, and every
``python`` block that starts with ``import torch`` runs (the pages' complete programs; other blocks are fragments,
such as the five lines that assume your own tensors)."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
_FENCE = re.compile(r"^```(pycon|python)\n(.*?)^```", re.S | re.M)


def _blocks(kind: str) -> list[tuple[str, str]]:
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        for lang, body in _FENCE.findall(page.read_text(encoding="utf-8")):
            if lang == kind and (kind == "pycon" or body.startswith("import torch")):
                found.append((f"{page.relative_to(DOCS)}#{len(found)}", body))
    return found


PYCON = _blocks("pycon")
PROGRAMS = _blocks("python")


def test_the_docs_have_examples():
    assert len(PYCON) >= 6 and PROGRAMS, (len(PYCON), len(PROGRAMS))


@pytest.mark.parametrize("name,body", PYCON, ids=[n for n, _ in PYCON])
def test_pycon_block(name, body):
    test = doctest.DocTestParser().get_doctest(body, {}, name, name, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test, out=lambda text: pytest.fail(text))
    assert runner.failures == 0 and runner.tries > 0


@pytest.mark.parametrize("name,body", PROGRAMS, ids=[n for n, _ in PROGRAMS])
def test_python_program(name, body):
    exec(compile(body, name, "exec"), {"__name__": "__docs__"})  # the docs page's own example program

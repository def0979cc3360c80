"""The docs build's docstring rewriter (docs/_ext/docstrings.py): reST-isms of the docstrings become Markdown."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("griffe")
_PATH = Path(__file__).resolve().parents[1] / "docs" / "_ext" / "docstrings.py"
_spec = importlib.util.spec_from_file_location("offpolicy_docs_docstrings", _PATH)
docstrings = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docstrings)
to_markdown = docstrings.to_markdown


def test_doctest_becomes_a_fenced_block_up_to_the_blank_line():
    text = "Intro.\n\n>>> x = 1\n>>> x + 1\n2\n\nAfter."
    assert to_markdown(text) == "Intro.\n\n```pycon\n>>> x = 1\n>>> x + 1\n2\n```\n\nAfter."


def test_indented_doctest_keeps_its_indentation():
    # inside an Args item the example is indented: the fence must sit at the same depth
    expected = "Args:\n    a: b\n\n    ```pycon\n    >>> f()\n    1\n    ```"
    assert to_markdown("Args:\n    a: b\n\n    >>> f()\n    1") == expected


def test_literal_block_loses_the_double_colon_and_its_extra_indent():
    text = "Names::\n\n    a   b\n      c\n\nNext paragraph."
    assert to_markdown(text) == "Names:\n\n```text\na   b\n  c\n```\n\nNext paragraph."


def test_double_colon_without_an_indented_block_is_left_alone():
    assert to_markdown("ratio::\nnot a block") == "ratio::\nnot a block"


def test_simple_table_is_fenced_whole():
    text = "Fields:\n\n===  ====\na    b\n===  ====\n``x``  int\n===  ====\n\nAfter."
    out = to_markdown(text)
    assert out == "Fields:\n\n```text\n===  ====\na    b\n===  ====\n``x``  int\n===  ====\n```\n\nAfter."


def test_sphinx_roles_become_code():
    assert to_markdown("see :func:`metric_names` and :class:`~offpolicy.LogProbBatch`") == (
        "see `metric_names` and `offpolicy.LogProbBatch`")


def test_module_doctest():
    import doctest

    assert doctest.testmod(docstrings).failed == 0

"""The API reference covers the package: every public module is on an API page (docs/_ext/api_pages.py expands each
page's ``::: package.*`` to the package's modules the page does not name)."""

from __future__ import annotations

import doctest
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("offpolicy_docs_api_pages", ROOT / "docs" / "_ext" / "api_pages.py")
api_pages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(api_pages)


def _documented() -> list[str]:
    pages = sorted((ROOT / "docs" / "api").glob("*.md"))
    text = "\n".join(api_pages.expand(p.read_text(encoding="utf-8")) for p in pages)
    return re.findall(r"^::: ([\w.]+)\s*$", text, re.M)


def test_every_public_module_is_on_an_api_page():
    # a package's own page is optional (most re-export their modules' names), its modules are not
    documented = set(_documented())
    src = ROOT / "src"
    files = [m for m in api_pages.modules("offpolicy") if not src.joinpath(*m.split(".")).is_dir()]
    assert "offpolicy" in documented and len(files) > 50
    assert [m for m in files if m not in documented] == []


def test_no_module_is_documented_twice():
    # a page that names a module and also lists it under another page's wildcard would render it twice
    names = _documented()
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_wildcard_takes_only_what_the_page_does_not_name(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for f in ("__init__.py", "a.py", "b.py", "_private.py", "conftest.py", "sub/__init__.py", "sub/c.py"):
        (pkg / f).write_text("")
    out = api_pages.expand("::: pkg.b\n\n::: pkg.*\n", tmp_path)
    assert out == "::: pkg.b\n\n::: pkg.a\n\n::: pkg.sub\n\n::: pkg.sub.c\n"


def test_wildcard_on_a_module_is_an_error(tmp_path):
    (tmp_path / "mod.py").write_text("")
    with pytest.raises(ValueError, match=r"::: mod\.\* names no package"):
        api_pages.expand("::: mod.*", tmp_path)


def test_module_doctest():
    assert doctest.testmod(api_pages).failed == 0

"""Every relative link in README.md and docs/ resolves on GitHub as on the docs site.

mkdocs --strict checks the links between pages of the site, but not README.md, nor links that leave docs/; GitHub
resolves a link against the file tree, and has no target for the API pages' ``#module`` anchors (it shows those pages
as bare ``::: module`` lines). So: each relative target must exist on disk, and no link may point into an API page's
anchor.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_ext" not in p.parts)]
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def links(text: str) -> list[str]:
    """The targets of the Markdown links in ``text``, code blocks and inline code left out."""
    text = INLINE_CODE.sub("", FENCE.sub("", text))
    return LINK.findall(text)


def relative(target: str) -> str | None:
    """The file part of a relative link, or None for URLs, mail and in-page anchors."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return None
    return target.split("#", 1)[0] or None


def test_link_parser_finds_and_skips():
    text = "a [x](a.md#h) ![i](img/p.png) [u](https://e.org) `[c](no.md)`\n```\n[d](no2.md)\n```\n[e](#top)"
    found = links(text)
    assert found == ["a.md#h", "img/p.png", "https://e.org", "#top"]
    assert [relative(t) for t in found] == ["a.md", "img/p.png", None, None]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    missing = [t for t in links(page.read_text(encoding="utf-8"))
               if (f := relative(t)) is not None and not (page.parent / f).exists()]
    assert not missing, f"{page.relative_to(ROOT)}: links to missing files: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_links_into_api_anchors(page: Path):
    bad = [t for t in links(page.read_text(encoding="utf-8")) if re.search(r"(^|/)api/[\w-]+\.md#", t)]
    assert not bad, f"{page.relative_to(ROOT)}: GitHub has no target for {bad}; link the API page or the source file"

"""The README is the front door: short, the two set-up commands exactly, and every link into the docs resolves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_is_at_most_150_lines():
    assert len(README.splitlines()) <= 150


def test_readme_has_the_two_setup_commands():
    for command in ("pip install torch==2.13.0 -e '.[cli]' && offpolicy demo",
                    "pip install torch==2.13.0 -e '.[dev]' && python -m pytest"):
        assert any(line.startswith(command) for line in README.splitlines()), command


def test_readme_links_resolve():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert local, "the README links into docs/"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert missing == []

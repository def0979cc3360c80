"""The generated tables of the docs (methods, presets, versions, metrics glossary) are what the code says now:
``python docs/_ext/generated.py`` rewrites them, this test fails when someone changed the code and not the pages."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("offpolicy_docs_generated", ROOT / "docs" / "_ext" / "generated.py")
generated = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generated)


def test_every_generated_block_is_up_to_date():
    assert [str(p.relative_to(ROOT)) for p in generated.stale()] == [], "run: python docs/_ext/generated.py"


def test_every_block_is_used_somewhere():
    text = "\n".join(p.read_text(encoding="utf-8") for p in generated.pages())
    assert [name for name in generated.BLOCKS if f"<!-- generated: {name}" not in text] == []


def test_render_rewrites_only_between_the_markers():
    page = "before\n<!-- generated: versions -->\nold table\n<!-- end generated -->\nafter\n"
    out = generated.render(page)
    assert out.startswith("before\n<!-- generated: versions -->\n| package |") and out.endswith(
        "<!-- end generated -->\nafter\n")
    assert "old table" not in out and generated.render(out) == out

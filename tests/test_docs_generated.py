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


def test_every_measured_value_names_a_glossary_key():
    # docs/data/glossary/measured.json: a key the glossary no longer has would silently drop out of docs/metrics.md
    import json

    from offpolicy.glossary import DIAGNOSTICS, ENTRIES

    data = json.loads((ROOT / "docs" / "data" / "glossary" / "measured.json").read_text(encoding="utf-8"))
    assert sorted(set(data["diagnostics"]) - set(DIAGNOSTICS)) == []
    assert sorted(set(data["entries"]) - {e.key for e in ENTRIES}) == []
    assert data["diagnostics"] and data["entries"]


def test_the_sync_checks_values_come_from_its_data():
    # the glossary's sync/* cells are computed from docs/data/sync_check/*.json, not typed anywhere
    import json

    values = generated.measured()
    runs = [json.loads(p.read_text()) for p in sorted((ROOT / "docs" / "data" / "sync_check").glob("*.json"))]
    for run in runs:
        seconds = [s["check_s_median"] for s in run["settings"]]
        trainer = run.get("trainer_dtype", "float32")
        label = f"vLLM {run['dtype']} on {run['model']}" + (f" ({trainer} trainer)" if trainer != "float32" else "")
        assert f"{label}: {generated._span(seconds, '{:.2g}')} s" in values["sync/seconds"]
    ratios = [x for r in runs for s in r["settings"] for x in (s["ratio_min"], s["ratio_max"])]
    assert values["sync/ratio"].startswith(f"{min(ratios):.2g}–{max(ratios):.2g} over ")
    data = json.loads((ROOT / "docs" / "data" / "glossary" / "measured.json").read_text(encoding="utf-8"))
    assert not {"sync/gap", "sync/baseline", "sync/ratio", "sync/seconds"} & set(data["entries"])


def test_no_measured_value_ships_in_the_glossary_module():
    import dataclasses

    from offpolicy import glossary

    assert "measured" not in {f.name for f in dataclasses.fields(glossary.Entry)}
    assert all(isinstance(v, str) for v in glossary.DIAGNOSTICS.values())
    entry = glossary.lookup("sampling/ess")
    assert entry is not None and entry.means == glossary.DIAGNOSTICS["ess"]
    assert not hasattr(entry, "measured")  # the values are in docs/data/glossary/measured.json

"""The tables of the docs that the code can write: methods, presets, the version matrix and the metrics glossary.

A page holds a block between two markers::

    <!-- generated: presets -->
    ... (rewritten) ...
    <!-- end generated -->

``python docs/_ext/generated.py`` rewrites every block of README.md and docs/**.md from the code
(:mod:`offpolicy.catalog`, :data:`offpolicy.train.presets.PRESETS`, :mod:`offpolicy.integrations.versions`,
:mod:`offpolicy.glossary`) and from the JSON the project's scripts and runs wrote under docs/data/ (the glossary's
measured values: docs/data/glossary/measured.json, and the sync check's from docs/data/sync_check/*.json); ``--check`` only reports the pages whose blocks are out of date (exit 1), which is what
tests/test_docs_generated.py asserts. A block may take one argument, ``prefix=PATH``: where the method pages are,
relative to the page (README.md: ``docs/methods/``).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"(<!-- generated: (\w+)((?: \w+=\S+)*) -->\n)(.*?)(<!-- end generated -->)", re.S)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _key(key: str) -> str:
    """A metric key as inline code that may wrap after a '/' and nowhere else (docs/stylesheets/extra.css).

    >>> _key("rollout_corr/<is>/clipped_frac")
    '<code>rollout_corr/<wbr>&lt;is&gt;/<wbr>clipped_frac</code>'
    """
    escaped = key.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return "<code>" + escaped.replace("/", "/<wbr>") + "</code>"


def methods(prefix: str = "") -> str:
    from offpolicy.catalog import methods_table

    return methods_table(prefix)


def presets(prefix: str = "") -> str:
    from offpolicy.train.presets import PRESETS, AlgorithmDefaults, chain_specs

    rows = ["| preset | what it does | corrections at the defaults | objective | the trainer also computes |",
            "|---|---|---|---|---|"]
    for p in PRESETS.values():
        specs = chain_specs(p, AlgorithmDefaults())
        chain = ", ".join(_spec(s) for s in specs) or "none"
        extras = [x for x, on in (("min-p constrained log-probs", p.minp), ("exact KL from the logits", p.divergence),
                                  ("layerwise noise (ALP)", p.alp),
                                  (f"the centred score ({p.score_centering})", p.score_centering is not None)) if on]
        objective = p.objective + (f", dual clip {p.dual_clip:g}" if p.dual_clip else "")
        rows.append(f"| `{p.name}` | {_cell(p.description)} | {_cell(chain)} | {objective} | "
                    f"{', '.join(extras) or '–'} |")
    return "\n".join(rows)


def _spec(spec: dict) -> str:
    params = ", ".join(f"{k}={v}" for k, v in spec.items() if k != "name")
    return f"`{spec['name']}`" + (f" ({params})" if params else "")


def versions(prefix: str = "") -> str:
    from offpolicy.integrations.versions import VERSIONS

    rows = ["| package | tested range (a warning outside) | pip installs | tested | what depends on it |",
            "|---|---|---|---|---|"]
    for v in VERSIONS.values():
        rows.append(f"| {v.package} | `{v.range}` | `{v.requirement}` | {v.tested} | {_cell(v.where)} |")
    return "\n".join(rows)


def _span(values: list[float], form: str) -> str:
    """``a`` or ``a–b`` (the smallest and the largest of ``values``, each in ``form``).

    >>> _span([0.2, 0.1, 0.3], "{:.1f}"), _span([0.0, 0.0], "{:g}")
    ('0.1–0.3', '0')
    """
    lo, hi = form.format(min(values)), form.format(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def _sync_measured() -> dict[str, str]:
    """The sync check's glossary values from docs/data/sync_check/*.json (benchmarks/sync_check_table.py): per engine
    and model, over the settings (learning rates) each file holds."""
    import json

    from offpolicy.train.config import RolloutConfig

    runs = [json.loads(p.read_text()) for p in sorted((ROOT / "docs" / "data" / "sync_check").glob("*.json"))]
    if not runs:
        return {}

    def per_engine(field: str, form: str, unit: str = "") -> str:
        return "; ".join(f"vLLM {r['dtype']} on {r['model']}"
                         + (f" ({r['trainer_dtype']} trainer)" if r.get("trainer_dtype", "float32") != "float32" else "")
                         + f": {_span([s[field] for s in r['settings']], form)}{unit}" for r in runs)

    healthy = sum(s["healthy"] for r in runs for s in r["settings"])
    ratios = [x for r in runs for s in r["settings"] for x in (s["ratio_min"], s["ratio_max"])]
    max_baseline = RolloutConfig.model_fields["sync_check_max_baseline"].default
    return {
        "sync/gap": per_engine("gap_last", "{:.2g}", " nats at the last healthy sync"),
        "sync/baseline": (per_engine("baseline", "{:.2g}", " nats")
                          + f"; above {max_baseline:g} is an error (rollout.sync_check_max_baseline)"),
        "sync/ratio": f"{_span(ratios, '{:.2g}')} over {healthy} healthy syncs",
        "sync/seconds": per_engine("check_s_median", "{:.2g}", " s (median)"),
    }


def measured() -> dict[str, str]:
    """``{glossary key or diagnostic name: what the project measured}``: docs/data/glossary/measured.json, and the sync
    check's keys from its own data (:func:`_sync_measured`)."""
    import json

    data = json.loads((ROOT / "docs" / "data" / "glossary" / "measured.json").read_text(encoding="utf-8"))
    return {**data["diagnostics"], **data["entries"], **_sync_measured()}


def glossary_diagnostics(prefix: str = "") -> str:
    from offpolicy.glossary import DIAGNOSTICS
    from offpolicy.metrics import NAMINGS

    header = {"swift": "the trainer (default), ms-swift", "verl": "verl", "trl": "TRL", "openrlhf": "OpenRLHF",
              "tinker": "Tinker"}

    def key(naming: str, name: str) -> str:
        n = NAMINGS[naming]
        return _key(n.prefix + n.renames.get(name, name))

    rows = ["| metric | TRL key | verl key | meaning | measured here (lab, 5 M) |", "|---|---|---|---|---|"]
    values = measured()
    for name, means in DIAGNOSTICS.items():
        rows.append(f"| **{name}** | {key('trl', name)} | {key('verl', name)} | {_cell(means)} | "
                    f"{_cell(values.get(name, ''))} |")
    rows += ["", "The other namings: the prefix and the metric's name, except where a framework has a name of its own:",
             "", "| naming | prefix | its own names |", "|---|---|---|"]
    for naming, n in NAMINGS.items():
        if naming in ("trl", "verl"):
            continue
        own = ", ".join(f"{k} → `{n.prefix}{v}`" for k, v in n.renames.items()) or "–"
        rows.append(f"| {header.get(naming, naming)} (`{naming}`) | `{n.prefix}` | {_cell(own)} |")
    return "\n".join(rows)


# Trainer keys whose TRL and verl counterparts are the frameworks' own metrics, not offpolicy's (TRL's GRPOTrainer and
# verl 0.9's v1 trainer log them under these names).
FRAMEWORK_KEYS = {
    "reward/mean": ("reward", "critic/score/mean"),
    "reward/std": ("reward_std", "critic/score/std"),
    "reward/max": ("", "critic/score/max"),
    "response/length_mean": ("completions/mean_length", "response_length/mean"),
    "loss/grad_norm": ("grad_norm", "actor/grad_norm"),
    "optim/lr": ("learning_rate", "actor/lr"),
}
# The sync check's keys the TRL trainer logs as they are (verl's syncs are not checked yet).
TRL_SYNC_KEYS = ("gap", "baseline", "threshold", "ratio", "engine_motion", "stale_fraction", "ok", "seconds",
                 "push_seconds")
# Correction families whose metrics verl's driver logs under rollout_corr/ (the correction runs once per step there).
VERL_CORRECTION_FAMILIES = ("<correction>", "<is>", "gated_is", "opsm", "veto", "trm", "ln_trm", "ser", "<kl_mode>", "chain", "dvp")


def _framework_keys(entry) -> tuple[str, str]:
    """The TRL and the verl key of one glossary entry ('' where that framework does not log it)."""
    if entry.key in FRAMEWORK_KEYS:
        return FRAMEWORK_KEYS[entry.key]
    if entry.key.startswith("inspect:"):
        return "", ""
    if entry.key.startswith("sync/") and entry.key[5:] in TRL_SYNC_KEYS:  # TRL's sync check logs them unprefixed
        return entry.key, ""
    if entry.logged_by == "verl":
        return "", entry.key
    trl = f"offpolicy/{entry.key}" if "TRL" in entry.logged_by else ""
    family = entry.key.split("/", 1)[0]
    verl = (f"rollout_corr/{entry.key}" if family in VERL_CORRECTION_FAMILIES else
            entry.key if entry.key.startswith("loss/") and "TRL" in entry.logged_by else
            f"actor/{entry.key}" if "verl" in entry.logged_by else "")  # the engine's, in verl's step metrics
    return trl, verl


def glossary_entries(prefix: str = "") -> str:
    from offpolicy.glossary import ENTRIES, IS_NAMES, KL_MODES

    rows = ["| key (the reference trainer) | TRL key | verl key | meaning | measured here (lab, 5 M) |",
            "|---|---|---|---|---|"]
    values = measured()
    for e in ENTRIES:
        key = e.key.replace("inspect:", "report.json: ")
        trl, verl = _framework_keys(e)
        # verl's own names and TRL-only keys: the reference trainer logs nothing under them
        own = "" if e.logged_by in ("verl", "TRL") else key
        cells = " | ".join(_key(k) if k else "–" for k in (own, trl, verl))
        rows.append(f"| {cells} | {_cell(e.means)} | {_cell(values.get(e.key, ''))} |")
    rows.append("")
    rows.append("`<correction>` is any correction's name: its registered name (`tis`, `opsm`, …; a `kl_rejection`'s "
                "is its mode), `chain` for a chain of several, the `name=` you gave, and `correction` for the "
                "reference trainer's whole correction (the trainer only). "
                f"`<is>` is one of {', '.join(f'`{n}`' for n in IS_NAMES)}; `<kl_mode>` one of "
                f"{', '.join(f'`{n}`' for n in KL_MODES)}; `<layer>` a layer index; `<bin>` a position bin "
                "(`pos00008-00015`). The TRL trainer logs offpolicy's keys under `offpolicy/` "
                "(`offpolicy/tis/capped_frac`) beside TRL's own; verl's driver logs a correction's keys under "
                "`rollout_corr/`, the policy loss's `loss/…` keys as the loss returns them, and the engine's (ALP's σ, "
                "score centering's drift) under verl's `actor/`. `report.json` keys are "
                "written by `offpolicy inspect`. A blank \"measured here\" cell: not measured in the lab.")
    return "\n".join(rows)


def glossary_renamed(prefix: str = "") -> str:
    """The correction metrics renamed when every correction came to log the same four names (``glossary.RENAMED``)."""
    from offpolicy.glossary import RENAMED

    def code(text: str) -> str:  # every metric name as code (a bare <is> would be an HTML tag)
        return _cell(re.sub(r"([<\w>]+(?:/\w+)+)", r"`\1`", text))

    rows = ["| old name | what says it now |", "|---|---|"]
    for old, new in RENAMED:
        rows.append(f"| {code(old)} | {code(new)} |")
    return "\n".join(rows)


def _num(x) -> str:
    return "–" if x is None else f"{x:.2g}"


def sync_check(prefix: str = "") -> str:
    """The sync check against live vLLM, from the JSONs ``benchmarks/sync_check_table.py`` wrote
    (docs/data/sync_check/*.json): false alarms over healthy syncs, detection delays, costs."""
    import json

    rows = ["| model (V) | engine · trainer | lr | healthy syncs | false alarms | gap: baseline ± se → threshold | "
            "engine tensors checked | no-op sync | tied head left | last layer left | wrong dtype | check / push s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for path in sorted((ROOT / "docs" / "data" / "sync_check").glob("*.json")):
        run = json.loads(path.read_text())
        for row in sorted(run["settings"], key=lambda r: r["lr"]):
            det = row["detection"]

            def delay(mode: str, det=det, row=row) -> str:
                d = det.get(mode, {})
                cell = (f"{d['syncs']} ({d['caught_by']})" if d.get("syncs") else
                        f"not in {row.get('max_delay', '?')}")
                if "params_syncs" in d and "params_checked" in row:  # the parameter layer, timed on its own
                    cell += f" · params {d['params_syncs'] or 'not in ' + str(d['syncs_run'])}"
                return cell

            rows.append(f"| {run['model']} ({run['vocab']:,}) | vLLM {run['dtype']} · "
                        f"{run.get('trainer_dtype', 'float32')} | {row['lr']:g} | "
                        f"{row['healthy']} | {row['false_alarms']} | {_num(row['baseline'])} ± "
                        f"{_num(row['standard_error'])} → {_num(row['threshold'])} | "
                        f"{str(row['params_checked']) + ' of ' + str(row['params_total']) if 'params_checked' in row else '–'} | "
                        f"{delay('noop')} | "
                        f"{delay('head')} | {delay('layer')} | {delay('dtype')} | "
                        f"{row['check_s_median']:.2f} / {row['push_s_median']:.2f} |")
    return "\n".join(rows)


BLOCKS: dict[str, Callable[..., str]] = {
    "sync_check": sync_check,
    "methods": methods,
    "presets": presets,
    "versions": versions,
    "glossary_diagnostics": glossary_diagnostics,
    "glossary_entries": glossary_entries,
    "glossary_renamed": glossary_renamed,
}


def render(text: str) -> str:
    """``text`` with every generated block rewritten."""

    def repl(match: re.Match[str]) -> str:
        name, args = match.group(2), dict(a.split("=", 1) for a in match.group(3).split())
        if name not in BLOCKS:
            raise ValueError(f"unknown generated block {name!r}; known: {', '.join(BLOCKS)}")
        return f"{match.group(1)}{BLOCKS[name](**args)}\n{match.group(5)}"

    return BLOCK.sub(repl, text)


def pages(root: Path = ROOT) -> list[Path]:
    """README.md and every docs page that holds a generated block."""
    found = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    return [p for p in found if p.is_file() and "<!-- generated: " in p.read_text(encoding="utf-8")]


def stale(root: Path = ROOT) -> list[Path]:
    """The pages whose blocks differ from what the code generates."""
    return [p for p in pages(root) if render(p.read_text(encoding="utf-8")) != p.read_text(encoding="utf-8")]


def main(argv: list[str]) -> int:
    if "--check" in argv:
        out = stale()
        for p in out:
            print(f"{p.relative_to(ROOT)}: generated tables out of date (python docs/_ext/generated.py)")
        return 1 if out else 0
    for p in pages():
        text = p.read_text(encoding="utf-8")
        new = render(text)
        if new != text:
            p.write_text(new, encoding="utf-8")
            print(f"rewrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

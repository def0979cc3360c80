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


# ---------------------------------------------------------------------------------------------------------------------
# The thresholds the examples show (examples/*.yaml, examples/*.py, the README's snippets) are ones the docs recommend:
# each parameter of a correction is the registry's default, unless the docs recommend otherwise (RECOMMENDED).
# ---------------------------------------------------------------------------------------------------------------------

ROOT = DOCS.parent
RECOMMENDED = {
    # docs/methods/sequence-masks.md, docs/inspect.md: the registry's δ = 1e-4 (slime's) drops 75 % of 128-token
    # bf16 sequences on the embedded model, where the δ that keeps 95 % is 0.016; TRL suggests 0.5
    ("opsm", "delta"): (lambda v: v is not None and v >= 0.016, "δ ≥ 0.016 (1e-4 drops 75 % of bf16 sequences)"),
    # docs/choosing.md#long-answers: TRM with one of its tests off (`trm_max_kl: null`, the average test alone, or the
    # top-K bound with `avg_kl: null`) — otherwise the paper's thresholds, the registry's defaults
    ("trm", "max_kl"): (lambda v: v is None or v == 0.05, "the paper's 0.05 or null"),
    ("trm", "avg_kl"): (lambda v: v is None or v == 0.001, "the paper's 0.001 or null"),
}
VERL_ALP_MIN_STD = 3e-2  # docs/frameworks/verl.md#alp-under-bf16: a smaller σ rounds away under verl's bf16 param_dtype
VERL_MAX_MIN_P = 1e-3  # docs/choosing.md#truncated-sampling: OFFPOLICY_VERL {sampling: {min_p: 0.001}}


def _specs(correction) -> list[dict]:
    """A correction setting (a name, a spec or a list of them) as a list of spec dicts."""
    if correction is None:
        return []
    items = correction if isinstance(correction, list) else [correction]
    return [{"name": s} if isinstance(s, str) else dict(s) for s in items]


def _python_specs(source: str) -> list[dict]:
    """Correction specs written in Python: ``{"name": <registered>, ...}`` literals and ``op.<registered>(k=v)``."""
    import ast

    from offpolicy.registry import CORRECTIONS

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "name" for k in node.keys):
            try:
                spec = ast.literal_eval(node)
            except ValueError:
                continue  # a dict with a non-literal value: not a spec written out
            if spec.get("name") in CORRECTIONS:
                found.append(spec)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
              and node.func.value.id == "op" and node.func.attr in CORRECTIONS):
            found.append({"name": node.func.attr, **{k.arg: ast.literal_eval(k.value) for k in node.keywords}})
    return found


def _verl_blocks(text: str) -> list[str]:
    """``OFFPOLICY_VERL`` settings written in a YAML config or a launch command's override."""
    import yaml

    blocks = re.findall(r"env_vars\.OFFPOLICY_VERL='([^']*)'", text)
    if "\nray_kwargs:" not in text:
        return blocks  # not a verl YAML config
    config = yaml.safe_load(text)
    env = (((config or {}).get("ray_kwargs") or {}).get("ray_init") or {}).get("runtime_env", {}).get("env_vars", {}) \
        if isinstance(config, dict) else {}
    return blocks + ([env["OFFPOLICY_VERL"]] if "OFFPOLICY_VERL" in env else [])


def _example_settings() -> list[tuple[str, dict]]:
    """Every correction spec the examples and the README show, as ``(where, spec)``; ALP and sampling of the verl
    blocks as pseudo-specs ``{"name": "verl_alp" | "verl_sampling", ...}``."""
    import yaml

    from offpolicy.integrations.verl.settings import settings_from_text
    from offpolicy.train.config import load_config
    from offpolicy.train.presets import PRESETS, chain_specs

    found: list[tuple[str, dict]] = []
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    texts = {"README.md": readme, **{f"examples/{p.name}": p.read_text(encoding="utf-8")
                                     for p in sorted((ROOT / "examples").glob("*.*")) if p.suffix in (".yaml", ".py")}}
    for where, text in texts.items():
        for block in _verl_blocks(text):
            settings = settings_from_text(block)
            found += [(where, s) for s in _specs(settings.correction)]
            if settings.alp is not None:
                found.append((where, {"name": "verl_alp", "init_std": settings.alp.init_std, "text": text}))
            if settings.sampling.min_p is not None:
                found.append((where, {"name": "verl_sampling", "min_p": settings.sampling.min_p}))
    for body in re.findall(r"^```python\n(.*?)^```", readme, re.S | re.M):
        found += [("README.md", s) for s in _python_specs(body)]
    for path in sorted((ROOT / "examples").glob("*.py")):
        found += [(f"examples/{path.name}", s) for s in _python_specs(path.read_text(encoding="utf-8"))]
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        if "algorithm" not in (yaml.safe_load(path.read_text(encoding="utf-8")) or {}):
            continue  # not a trainer config (the verl fragment, read above)
        cfg = load_config(path, ["model.path=tiny"])  # a local model's path stands in for the shipped one
        found += [(f"examples/{path.name}", s) for s in chain_specs(PRESETS[cfg.algorithm.preset], cfg.algorithm)]
    return found


def _problems(found: list[tuple[str, dict]]) -> list[str]:
    import inspect
    import math

    from offpolicy.registry import CORRECTIONS

    problems = []
    for where, spec in found:
        name = spec["name"]
        if name == "verl_alp":
            fp32 = re.search(r"param_dtype\W+(fp32|float32)", spec["text"]) is not None
            if not fp32 and spec["init_std"] < VERL_ALP_MIN_STD:
                problems.append(f"{where}: verl ALP init_std {spec['init_std']} < {VERL_ALP_MIN_STD} under bf16")
            continue
        if name == "verl_sampling":
            if spec["min_p"] > VERL_MAX_MIN_P:
                problems.append(f"{where}: verl sampling.min_p {spec['min_p']} > {VERL_MAX_MIN_P}")
            continue
        defaults = {k: p.default for k, p in inspect.signature(CORRECTIONS[name]).parameters.items()}
        for key, value in spec.items():
            if key == "name" or isinstance(value, (str, bool)) or (value is not None and not isinstance(value, (int, float))):
                continue  # levels, modes, sources: not thresholds
            if (name, key) in RECOMMENDED:
                ok, why = RECOMMENDED[name, key]
                if not ok(value):
                    problems.append(f"{where}: {name}.{key} = {value}, the docs recommend {why}")
            elif value is None or not math.isclose(value, defaults.get(key, math.nan), rel_tol=1e-9):
                problems.append(f"{where}: {name}.{key} = {value}, not the registry's {defaults.get(key)} and not "
                                "one the docs recommend (add it to RECOMMENDED with the page that does)")
    return problems


def test_the_examples_thresholds_are_the_ones_the_docs_recommend():
    found = _example_settings()
    names = {(where, s["name"]) for where, s in found}
    # the places the reader meets first are read: the README's TRL, verl and library snippets, the verl fragment
    assert {("README.md", "tis"), ("README.md", "opsm"), ("README.md", "icepop")} <= names, names
    assert {("examples/verl_offpolicy.yaml", n) for n in ("opsm", "verl_alp", "verl_sampling")} <= names, names
    assert ("examples/quickstart_verl.py", "tis") in names  # the launch command's OFFPOLICY_VERL
    assert ("examples/tiny_trm_int8kv.yaml", "trm") in names and ("examples/local_model_dvp_mis.yaml", "veto") in names
    assert _problems(found) == []


def test_the_threshold_check_catches_the_documented_bad_values():
    # slime's OPSM δ = 1e-4 and the paper's ALP σ = 1e-4 under verl's bf16, the values the docs warn about
    bad = [("x", {"name": "opsm", "delta": 1e-4}), ("x", {"name": "verl_alp", "init_std": 1e-4, "text": ""}),
           ("x", {"name": "verl_sampling", "min_p": 0.01}), ("x", {"name": "tis", "upper": 7.0})]
    assert len(_problems(bad)) == 4
    fp32 = ("x", {"name": "verl_alp", "init_std": 1e-4, "text": "param_dtype: fp32"})
    assert _problems([fp32, ("x", {"name": "opsm", "delta": 0.5}), ("x", {"name": "trm", "avg_kl": None})]) == []
    specs = _python_specs('op.chain(op.icepop(), op.opsm(delta=1e-4)); c = {"name": "tis", "upper": 2.0}')
    assert sorted(specs, key=lambda s: s["name"]) == [{"name": "icepop"}, {"name": "opsm", "delta": 1e-4},
                                                      {"name": "tis", "upper": 2.0}]
    assert _problems([("x", s) for s in specs]) == ["x: opsm.delta = 0.0001, the docs recommend δ ≥ 0.016 (1e-4 drops "
                                                    "75 % of bf16 sequences)"]

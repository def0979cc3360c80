"""The version matrix: a framework installed outside the tested range warns once per process (never an error), inside
it nothing is said; the TRL trainer and the verl plug-in both check when they start."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from offpolicy.integrations import versions
from offpolicy.integrations.versions import VERSIONS, UntestedVersionWarning, check_versions, version_tuple


@pytest.fixture(autouse=True)
def _fresh_warning_memory(monkeypatch):
    monkeypatch.setattr(versions, "_WARNED", set())


@pytest.mark.parametrize("package, inside, outside", [
    ("torch", ["2.2.0", "2.13.0+cpu", "2.14.9"], ["2.1.2", "2.15.0", "3.0.0"]),
    ("trl", ["1.16.0", "1.16.3"], ["1.15.9", "1.17.0", "0.20.0", "2.0.0"]),
    ("verl", ["0.9.0", "0.9.1"], ["0.8.9", "0.10.0", "1.0.0"]),
    ("vllm", ["0.22.0", "0.31.1", "0.32.0"], ["0.21.0", "0.33.0"]),
])
def test_the_ranges(package, inside, outside):
    assert all(VERSIONS[package].supports(v) for v in inside)
    assert not any(VERSIONS[package].supports(v) for v in outside)


def test_outside_the_range_warns_once_naming_both_versions():
    with pytest.warns(UntestedVersionWarning) as caught:
        first = check_versions("trl", "verl", user="X", installed={"trl": "1.18.0", "verl": "0.9.1"})
    assert first == ["X was tested with trl 1.16.0 (supported >=1.16,<1.17); trl 1.18.0 is installed: run "
                     "tests/integrations to check it"]
    assert len(caught) == 1 and str(caught[0].message) == first[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same package and version again: said already, not again
        assert check_versions("trl", user="X", installed={"trl": "1.18.0"}) == first


def test_inside_the_range_or_not_installed_says_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_versions("trl", "vllm", user="X", installed={"trl": "1.16.0", "vllm": None}) == []
    with pytest.raises(ValueError, match="unknown package 'tensorflow'"):
        check_versions("tensorflow", user="X")
    with pytest.raises(ValueError, match="version must start with a number"):
        version_tuple("latest")


def _pyproject_requirements() -> list[tuple[str, Requirement]]:
    """Every requirement of pyproject.toml as ``(where, Requirement)``: the dependencies and each extra."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (the CI's)
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text("utf-8"))["project"]
    found = [("dependencies", Requirement(r)) for r in project["dependencies"]]
    for extra, requirements in project["optional-dependencies"].items():
        found += [(f"[{extra}]", Requirement(r)) for r in requirements]
    return found


def test_pyproject_bounds_are_the_tables_requirements():
    # one source: a framework's bound in pyproject (dependencies and every extra) is VERSIONS' requirement (the tested
    # range for TRL and verl, the floor alone for torch and vLLM), or a pin inside the tested range
    checked: dict[str, list[str]] = {}
    for where, req in _pyproject_requirements():
        row = next((r for r in VERSIONS.values() if canonicalize_name(req.name) in r.distributions), None)
        if row is None:
            continue
        pins = [s.version for s in req.specifier if s.operator == "=="]
        if pins:
            assert all(row.supports(v) for v in pins), f"{where} {req}: outside the tested {row.package} {row.range}"
        else:
            assert req.specifier == SpecifierSet(row.requirement), f"{where} {req}: the table says {row.requirement}"
        assert req.specifier.contains(row.tested.split(" ")[0]), f"{where} {req} excludes the tested {row.tested}"
        checked.setdefault(row.package, []).append(where)
    assert sorted(checked) == sorted(VERSIONS), checked  # every row of the table bounds some requirement
    assert "[trl]" in checked["trl"] and "[verl]" in checked["verl"] and "[vllm]" in checked["vllm"]


@pytest.mark.parametrize("package, newer", [("torch", "2.15.0"), ("vllm", "0.33.0")])
def test_pip_may_install_a_newer_torch_or_vllm_than_tested(package, newer):
    # a user's newer torch / vLLM must never be downgraded by installing offpolicy: no upper bound on either in
    # pyproject (scripts/check_resolution.py asks pip's resolver in CI); the run-time warning says it is untested
    assert not VERSIONS[package].supports(newer)
    reqs = [(where, req) for where, req in _pyproject_requirements() if canonicalize_name(req.name) == package]
    assert reqs
    for where, req in reqs:
        assert req.specifier.contains(newer, prereleases=True), f"{where} {req} excludes {package} {newer}"


def test_the_pyproject_check_catches_a_wider_bound():
    # the comparison above is not vacuous: the old extras (trl<2, vllm<1) differ from the table's ranges
    assert SpecifierSet(">=1.16,<2") != SpecifierSet(VERSIONS["trl"].range)
    assert SpecifierSet(">=0.22,<1") != SpecifierSet(VERSIONS["vllm"].range)
    assert SpecifierSet("<1.17,>=1.16") == SpecifierSet(VERSIONS["trl"].range)  # order does not matter


def test_the_installed_versions_are_read_from_the_metadata():
    import torch

    assert versions.installed_version("torch") == torch.__version__
    assert versions.installed_version("no-such-package-here") is None


@pytest.mark.slow  # importing TRL and building its trainer: ~10 s on 2 quiet cores, ~20 s on shared ones
def test_the_trl_trainer_warns_outside_the_matrix(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from offpolicy_testkit.trl_toy import toy_dataset, varied_reward
    from trl import GRPOConfig

    from offpolicy.integrations.trl import OffPolicyGRPOTrainer
    from offpolicy.models.tiny import build_tiny_model

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda p: "1.99.0" if p == "trl" else real(p))
    model, tok = build_tiny_model(seed=0)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, max_steps=1, report_to=[], use_cpu=True, bf16=False, beta=0.0)
    with pytest.warns(UntestedVersionWarning, match="offpolicy's TRL trainer was tested with trl 1.16.0"):
        OffPolicyGRPOTrainer(model=model, reward_funcs=varied_reward, args=args, train_dataset=toy_dataset(),
                             processing_class=tok)


def test_the_verl_plugin_warns_outside_the_matrix(monkeypatch):
    pytest.importorskip("verl")
    from offpolicy.integrations.verl import plugin

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda p: "0.10.0" if p == "verl" else real(p))
    with pytest.warns(UntestedVersionWarning, match="offpolicy's verl plug-in was tested with verl 0.9.1"):
        plugin.install()

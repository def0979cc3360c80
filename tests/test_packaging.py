"""What a package index and a wheel need, checked without building one (scripts/check_wheel.sh builds and installs
it): every data file of the package is covered by the package-data patterns (the shipped model weights sit one folder
deeper than a ``*`` reaches), and the metadata names its license file and classifiers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _data_files() -> set[Path]:
    src = ROOT / "src" / "offpolicy"
    return {p for p in src.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts}


def test_every_data_file_of_the_package_goes_into_the_wheel():
    src = ROOT / "src" / "offpolicy"
    patterns = PROJECT["tool"]["setuptools"]["package-data"]["offpolicy"]
    covered = {p for pattern in patterns for p in src.glob(pattern) if p.is_file()}
    data = _data_files()
    assert any(p.name == "model.safetensors" for p in data) and any(p.suffix == ".jsonl" for p in data)
    assert sorted(str(p.relative_to(src)) for p in data - covered) == []


def test_the_metadata_a_package_index_shows():
    project = PROJECT["project"]
    assert project["license"] == "Apache-2.0" and (ROOT / project["license-files"][0]).is_file()
    assert "Apache License" in (ROOT / "LICENSE").read_text(encoding="utf-8")[:200]
    assert any(c.startswith("Programming Language :: Python :: 3") for c in project["classifiers"])
    assert not any(c.startswith("License ::") for c in project["classifiers"])  # PEP 639: the expression only
    assert project["readme"] == "README.md" and project["scripts"]["offpolicy"] == "offpolicy.cli:main"


def test_the_wheel_check_is_an_executable_script():
    script = ROOT / "scripts" / "check_wheel.sh"
    text = script.read_text(encoding="utf-8")
    assert os.access(script, os.X_OK)
    assert "-m build" in text and "demo --help" in text and "shipped_dir" in text


def test_requires_python_is_what_the_extras_resolve_on():
    # TRL 1.16 and vLLM declare Requires-Python >=3.11 (verl 0.9.1: >=3.10,<3.13): on 3.10 the trl and vllm extras
    # could not resolve, so the package does not claim 3.10; every Python classifier lies inside the range
    from packaging.specifiers import SpecifierSet

    requires = SpecifierSet(PROJECT["project"]["requires-python"])
    assert "3.10" not in requires and "3.11" in requires and "3.14" in requires
    minors = [c.rsplit(" ", 1)[1] for c in PROJECT["project"]["classifiers"]
              if c.startswith("Programming Language :: Python :: 3.")]
    assert minors and all(m in requires for m in minors), minors


def test_what_is_not_the_product_stays_out_of_the_package():
    # pytest's configuration (the doctest ignores: the root conftest.py) and verl's CPU-CI bridge (a cpu platform and
    # vLLM CPU weight sync for main_ppo on a machine without an accelerator) ship with the repository, not the wheel
    src = ROOT / "src" / "offpolicy"
    assert sorted(str(p.relative_to(src)) for p in src.rglob("conftest.py")) == []
    assert (ROOT / "conftest.py").is_file() and (ROOT / "offpolicy_testkit" / "verl_cpu_bridge.py").is_file()
    bridge = [p.name for p in (src / "integrations" / "verl").glob("*.py") if "set_platform(" in p.read_text("utf-8")]
    assert bridge == []

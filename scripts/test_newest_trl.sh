#!/usr/bin/env bash
# The TRL tests against the newest TRL on the package index, in a separate fresh venv: a report, allowed to fail, and
# not run by .ci/run (CI tests the TRL series the adapter is written for, 1.16.x). The trainer overrides TRL 1.16's
# internal methods, so a newer TRL may break it; this says where.
#   scripts/test_newest_trl.sh [VENV]     (default VENV: .cache/newest-trl/venv, recreated each run)
# The newest TRL is installed over the dev extra's upper bound on trl, whatever pip says about the conflict.
# Tests run with OFFPOLICY_REQUIRE_INTEGRATIONS=1: the modules that skip outside TRL 1.16 are listed as failures.
# Exit status: pytest's (0: every TRL test passed on the newest TRL).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.cache/newest-trl/venv}"
python3 -m venv --clear "$venv"
# shellcheck disable=SC1091
source "$venv/bin/activate"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OFFPOLICY_CACHE="$PWD/.cache/offpolicy"
pip install -q torch==2.13.0 -e '.[dev]'
pip install -q --upgrade trl  # pip's note that offpolicy[dev] bounds trl is expected
newest="$(python -c 'import trl; print(trl.__version__)')"
echo "== TRL $newest (tested series: 1.16.x)" >&2
tests=(tests/integrations/test_trl*.py
       tests/integrations/test_versions.py::test_the_trl_trainer_warns_outside_the_matrix
       tests/test_quickstarts.py::test_the_trl_quickstart_corrects_a_real_mismatch
       tests/test_quickstarts.py::test_the_trl_page_runs_the_script_it_shows)
report="$(mktemp)"
set +e
OFFPOLICY_REQUIRE_INTEGRATIONS=1 python -m pytest -rfE "${tests[@]}" 2>&1 | tee "$report"
status=${PIPESTATUS[0]}
set -e
echo "== TRL $newest: pytest exit status $status; failures:" >&2
grep -E "^(FAILED|ERROR) " "$report" >&2 || echo "   none" >&2
exit "$status"

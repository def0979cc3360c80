#!/usr/bin/env bash
# Lint and type checks, as CI runs them (.ci/run, between its two test phases). Re-runnable on any tree:
#   scripts/lint.sh          check only (exit 1 on any finding)
#   scripts/lint.sh --fix    first apply ruff's safe fixes (import order, pyupgrade, unused imports), then check
# The configuration is in pyproject.toml ([tool.ruff], [tool.mypy]). Tools: the dev extra (pip install -e '.[dev]').
# Not run: `ruff format` — the code keeps its hanging-indent style, which the formatter would rewrite in ~120 files.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if [ "${1:-}" = "--fix" ]; then
  "$PY" -m ruff check --fix src tests benchmarks examples offpolicy_testkit scripts || true
fi
status=0
echo "ruff check" >&2
"$PY" -m ruff check src tests benchmarks examples offpolicy_testkit scripts || status=1
echo "mypy src/offpolicy" >&2
"$PY" -m mypy || status=1
exit "$status"

#!/usr/bin/env bash
# The docs site, as CI builds it (.ci/run's docs step): `mkdocs build --strict` with every warning counted.
#   scripts/build_docs.sh [SITE_DIR]     # SITE_DIR: where the site goes (default: a fresh temporary folder)
# mkdocs counts a warning only when it is logged: `--quiet` raises the log level above WARNING, and a strict build
# with it exits 0 whatever it warned about (a page left out of the nav, a broken link or anchor, a docstring
# mkdocstrings cannot render). So no --quiet here; the INFO lines are the price. Exit status: mkdocs's own.
# Tools: the docs extra (pip install -r <the docs extra of pyproject.toml>, or -e '.[docs]').
set -euo pipefail
cd "$(dirname "$0")/.."
site="${1:-$(mktemp -d)}"
NO_MKDOCS_2_WARNING=1 exec mkdocs build --strict --site-dir "$site"

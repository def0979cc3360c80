#!/usr/bin/env bash
# The package as a user gets it: build the sdist and the wheel (python -m build, in isolation), install the wheel into
# a fresh virtual environment with torch and the cli extra, and check — from outside the checkout, with an empty model
# cache — that `import offpolicy` works, that the shipped model weights and task data came with it, that the embedded
# models load from them, that `offpolicy demo --help` runs, and that the metadata a package index shows is there.
#
#   scripts/check_wheel.sh              # ~2 min with torch's wheel cached by pip, longer when it downloads
#   KEEP=1 scripts/check_wheel.sh       # keep the work folder (its path is printed)
#
# Needs network access (or a local index) for build, setuptools and the cli extra's packages. Exit 0: every check passed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${TORCH:-torch==2.13.0}
work="$(mktemp -d)"
if [ "${KEEP:-0}" = "1" ]; then echo "work folder: $work"; else trap 'rm -rf "$work"' EXIT; fi

echo "== build: sdist + wheel" >&2
"$PY" -m venv "$work/build-env"
"$work/build-env/bin/pip" install -q build >"$work/pip-build.log" 2>&1 || { tail -30 "$work/pip-build.log"; exit 1; }
"$work/build-env/bin/python" -m build --outdir "$work/dist" . >"$work/build.log" 2>&1 || { tail -30 "$work/build.log"; exit 1; }
wheel="$(ls "$work"/dist/offpolicy-*.whl)"
sdist="$(ls "$work"/dist/offpolicy-*.tar.gz)"
echo "   $(basename "$wheel"), $(basename "$sdist")" >&2

echo "== the wheel's contents" >&2
"$work/build-env/bin/python" - "$wheel" "$sdist" <<'EOF'
import sys, tarfile, zipfile
from pathlib import Path

wheel, sdist = sys.argv[1], sys.argv[2]
names = zipfile.ZipFile(wheel).namelist()
src = Path("src/offpolicy")
# every non-Python file of the package (model weights, tokenizers, task data, py.typed) must be in the wheel
data = sorted(str(p.relative_to("src")) for p in src.rglob("*")
              if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts)
missing = [d for d in data if d not in names]
assert data and not missing, f"not in the wheel: {missing}"
assert any(n.endswith("model.safetensors") for n in names) and any(n.endswith(".jsonl") for n in names)
assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "LICENSE not in the wheel"
meta = next(zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
for field in ("License-Expression: Apache-2.0", "Classifier: ", "Requires-Python: >=3.11", "Provides-Extra: cli",
              "Description-Content-Type: text/markdown"):
    assert field in meta, f"METADATA lacks {field!r}"
members = tarfile.open(sdist).getnames()
for wanted in ("LICENSE", "README.md", "pyproject.toml"):
    assert any(m.endswith("/" + wanted) for m in members), f"sdist lacks {wanted}"
print(f"   {len(names)} files, {len(data)} data files, METADATA and LICENSE present", file=sys.stderr)
EOF

echo "== install into a fresh venv: the wheel[cli] + $TORCH" >&2
"$PY" -m venv "$work/venv"
"$work/venv/bin/pip" install -q "$wheel[cli]" "$TORCH" >"$work/pip-install.log" 2>&1 \
  || { tail -30 "$work/pip-install.log"; exit 1; }

echo "== use it from outside the checkout, with an empty model cache" >&2
cd "$work"
export OFFPOLICY_CACHE="$work/empty-cache" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$work/venv/bin/python" - <<'EOF'
import sys

import offpolicy as op

assert "site-packages" in op.__file__, f"imported {op.__file__}, not the installed wheel"
import torch
import time

from offpolicy.models import load_model
from offpolicy.models.cache import shipped_dir
from offpolicy.tasks import get_task

for name in ("tiny", "lab"):  # from the weights that ship in the wheel: copied, not warm-started (that takes minutes)
    shipped = shipped_dir(name)
    assert shipped is not None and "site-packages" in str(shipped), f"no shipped weights for {name}: {shipped}"
    started = time.perf_counter()
    model, tok = load_model(name)
    ids = tok("1+2=")["input_ids"]
    assert torch.isfinite(model(input_ids=torch.tensor([ids])).logits).all()
    assert time.perf_counter() - started < 60, f"{name} took {time.perf_counter() - started:.0f} s: warm-started?"
task = get_task("arithmetic")
assert task.examples(2, seed=0)
batch = op.LogProbBatch(logp=torch.zeros(1, 2), rollout_logp=torch.tensor([[0.0, -2.0]]), mask=torch.ones(1, 2),
                        advantages=torch.ones(1))
assert op.tis(upper=2.0)(batch).weights.tolist() == [[1.0, 2.0]]
print(f"   import offpolicy {op.__version__ if hasattr(op, '__version__') else ''}: ok; tiny and lab models load "
      "from the wheel; tasks and corrections work", file=sys.stderr)
EOF
"$work/venv/bin/offpolicy" demo --help >/dev/null
"$work/venv/bin/offpolicy" presets >/dev/null
echo "== ok: the wheel installs and runs" >&2

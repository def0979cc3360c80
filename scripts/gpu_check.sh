#!/usr/bin/env bash
# A GPU user's first run, checked in one command (≤ 8 minutes): the fused kernels against plain math at V = 151,936
# in bf16 and fp32 (forward and backward), the parameter layer's device digest, `offpolicy train` on a bf16 policy
# with the transformers engine, and the inspection recipe, all on CUDA; one PASS / FAIL / SKIPPED line each and
# $OUT/gpu_check.json (./gpu_check.json without OUT). Needs python3 with CUDA torch; uses the work tree's source
# (PYTHONPATH=src:.), installs nothing, reads no network. `scripts/gpu_check.sh --cpu-dry-run` runs it on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OFFPOLICY_CACHE="${OFFPOLICY_CACHE:-$PWD/.cache/offpolicy}"  # the embedded model, built here on first use
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec timeout 480 "${PYTHON:-python3}" scripts/gpu_check.py "$@"

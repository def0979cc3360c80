#!/usr/bin/env bash
# One GPU run: the fused kernels against naive / TRL / verl / Liger at V = 151,936 and the bf16 engine's mismatch on
# the lab model (benchmarks/gpu.py), in at most 8 minutes; writes gpu.json (or $OUT/gpu.json when OUT is set).
# Needs PyTorch with CUDA, transformers and offpolicy installed (Triton, TRL, verl, Liger are used if importable);
# no vLLM, no network: the lab model comes from OFFPOLICY_CACHE (built there on first use if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export OFFPOLICY_CACHE="${OFFPOLICY_CACHE:-$PWD/.cache/offpolicy}"
out="${OUT:-.}/gpu.json"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 480 python benchmarks/gpu.py --device cuda --out "$out" "$@"

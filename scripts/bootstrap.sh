#!/usr/bin/env bash
# Create .venv and install the project with its test extras. Idempotent: a second run only checks.
# torch comes first: without CUDA we take the CPU wheel (torch==2.13.0), so no multi-GB CUDA build is pulled in.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    .venv/bin/pip install -q torch torchvision
  else
    .venv/bin/pip install -q torch==2.13.0
  fi
fi
# The media preprocessing tests compare with transformers' Kimi_K25 processors, built on torchvision. The registry's
# torchvision is built against CUDA torch: on a CPU machine it goes to .venv/reference, outside site-packages, where
# only the tests look (tests/reference_torchvision.py); in site-packages it would break transformers' model imports.
if ! command -v nvidia-smi >/dev/null 2>&1 && [ ! -d .venv/reference/torchvision ]; then
  .venv/bin/pip install -q --no-deps --target .venv/reference torchvision==0.28.0
fi
stamp=.venv/.installed-$(cat pyproject.toml | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  .venv/bin/pip install -q -e ".[test]"
  touch "$stamp"
fi

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
    .venv/bin/pip install -q torch
  else
    .venv/bin/pip install -q torch==2.13.0
  fi
fi
stamp=.venv/.installed-$(cat pyproject.toml | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  .venv/bin/pip install -q -e ".[test]"
  touch "$stamp"
fi

#!/usr/bin/env bash
# One-command set-up: Python environment, a real tritonserver (from PyPI), the embedded default model.
# Idempotent; everything lands in the repository (.venv/, .deps/, models/). Nothing downloads at run time.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON_BIN:-python3}"
log() { echo "[setup] $*" >&2; }

if [[ ! -x .venv/bin/python ]]; then
  log "creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, transformers, tritonclient.grpc, gguf" 2>/dev/null \
    || [[ requirements/dev.txt -nt .venv/.installed ]]; then
  log "installing requirements/dev.txt"
  .venv/bin/python -m pip install -q --upgrade pip >&2
  .venv/bin/python -m pip install -q -r requirements/dev.txt >&2
  touch .venv/.installed
fi
log "tritonserver"
PYTHON=.venv/bin/python bash scripts/setup_tritonserver.sh
log "embedded default model"
.venv/bin/python scripts/make_default_model.py --out models
log "tiny Qwen3.6-vocabulary hybrid (tests, and a hybrid to serve by a config switch)"
.venv/bin/python scripts/make_tiny_hybrid.py --out models/qwen36-tiny
log "done"

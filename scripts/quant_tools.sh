#!/usr/bin/env bash
# Installs llm-compressor in a venv of its own (.venv-quant), used only to
# write the peer checkpoints of `make compare-quant`: llmcompressor 0.14.0.1
# requires numpy>=2, transformers<=5.17 and torch<=2.14, which .venv (numpy<2
# for the Triton stub, transformers 5.19) cannot share.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${QUANT_VENV:-.venv-quant}
PYTHON=${PYTHON:-python3}
source scripts/venv_stamp.sh
if stamp_current "$VENV" scripts/quant_tools.sh; then
  exit 0
fi
echo "==> creating $VENV with llm-compressor (a few minutes)"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "llmcompressor==0.14.0.1"
stamp_write "$VENV" scripts/quant_tools.sh
echo "==> ready: $VENV/bin/python perf/quant_compare/peers.py --help"

#!/usr/bin/env bash
# Installs perf_analyzer in a tool venv of its own (.venv-perf): the glibc-2.35
# build shipped in tritonclient[all]==2.50.0 (later wheels need glibc 2.38),
# plus its libb64 and libcudart needs. Kept apart from .venv because its
# tritonclient pins protobuf<5, which vLLM cannot use.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PERF_VENV:-.venv-perf}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.setup-stamp"
want="$(sha256sum scripts/perf_tools.sh | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi
if ! ldconfig -p | grep -q libb64.so.0d; then
  echo "==> installing libb64-0d (apt)"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libb64-0d
fi
echo "==> creating $VENV with perf_analyzer"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "tritonclient[all]==2.50.0" nvidia-cuda-runtime-cu12
echo "$want" > "$STAMP"
echo "==> perf_analyzer ready: scripts/perf_analyzer.sh --help"

#!/usr/bin/env bash
# Installs the load tools in venvs of their own, apart from .venv because
# perf_analyzer's tritonclient pins protobuf<5, which vLLM cannot use:
#   .venv-perf   perf_analyzer (the glibc-2.35 build shipped in
#                tritonclient[all]==2.50.0; later wheels need glibc 2.38) with
#                its libb64 and libcudart needs
#   .venv-genai  genai-perf 0.0.16 (driving that same perf_analyzer) and locust
#   .venv-aiperf AIPerf 0.13 (genai-perf's successor; its own HTTP client, pins of its own)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PERF_VENV:-.venv-perf}
PYTHON=${PYTHON:-python3}
source scripts/venv_stamp.sh
if stamp_current "$VENV" scripts/perf_tools.sh; then
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
GENAI=${GENAI_VENV:-.venv-genai}
echo "==> creating $GENAI with genai-perf"
"$PYTHON" -m venv "$GENAI"
"$GENAI/bin/python" -m pip install -q --disable-pip-version-check "genai-perf==0.0.16" "locust==2.47.0"
AIPERF=${AIPERF_VENV:-.venv-aiperf}
echo "==> creating $AIPERF with aiperf"
"$PYTHON" -m venv "$AIPERF"
"$AIPERF/bin/python" -m pip install -q --disable-pip-version-check "aiperf==0.13.0"
stamp_write "$VENV" scripts/perf_tools.sh
echo "==> ready: scripts/perf_analyzer.sh --help, scripts/genai_perf.sh --help, $GENAI/bin/locust, $AIPERF/bin/aiperf"

#!/usr/bin/env bash
# Runs genai-perf (installed by `make perf-tools`) with the project's perf_analyzer on PATH.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${PERF_VENV:-$ROOT/.venv-perf}"
GENAI="${GENAI_VENV:-$ROOT/.venv-genai}"
CUDART="$("$VENV/bin/python" -c 'import nvidia.cuda_runtime, os; print(os.path.join(list(nvidia.cuda_runtime.__path__)[0], "lib"))')"
export LD_LIBRARY_PATH="$CUDART${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$VENV/bin:$PATH"
exec "$GENAI/bin/genai-perf" "$@"

#!/usr/bin/env bash
# Runs the project's perf_analyzer (installed by `make perf-tools`) with its libraries found.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${PERF_VENV:-$ROOT/.venv-perf}"
CUDART="$("$VENV/bin/python" -c 'import nvidia.cuda_runtime, os; print(os.path.join(list(nvidia.cuda_runtime.__path__)[0], "lib"))')"
export LD_LIBRARY_PATH="$CUDART${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$VENV/bin/perf_analyzer" "$@"

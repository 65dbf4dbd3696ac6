#!/usr/bin/env bash
# Starts tritonserver on our model repository in the foreground (Ctrl-C or
# SIGTERM stops it cleanly). Adds only what the CPU stack needs around the
# committed repository: the backend directory and the venv's libpython.
#   A3B_HOST (127.0.0.1)  A3B_HTTP_PORT (8000)  A3B_GRPC_PORT (8001)
#   A3B_METRICS_PORT (8002)  A3B_PROFILE (cpu)  A3B_MODEL_DIR (profile's)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
TRITON_DIR="$("$PY" -c 'import importlib.util,os;print(os.path.join(os.path.dirname(importlib.util.find_spec("pytriton").origin),"tritonserver"))')"
export PATH="$VENV/bin:$PATH"
export LD_LIBRARY_PATH="$("$PY" -c 'import sysconfig;print(sysconfig.get_config_var("LIBDIR"))')${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
HOST="${A3B_HOST:-127.0.0.1}"
exec "$TRITON_DIR/bin/tritonserver" \
  --model-repository "$ROOT/model_repository" \
  --backend-directory "$TRITON_DIR/backends" \
  --http-address "$HOST" --http-port "${A3B_HTTP_PORT:-8000}" \
  --grpc-address "$HOST" --grpc-port "${A3B_GRPC_PORT:-8001}" \
  --metrics-address "$HOST" --metrics-port "${A3B_METRICS_PORT:-8002}" \
  --exit-timeout-secs "${A3B_EXIT_TIMEOUT:-30}" \
  "$@"

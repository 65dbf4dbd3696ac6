#!/usr/bin/env bash
# Starts tritonserver on our model repository in the foreground (Ctrl-C or
# SIGTERM stops it cleanly), bound to localhost unless told otherwise:
#   A3B_HOST (127.0.0.1)  A3B_HTTP_PORT (8000)  A3B_GRPC_PORT (8001)
#   A3B_METRICS_PORT (8002)  A3B_PROFILE (cpu)  A3B_MODEL_DIR (profile's)
#   A3B_ADMIN_KEY: when set, Triton's admin APIs (model repository, shared
#   memory, trace, logging, config, statistics) need the header admin-key.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
HOST="${A3B_HOST:-127.0.0.1}"
restricted=()
if [[ -n "${A3B_ADMIN_KEY:-}" ]]; then
  apis="model-repository,shared-memory,trace,logging,model-config,statistics"
  restricted=("--http-restricted-api=$apis:admin-key=$A3B_ADMIN_KEY"
              "--grpc-restricted-protocol=$apis:admin-key=$A3B_ADMIN_KEY")
fi
exec "$ROOT/scripts/tritonserver.sh" \
  --model-repository "$ROOT/model_repository" \
  --http-address "$HOST" --http-port "${A3B_HTTP_PORT:-8000}" \
  --grpc-address "$HOST" --grpc-port "${A3B_GRPC_PORT:-8001}" \
  --metrics-address "$HOST" --metrics-port "${A3B_METRICS_PORT:-8002}" \
  --exit-timeout-secs "${A3B_EXIT_TIMEOUT:-30}" \
  "${restricted[@]}" "$@"

#!/usr/bin/env bash
# Starts tritonserver on our model repository in the foreground (Ctrl-C or
# SIGTERM stops it cleanly), bound to localhost unless told otherwise:
#   A3B_HOST (127.0.0.1)  A3B_HTTP_PORT (8000)  A3B_GRPC_PORT (8001)
#   A3B_METRICS_PORT (8002)  A3B_PROFILE (cpu)  A3B_MODEL_DIR (profile's)
#   A3B_EXIT_TIMEOUT (30): seconds Triton waits for in-flight requests
#   A3B_ADMIN_KEY: when set, Triton's admin APIs (model repository, shared
#   memory, trace, logging, config, statistics) need the header admin-key.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
HOST="${A3B_HOST:-127.0.0.1}"
EXIT_TIMEOUT="${A3B_EXIT_TIMEOUT:-30}"
# Past Triton's exit timeout, this long again before the server and its
# children are killed: Triton 2.51 can keep an ensemble request counted in
# flight after its step was refused during shutdown, and then hang on exit.
KILL_GRACE=15
restricted=()
if [[ -n "${A3B_ADMIN_KEY:-}" ]]; then
  apis="model-repository,shared-memory,trace,logging,model-config,statistics"
  restricted=("--http-restricted-api=$apis:admin-key=$A3B_ADMIN_KEY"
              "--grpc-restricted-protocol=$apis:admin-key=$A3B_ADMIN_KEY")
fi

# tritonserver runs in a session of its own, so its python stubs and the vLLM
# engine processes they spawn share its process group: on the way out the
# whole group goes, including an engine orphaned by a stub that died first.
sweep() { kill -KILL -- "-$server" 2>/dev/null || true; }

stop() {
  kill -TERM "$server" 2>/dev/null || true
  for _ in $(seq $((EXIT_TIMEOUT + KILL_GRACE))); do
    if ! kill -0 "$server" 2>/dev/null; then sweep; exit 0; fi
    sleep 1
  done
  echo "serve.sh: tritonserver still running $((EXIT_TIMEOUT + KILL_GRACE)) s after the signal; killing it" >&2
  sweep
  exit 1
}

setsid "$ROOT/scripts/tritonserver.sh" \
  --model-repository "$ROOT/model_repository" \
  --http-address "$HOST" --http-port "${A3B_HTTP_PORT:-8000}" \
  --grpc-address "$HOST" --grpc-port "${A3B_GRPC_PORT:-8001}" \
  --metrics-address "$HOST" --metrics-port "${A3B_METRICS_PORT:-8002}" \
  --exit-timeout-secs "$EXIT_TIMEOUT" \
  "${restricted[@]}" "$@" &
server=$!
trap stop TERM INT
status=0
wait "$server" || status=$?
sweep
exit "$status"

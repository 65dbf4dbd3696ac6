#!/usr/bin/env bash
# Starts tritonserver on our model repository in the foreground, bound to
# localhost unless told otherwise:
#   A3B_HOST (127.0.0.1)  A3B_HTTP_PORT (8000)  A3B_GRPC_PORT (8001)
#   A3B_METRICS_PORT (8002)  A3B_PROFILE (cpu)  A3B_MODEL_DIR (profile's)
#   A3B_EXIT_TIMEOUT (30): on SIGTERM/Ctrl-C, seconds in-flight requests get
#     to finish while new ones are refused ("server shutting down")
#   A3B_ADMIN_KEY: when set, Triton's admin APIs (model repository, shared
#     memory, trace, logging, config, statistics) need the header admin-key.
#   A3B_MODEL_REPOSITORY (model_repository): another copy of it, e.g. one
#     rendered with LoRA adapters (a3b-render --repository DIR --lora ...)
#   A3B_TRITONSERVER: the server binary (scripts/tritonserver.sh, the
#     pip-installed one; the GPU image sets its own)
# Extra arguments go to tritonserver. A second Ctrl-C skips the drain.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
HOST="${A3B_HOST:-127.0.0.1}"
METRICS_PORT="${A3B_METRICS_PORT:-8002}"
EXIT_TIMEOUT="${A3B_EXIT_TIMEOUT:-30}"
# After the drain: Triton's own exit timeout, for requests that outlived it
# and the models' unload (vLLM's engine shutdown)...
STOP_TIMEOUT=10
# ...and this long again before the server and its children are killed:
# Triton 2.51 keeps `ensemble` loaded while any client holds a gRPC stream
# open, even an idle one, and then does not exit by itself. Every request has
# ended by then, so the kill loses no work.
KILL_GRACE=5
PY="${VENV:-$ROOT/.venv}/bin/python"
[[ -x "$PY" ]] || PY=python3
# a3b_llm refuses new requests while this file exists (a3b_backend/serving/drain.py).
export A3B_DRAIN_FILE="${A3B_DRAIN_FILE:-$(mktemp -u "${TMPDIR:-/tmp}/a3b-drain.XXXXXX")}"
rm -f "$A3B_DRAIN_FILE"
restricted=()
if [[ -n "${A3B_ADMIN_KEY:-}" ]]; then
  apis="model-repository,shared-memory,trace,logging,model-config,statistics"
  restricted=("--http-restricted-api=$apis:admin-key=$A3B_ADMIN_KEY"
              "--grpc-restricted-protocol=$apis:admin-key=$A3B_ADMIN_KEY")
fi

# tritonserver runs in a session of its own, so its python stubs and the vLLM
# engine processes they spawn share its process group: on the way out the
# whole group goes, including an engine orphaned by a stub that died first.
sweep() { kill -KILL -- "-$server" 2>/dev/null || true; rm -f "$A3B_DRAIN_FILE"; }

# Triton refuses an ensemble's next step once it is stopping, so in-flight
# streams are drained first and the server is stopped with none left.
stop() {
  trap '' TERM
  touch "$A3B_DRAIN_FILE"
  [[ "$HOST" == 0.0.0.0 ]] && metrics_host=127.0.0.1 || metrics_host="$HOST"
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m a3b_backend.serving.drain \
    --metrics-url "http://$metrics_host:$METRICS_PORT/metrics" --timeout "$EXIT_TIMEOUT" || true
  kill -TERM "$server" 2>/dev/null || true
  for _ in $(seq $((STOP_TIMEOUT + KILL_GRACE))); do
    if ! kill -0 "$server" 2>/dev/null; then sweep; exit 0; fi
    sleep 1
  done
  echo "serve.sh: tritonserver still running $((STOP_TIMEOUT + KILL_GRACE)) s after the signal; killing it" >&2
  sweep
  exit 1
}

setsid "${A3B_TRITONSERVER:-$ROOT/scripts/tritonserver.sh}" \
  --model-repository "${A3B_MODEL_REPOSITORY:-$ROOT/model_repository}" \
  --http-address "$HOST" --http-port "${A3B_HTTP_PORT:-8000}" \
  --grpc-address "$HOST" --grpc-port "${A3B_GRPC_PORT:-8001}" \
  --metrics-address "$HOST" --metrics-port "$METRICS_PORT" \
  --exit-timeout-secs "$STOP_TIMEOUT" \
  "${restricted[@]}" "$@" &
server=$!
trap stop TERM INT
status=0
wait "$server" || status=$?
sweep
exit "$status"

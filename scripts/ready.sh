#!/usr/bin/env bash
# Readiness that includes the vLLM engine: exit 0 only when Triton reports
# ready AND a3b_llm's engine is up (a3b_engine_up 1). Triton 2.51 gives a
# Python model no way to mark itself not-ready, so while a3b_llm restarts a
# dead engine /v2/health/ready stays 200; use this as the readiness probe.
#   A3B_HOST (127.0.0.1)  A3B_HTTP_PORT (8000)  A3B_METRICS_PORT (8002)
set -euo pipefail
HOST="${A3B_HOST:-127.0.0.1}"
curl -sf -o /dev/null --max-time 2 "http://$HOST:${A3B_HTTP_PORT:-8000}/v2/health/ready" || {
  echo "not ready: Triton /v2/health/ready failed"; exit 1; }
metrics="$(curl -sf --max-time 2 "http://$HOST:${A3B_METRICS_PORT:-8002}/metrics")" || {
  echo "not ready: metrics endpoint unreachable"; exit 1; }
if ! grep -q '^a3b_engine_up{.*} 1$' <<<"$metrics"; then
  echo "not ready: a3b_llm's vLLM engine is down or restarting (a3b_engine_up != 1)"; exit 1
fi
echo ready

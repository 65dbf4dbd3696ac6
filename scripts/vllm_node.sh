#!/usr/bin/env bash
# A secondary node of a multi-node profile (docs/deployment.md): vLLM's
# headless workers for node A3B_NODE_RANK, which join the engine of node 0
# (scripts/serve.sh with the same A3B_PROFILE) at A3B_MASTER_ADDR:A3B_MASTER_PORT.
#   A3B_PROFILE (a multi-node one: cpu-2node, multinode)  A3B_MODEL_DIR
#   A3B_NODE_RANK (1..nodes-1), or A3B_POD_INDEX (a StatefulSet's pod index; rank = index + 1)
#   A3B_MASTER_ADDR (127.0.0.1)  A3B_MASTER_PORT (29501)
#   A3B_NODE_TIMEOUT: stop after this many seconds (unset: run until stopped)
# Start node 0 and the others in any order; node 0's engine waits for them.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${VENV:-$ROOT/.venv}/bin/python"
[[ -x "$PY" ]] || PY=python3
if [[ -n "${A3B_POD_INDEX:-}" ]]; then
  export A3B_NODE_RANK=$((A3B_POD_INDEX + 1))
fi
bound=()
if [[ -n "${A3B_NODE_TIMEOUT:-}" ]]; then
  bound=(timeout --kill-after=10 "$A3B_NODE_TIMEOUT")
fi
exec "${bound[@]}" "$PY" -m a3b_backend.engine.node

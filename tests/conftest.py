"""Shared fixtures. The served tests start ONE real tritonserver per session."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "models" / "smollm2-135m-instruct"
SERVER_START_TIMEOUT_S = 600


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    if not (MODEL_DIR / "tokenizer.json").exists():
        pytest.fail(f"default model missing at {MODEL_DIR}: run `make model`")
    return AutoTokenizer.from_pretrained(MODEL_DIR)


def _free_ports(count: int) -> list[int]:
    """Free ports below the kernel's ephemeral range, which vLLM's own
    sockets draw from while the server starts."""
    rng = random.Random()
    while True:
        base = rng.randrange(20000, 30000 - count)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return list(range(base, base + count))
        except OSError:
            continue


class Server:
    def __init__(self, http_port: int, grpc_port: int, metrics_port: int, proc: subprocess.Popen, log: Path):
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.proc, self.log = proc, log

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def is_ready(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    """The real tritonserver on ports of its own, so a running `make serve` is untouched."""
    ports = _free_ports(3)
    log = tmp_path_factory.mktemp("server") / "tritonserver.log"
    env = dict(os.environ, A3B_HTTP_PORT=str(ports[0]), A3B_GRPC_PORT=str(ports[1]),
               A3B_METRICS_PORT=str(ports[2]), VENV=str(Path(sys.executable).parent.parent))
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "serve.sh")], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    srv = Server(*ports, proc=proc, log=log)
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while not srv.is_ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill_group(proc)
            pytest.fail(f"tritonserver did not become ready; log tail:\n{log.read_text()[-5000:]}")
        time.sleep(2)
    yield srv
    proc.terminate()
    try:
        proc.wait(timeout=60)
    finally:
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    """The server, its python stubs and vLLM's engine processes: nothing may outlive the session."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()

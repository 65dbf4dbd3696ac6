"""A real tritonserver on free local ports, started through scripts/serve.sh:
for the served tests and the benchmarks that need a server of their own, so a
running `make serve` is never touched."""
from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from a3b_backend.profiles import PROJECT_ROOT

if TYPE_CHECKING:
    import psutil

START_TIMEOUT_S = 600


def free_ports(count: int) -> list[int]:
    """Consecutive free ports below the kernel's ephemeral range, which vLLM's
    own sockets draw from while the server starts."""
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


# vLLM titles its engine processes (EngineCore, Worker) "VLLM::<name>"
ENGINE_PROCESS = re.compile(r"^VLLM::")


def process_name(cmdline: list[str]) -> str:
    """A model's name for its Python stub, vLLM's title for an engine process,
    else the program's file name ('tritonserver', 'bash', ...)."""
    command = " ".join(cmdline)
    if stub := re.search(r"/([A-Za-z0-9_]+)/\d+/model\.py", command):
        return stub.group(1)
    if ENGINE_PROCESS.match(command):
        return command.split()[0]
    return Path(cmdline[0]).name if cmdline else "?"


def named_processes(root) -> Iterator[tuple[str, "psutil.Process"]]:
    """The psutil process `root` and its descendants that still exist, each with its `process_name`."""
    import psutil

    for proc in [root, *root.children(recursive=True)]:
        try:
            yield process_name(proc.cmdline()), proc
        except psutil.NoSuchProcess:
            continue


def engine_run_queue_wait_s(root) -> dict[str, float]:
    """Seconds so far that vLLM's engine processes in the tree of the psutil
    process `root` were ready to run but waited for a CPU, by process title:
    the kernel's schedstat of the threads that carry the process's name (the
    main thread and OpenMP's). Helper threads with names of
    their own are left out: torch's gloo threads, bound to the worker's CPUs,
    wake now and then and queue behind the busy worker, which says nothing of
    what delays a step."""
    import psutil

    totals: dict[str, float] = {}
    for name, proc in named_processes(root):
        if not ENGINE_PROCESS.match(name):
            continue
        try:
            tasks = Path(f"/proc/{proc.pid}/task")
            title = (tasks.parent / "comm").read_text()
            waited_ns = sum(int((task / "schedstat").read_text().split()[1])
                            for task in tasks.iterdir() if (task / "comm").read_text() == title)
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            continue
        totals[name] = totals.get(name, 0.0) + waited_ns / 1e9
    return totals


def scrape_metrics(metrics_port: int) -> dict[str, float]:
    """Prometheus text from a local metrics port -> {'name{labels}': value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {key: float(value) for key, _, value in (line.rpartition(" ") for line in lines if line and line[0] != "#")}


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
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def cpu_by_process(self) -> dict[str, float]:
        """CPU seconds so far of each process in the server's tree, by `process_name` (same names summed)."""
        import psutil

        totals: dict[str, float] = {}
        for name, proc in named_processes(psutil.Process(self.proc.pid)):
            try:
                times = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            totals[name] = totals.get(name, 0.0) + times.user + times.system
        return totals

    def serving_cpu_s(self) -> float:
        """CPU seconds so far of the server's tree without vLLM's engine processes."""
        return sum(cpu for name, cpu in self.cpu_by_process().items() if not ENGINE_PROCESS.match(name))

    def engine_wait_s(self) -> dict[str, float]:
        """`engine_run_queue_wait_s` of the server's engine processes."""
        import psutil

        return engine_run_queue_wait_s(psutil.Process(self.proc.pid))

    def stop(self, timeout_s: float = 60) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            kill_group(self.proc)


def start(log: Path, extra_env: dict[str, str] | None = None) -> Server:
    """Starts the server and waits until it is ready; raises with the log's tail if it is not."""
    ports = free_ports(3)
    env = dict(os.environ, A3B_HTTP_PORT=str(ports[0]), A3B_GRPC_PORT=str(ports[1]),
               A3B_METRICS_PORT=str(ports[2]), VENV=str(Path(sys.executable).parent.parent), **(extra_env or {}))
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", str(PROJECT_ROOT / "scripts" / "serve.sh")], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(*ports, proc=proc, log=log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.is_ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_group(proc)
            raise RuntimeError(f"tritonserver did not become ready; log tail:\n{log.read_text()[-5000:]}")
        time.sleep(2)
    return server


def kill_group(proc: subprocess.Popen) -> None:
    """serve.sh, the server, its python stubs and vLLM's engine processes:
    nothing may outlive it. The server runs in a session of its own (serve.sh
    uses setsid), so its descendants are killed one by one, then the group."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    for child in descendants:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()

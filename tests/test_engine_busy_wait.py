"""EngineCore sleeps instead of spinning while its worker computes, where the
engine computes on the CPUs the serving processes also need
(profiles.Profile.engine_busy_wait_s, engine_wait.bound_busy_wait)."""
from __future__ import annotations

import subprocess
import sys
import time

import psutil

from a3b_backend import contract
from a3b_backend.bench import server_process
from a3b_backend.profiles import ENGINE_BUSY_WAIT_ENV, PROFILES
from served import stream_infer, text_request


def test_cpu_profiles_bound_the_engines_busy_wait():
    assert PROFILES["cpu"].engine_env()[ENGINE_BUSY_WAIT_ENV] == "0.0"
    assert PROFILES["qwen-tiny"].engine_env()[ENGINE_BUSY_WAIT_ENV] == "0.0"
    assert ENGINE_BUSY_WAIT_ENV not in PROFILES["h200"].engine_env()  # vLLM's own


def test_served_engine_core_sleeps_while_its_worker_computes(server):
    """Spinning, EngineCore uses about as much CPU as the stream takes wall time."""
    [core] = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
              if server_process.process_name(p.cmdline()) == "VLLM::EngineCore"]
    request = text_request("Write a long story about the sea.", True,
                           {"temperature": 0, "max_tokens": 96, "ignore_eos": True})
    cpu_before, started = sum(core.cpu_times()[:2]), time.monotonic()
    pieces, error = stream_infer(server.grpc_url, contract.ENSEMBLE_MODEL, request)
    wall_s, cpu_s = time.monotonic() - started, sum(core.cpu_times()[:2]) - cpu_before
    assert error is None and len(pieces) > 1
    assert cpu_s < 0.5 * wall_s, f"EngineCore used {cpu_s:.2f} s of CPU in {wall_s:.2f} s"


def test_a_sleeping_reader_looks_again_without_a_notification(tmp_path):
    """No notification ever comes: vLLM's own wait would sleep 5 s (or for ever)."""
    script = f"""
import os, time, zmq
os.environ[{ENGINE_BUSY_WAIT_ENV!r}] = "0"
from a3b_backend import engine_wait
engine_wait.bound_busy_wait()
from vllm.distributed.device_communicators import shm_broadcast
reader = shm_broadcast.SpinCondition(True, zmq.Context(), "ipc://{tmp_path}/notify")
assert reader.busy_loop_s == 0
started = time.monotonic()
for _ in range(20):
    reader.wait(timeout_ms=None)
print(time.monotonic() - started)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split()[-1]) < 1.0

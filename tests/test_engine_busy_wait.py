"""EngineCore sleeps instead of spinning while its worker computes, where the
engine computes on the CPUs the serving processes also need
(profiles.Profile.engine_busy_wait_s, busy_wait.bound_busy_wait)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

from a3b_backend import contract

from a3b_backend.engine import busy_wait
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
from a3b_backend.engine import busy_wait
busy_wait.bound_busy_wait()
from vllm.distributed.device_communicators import shm_broadcast
reader = shm_broadcast.SpinCondition(True, zmq.Context(), "ipc://{tmp_path}/notify")
assert reader.busy_loop_s == 0
started = time.monotonic()
for _ in range(20):
    reader.wait(timeout_ms=None)
print(time.monotonic() - started)
reader.last_read -= 2 * busy_wait.ACTIVE_WINDOW_S  # an idle engine
started = time.monotonic()
reader.wait(timeout_ms=None)
print(time.monotonic() - started)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    active_s, idle_s = map(float, done.stdout.split()[-2:])
    assert active_s < 1.0
    assert idle_s >= 0.8 * busy_wait.IDLE_RECHECK_MS / 1000


def test_an_idle_engine_looks_again_less_often():
    assert busy_wait.recheck_ms(0.0) == busy_wait.ACTIVE_RECHECK_MS == 1
    assert busy_wait.recheck_ms(busy_wait.ACTIVE_WINDOW_S) == busy_wait.IDLE_RECHECK_MS


def test_served_idle_engine_worker_sleeps(server):
    """Looking again every millisecond, an idle worker's main thread (the queue's
    reader) runs 1,000 times a second; torch's gloo threads beside it are not ours."""
    [worker] = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
                if server_process.process_name(p.cmdline()) == "VLLM::Worker"]
    schedstat = Path(f"/proc/{worker.pid}/task/{worker.pid}/schedstat")
    time.sleep(2 * busy_wait.ACTIVE_WINDOW_S)
    runs_before, started = int(schedstat.read_text().split()[2]), time.monotonic()
    time.sleep(3)
    per_s = (int(schedstat.read_text().split()[2]) - runs_before) / (time.monotonic() - started)
    assert per_s < 1000 / busy_wait.IDLE_RECHECK_MS * 2, f"the idle worker ran {per_s:.0f} times a second"

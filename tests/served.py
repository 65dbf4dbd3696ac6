"""Client helpers for the served tests: real tritonclient calls, nothing mocked."""
from __future__ import annotations

import json
import os
import queue
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

from a3b_backend.bench.server_process import scrape_metrics as scrape  # noqa: F401 (the served tests' name)

GREEDY = {"temperature": 0, "max_tokens": 32}
CAPITAL = "What is the capital of France?"


def tensor(name: str, value: Any) -> grpcclient.InferInput:
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, (str, bytes)):
        arr = np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)
    elif isinstance(value, list):
        arr = np.array([v.encode() for v in value], dtype=np.object_)
    elif isinstance(value, bool):
        arr = np.array([value], dtype=bool)
    else:
        raise TypeError(value)
    inp = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
    inp.set_data_from_numpy(arr)
    return inp


def text_request(prompt: str, stream: bool, sampling: dict | None = None, chat: bool = True, **extra) -> dict:
    inputs = {"text_input": prompt, "stream": stream, "apply_chat_template": chat}
    if sampling is not None:
        inputs["sampling_parameters"] = json.dumps(sampling)
    inputs.update(extra)
    return inputs


def open_stream(url: str, model: str, inputs: dict, request_id: str = ""):
    """One request sent on a new gRPC stream, left open: (client, queue of (result, error))."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(model, [tensor(k, v) for k, v in inputs.items()], request_id=request_id)
    return client, results


def stream_infer(url: str, model: str, inputs: dict, timeout_s: float = 120,
                 request_id: str = "") -> tuple[list[dict], str | None]:
    """One request over a gRPC stream; returns (responses as dicts of arrays, error text)."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(model, [tensor(k, v) for k, v in inputs.items()], request_id=request_id,
                                  enable_empty_final_response=True)
        responses = []
        while True:
            result, error = results.get(timeout=timeout_s)
            if error is not None:
                return responses, str(error)
            response = result.get_response()
            outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}
            if outputs:
                responses.append(outputs)
            if response.parameters.get("triton_final_response").bool_param:
                return responses, None
    finally:
        client.stop_stream()
        client.close()


def texts(responses: list[dict]) -> list[str]:
    return [r["text_output"].reshape(-1)[0].decode("utf-8") for r in responses]


def http_post(url: str, path: str, body: dict, timeout_s: float = 120) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://{url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def sse_events(raw: bytes) -> list[dict]:
    return [json.loads(line[len(b"data: "):]) for line in raw.splitlines() if line.startswith(b"data: ")]


def metric(values: dict[str, float], name: str, model: str = "a3b_llm") -> float:
    return values[f'{name}{{model="{model}",version="1"}}']


def ready_script(server) -> subprocess.CompletedProcess:
    """scripts/ready.sh, the readiness probe that includes the engine, against this server."""
    env = dict(os.environ, A3B_HTTP_PORT=str(server.http_port), A3B_METRICS_PORT=str(server.metrics_port))
    script = Path(__file__).resolve().parent.parent / "scripts" / "ready.sh"
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)


def engine_idle(server, timeout_s: float = 60) -> dict:
    """The engine's metrics once nothing runs or waits (or `timeout_s` passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        # One short request refreshes the engine's scheduler statistics.
        stream_infer(server.grpc_url, "a3b_llm", {"input_ids": np.array([1, 2, 3], np.int32),
                                                  "sampling_parameters": json.dumps({"max_tokens": 1})})
        values = scrape(server.metrics_port)
        if (metric(values, "a3b_num_requests_running") == 0 and metric(values, "a3b_num_requests_waiting") == 0
                or time.monotonic() > deadline):
            return values
        time.sleep(1)

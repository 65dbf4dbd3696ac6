"""A closed-loop streaming gRPC load generator on tritonclient, for what
perf_analyzer cannot show: perf_analyzer stops at the first error response, so
it cannot measure a server that refuses part of the load ("server busy").
Each worker keeps one request in flight on its own stream; a refused request
is counted, the worker backs off like a well-behaved client, then goes on.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any, Callable

import numpy as np

from a3b_backend.bench.perf_report import LoadLevel, RequestRecord
from a3b_backend.serving.tensors import string_tensor

BUSY_MARKER = "server busy"


def infer_inputs(values: dict[str, Any]) -> list:
    """{name: python value} -> tritonclient InferInputs ([1]-shaped like the wire contract)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, value in values.items():
        if isinstance(value, np.ndarray):
            arr = value
        elif isinstance(value, str):
            arr = string_tensor(value)
        elif isinstance(value, bool):
            arr = np.array([value], dtype=bool)
        elif isinstance(value, int):
            arr = np.array([value], dtype=np.int32)
        elif isinstance(value, float):
            arr = np.array([value], dtype=np.float32)
        else:
            raise TypeError(f"input {name!r}: unsupported value type {type(value).__name__}")
        inp = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs


def output_text(result: Any, output: str) -> str:
    """One response's `output` as text (numeric outputs as their values); "" when absent."""
    if not any(o.name == output for o in result.get_response().outputs):
        return ""
    values = result.as_numpy(output).reshape(-1)
    if values.dtype == np.object_:
        return b"".join(values).decode("utf-8")
    return " ".join(map(str, values.tolist()))


def is_final(result: Any) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


async def stream_all(url: str, model: str, requests: list[dict[str, Any]], timeout_s: float,
                     output: str = "text_output") -> list[RequestRecord]:
    """All `requests` at once, each on its own stream of one asyncio gRPC
    channel. A response is only timestamped on arrival and read once its
    request ended, so the client's CPU stays small beside a server that shares
    the machine's cores."""
    import tritonclient.grpc.aio as aioclient

    client = aioclient.InferenceServerClient(url)

    async def one(values: dict[str, Any]) -> RequestRecord:
        async def request():
            yield {"model_name": model, "inputs": infer_inputs(values), "enable_empty_final_response": True}

        record = RequestRecord(time.perf_counter_ns(), [], [])
        arrived = []
        async for result, error in client.stream_infer(request(), stream_timeout=timeout_s):
            stamp = time.perf_counter_ns()
            if error is not None:
                record.error = str(error)
                break
            arrived.append((stamp, result))
            if is_final(result):
                break
        for stamp, result in arrived:
            record.add(stamp, output_text(result, output))
        return record

    try:
        return list(await asyncio.gather(*(one(values) for values in requests)))
    finally:
        await client.close()


class StreamClient:
    """One gRPC stream, one request at a time, every response timestamped on arrival."""

    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        self._responses: queue.Queue = queue.Queue()
        self._client = grpcclient.InferenceServerClient(url)
        self._client.start_stream(callback=lambda result, error: self._responses.put(
            (time.perf_counter_ns(), result, error)))

    def request(self, model: str, values: dict[str, Any], timeout_s: float,
                output: str = "text_output") -> RequestRecord:
        """Sends one request and waits for its final response. A response counts
        when `output` is non-empty (numeric outputs are kept as their values)."""
        record = RequestRecord(time.perf_counter_ns(), [], [])
        self._client.async_stream_infer(model, infer_inputs(values), enable_empty_final_response=True)
        while True:
            try:
                stamp, result, error = self._responses.get(timeout=timeout_s)
            except queue.Empty:
                record.error = f"no response within {timeout_s} s"
                return record
            if error is not None:
                record.error = str(error)
                return record
            record.add(stamp, output_text(result, output))
            if is_final(result):
                return record

    def close(self) -> None:
        self._client.stop_stream()
        self._client.close()


def closed_loop(url: str, model: str, make_inputs: Callable[[int], dict[str, Any]], concurrency: int,
                total_requests: int, timeout_s: float = 300.0, busy_backoff_s: float = 0.5) -> LoadLevel:
    """`concurrency` workers send `total_requests` requests between them, each
    waiting for its last one to end; refused ones back off `busy_backoff_s`."""
    records: list[RequestRecord] = []
    lock = threading.Lock()
    issued = iter(range(total_requests))

    def worker() -> None:
        client = StreamClient(url)
        try:
            while True:
                with lock:
                    index = next(issued, None)
                if index is None:
                    return
                record = client.request(model, make_inputs(index), timeout_s)
                with lock:
                    records.append(record)
                if record.error and BUSY_MARKER in record.error:
                    time.sleep(busy_backoff_s)
        finally:
            client.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return LoadLevel(f"concurrency {concurrency}", model, records)

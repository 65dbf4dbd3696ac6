"""a3b_llm's `stop` input (TensorRT-LLM's): a request with it true ends the generations that were
sent with the same request id. The id is the client's (Triton's request `id`), known before any
response, so a generation can be stopped during its prefill."""
from __future__ import annotations

import threading
from typing import Mapping

import numpy as np

from a3b_backend.contract import STOP
from a3b_backend.serving.tensors import RequestError, scalar

MAX_ID_CHARS = 256


def asks_stop(tensors: Mapping[str, np.ndarray]) -> bool:
    """Whether the request is a stop (its `stop` input true); false or absent: a generation."""
    value = scalar(tensors, STOP)
    return value is not None and bool(value)


def stop_target(request_id: str) -> str:
    """The id a stop request names: its own request id, refused when it cannot name a generation."""
    if not request_id:
        raise RequestError(f"input '{STOP}' is true but the request has no id: send the stop with the id "
                           "the generation to stop was sent with (the request's 'id')")
    if len(request_id) > MAX_ID_CHARS or not request_id.isprintable():
        shown = request_id[:40] + ("..." if len(request_id) > 40 else "")
        raise RequestError(f"input '{STOP}': request id {shown!r} is malformed: allowed is 1..{MAX_ID_CHARS} "
                           "printable characters")
    return request_id


class StopRegistry:
    """The engine requests in flight under each client request id (several when a client reuses one).
    Written from the engine loop and read from Triton's thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._engine_ids: dict[str, set[str]] = {}

    def add(self, client_id: str, engine_id: str) -> None:
        if client_id:
            with self._lock:
                self._engine_ids.setdefault(client_id, set()).add(engine_id)

    def discard(self, client_id: str, engine_id: str) -> None:
        with self._lock:
            ids = self._engine_ids.get(client_id)
            if ids is not None:
                ids.discard(engine_id)
                if not ids:
                    del self._engine_ids[client_id]

    def engine_ids(self, client_id: str) -> list[str]:
        """The generations a stop for `client_id` ends (none: it finished or never ran)."""
        with self._lock:
            return sorted(self._engine_ids.get(client_id, ()))

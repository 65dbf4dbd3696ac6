"""a3b_llm's stop input and a3b_bls's cancellation watch: the pure logic (served tests: test_served_bls.py)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from a3b_backend.serving.bls import CancelWatch
from a3b_backend.serving.stops import MAX_ID_CHARS, StopRegistry, asks_stop, stop_target
from a3b_backend.serving.tensors import RequestError


def test_only_a_true_stop_input_is_a_stop():
    assert asks_stop({"stop": np.array([True])})
    assert not asks_stop({"stop": np.array([False])})
    assert not asks_stop({"input_ids": np.array([1, 2], np.int32)})
    with pytest.raises(RequestError, match="'stop' must hold exactly one value"):
        asks_stop({"stop": np.array([True, True])})


@pytest.mark.parametrize("request_id, fragment", [
    ("", "the request has no id"),
    ("x" * (MAX_ID_CHARS + 1), "is malformed: allowed is 1..256 printable characters"),
    ("bad\nid", "'bad\\nid' is malformed"),
])
def test_a_stop_that_cannot_name_a_generation_is_refused(request_id, fragment):
    with pytest.raises(RequestError, match="input 'stop'") as refused:
        stop_target(request_id)
    assert fragment in str(refused.value)


def test_the_registry_names_the_generations_in_flight_under_a_client_id():
    registry = StopRegistry()
    registry.add("client-1", "e1")
    registry.add("client-1", "e2")  # a reused id: a stop ends both
    registry.add("", "e3")  # no id: no stop can name it
    assert registry.engine_ids("client-1") == ["e1", "e2"]
    assert stop_target("client-1") == "client-1"
    registry.discard("client-1", "e1")
    registry.discard("client-1", "e2")
    registry.discard("client-1", "e2")  # finished twice (abort then end): no error
    assert registry.engine_ids("client-1") == [] and registry.engine_ids("") == []


class _Request:
    def __init__(self, cancelled: bool):
        self.cancelled = cancelled

    def is_cancelled(self) -> bool:
        return self.cancelled


def test_the_watch_stops_each_cancelled_generation_once():
    stopped, seen = [], threading.Event()

    def send_stop(generation_id: str) -> None:
        stopped.append(generation_id)
        seen.set()

    watch = CancelWatch(send_stop, poll_s=0.01)
    try:
        live, cancelled = _Request(False), _Request(True)
        watch.add("live", live)
        watch.add("cancelled", cancelled)
        assert seen.wait(5)
        threading.Event().wait(0.1)  # several more polls
        assert stopped == ["cancelled"]
        live.cancelled = True
        watch.discard("live")  # finished before its cancel was seen: no stop
        threading.Event().wait(0.1)
        assert stopped == ["cancelled"]
    finally:
        watch.close()


class _Finishing:
    """Counts the times it is asked about after its final response (Triton has freed it by then);
    each ask takes a while, as a round trip to the server does."""

    def __init__(self):
        self.finished, self.asked_late = False, 0

    def is_cancelled(self) -> bool:
        self.asked_late += self.finished
        threading.Event().wait(0.001)
        self.asked_late += self.finished
        return False


def test_a_discarded_request_is_never_asked_about_again():
    watch = CancelWatch(lambda generation_id: None, poll_s=0.0001)
    requests = [_Finishing() for _ in range(40)]
    try:
        for i, request in enumerate(requests):
            watch.add(str(i), request)
        for i, request in enumerate(requests):
            threading.Event().wait(0.0005)
            watch.discard(str(i))  # as the serving thread does before its final response
            request.finished = True
    finally:
        watch.close()
    assert sum(r.asked_late for r in requests) == 0

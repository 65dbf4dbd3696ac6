"""SIGTERM with streams in flight. Runs last of the session (file order): it
stops the session's server, after every cancelled, dropped and failed request
of the earlier tests, none of which may hold the shutdown."""
from __future__ import annotations

import concurrent.futures
import time

import psutil
import pytest

from served import CAPITAL, stream_infer, text_request, texts

pytestmark = pytest.mark.served
EXIT_TIMEOUT_S = 30  # scripts/serve.sh --exit-timeout-secs


def test_sigterm_lets_in_flight_streams_finish_and_exits(server):
    sampling = {"temperature": 0, "max_tokens": 24}
    reference, error = stream_infer(server.grpc_url, "ensemble", text_request(CAPITAL, True, sampling))
    assert error is None
    group = list(psutil.Process(server.proc.pid).children(recursive=True))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = [pool.submit(stream_infer, server.grpc_url, "ensemble", text_request(CAPITAL, True, sampling))
                   for _ in range(2)]
        time.sleep(1)
        stopped_at = time.monotonic()
        server.proc.terminate()
        for future in running:
            responses, error = future.result(timeout=60)
            assert error is None and "".join(texts(responses)) == "".join(texts(reference))
    server.proc.wait(timeout=EXIT_TIMEOUT_S + 30)
    held = [line for line in server.log.read_text().splitlines() if "in-flight inferences" in line]
    assert time.monotonic() - stopped_at < EXIT_TIMEOUT_S, "\n".join(held[-5:])
    time.sleep(2)
    assert not [p.pid for p in group if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

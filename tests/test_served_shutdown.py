"""SIGTERM with streams in flight. Runs last of the session (file order): it
stops the session's server, after every cancelled, dropped and failed request
of the earlier tests.

Triton 2.51 refuses every new request once it is stopping, and an `ensemble`
stream needs a new `postprocessing` request per token, so scripts/serve.sh
drains first (a3b_backend/serving/drain.py): new requests are refused with "server
shutting down", in-flight streams finish, then tritonserver is stopped with
nothing in flight."""
from __future__ import annotations

import concurrent.futures
import json
import time

import numpy as np
import psutil
import pytest

from served import CAPITAL, stream_infer, text_request, texts

pytestmark = pytest.mark.served
EXIT_TIMEOUT_S = 30  # scripts/serve.sh drain window (A3B_EXIT_TIMEOUT)
STOP_BOUND_S = EXIT_TIMEOUT_S + 10 + 5  # + Triton's exit timeout after the drain + serve.sh's kill grace


def test_sigterm_drains_in_flight_streams_refuses_new_ones_and_exits(server):
    sampling = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}
    reference, error = stream_infer(server.grpc_url, "ensemble", text_request(CAPITAL, True, sampling))
    assert error is None
    tokens = {"input_ids": np.arange(100, 120, dtype=np.int32), "stream": True,
              "sampling_parameters": json.dumps({"max_tokens": 48, "ignore_eos": True})}
    group = list(psutil.Process(server.proc.pid).children(recursive=True))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        direct = pool.submit(stream_infer, server.grpc_url, "a3b_llm", tokens)
        running = [pool.submit(stream_infer, server.grpc_url, "ensemble", text_request(CAPITAL, True, sampling))
                   for _ in range(2)]
        time.sleep(1)
        stopped_at = time.monotonic()
        server.proc.terminate()
        time.sleep(0.5)
        assert not direct.done() and not any(f.done() for f in running), "streams ended before the drain test"
        _, refused = stream_infer(server.grpc_url, "ensemble", text_request(CAPITAL, True, sampling))
        assert refused is not None and "server shutting down" in refused, refused
        responses, error = direct.result(timeout=60)
        assert error is None and sum(len(r["token_ids"]) for r in responses) == 48
        for future in running:
            responses, error = future.result(timeout=60)
            assert error is None, error
            assert "".join(texts(responses)) == "".join(texts(reference))
    server.proc.wait(timeout=STOP_BOUND_S + 30)
    assert time.monotonic() - stopped_at < STOP_BOUND_S
    time.sleep(2)
    assert not [p.pid for p in group if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

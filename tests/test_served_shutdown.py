"""SIGTERM with streams in flight. Runs last of the session (file order): it
stops the session's server, after every cancelled, dropped and failed request
of the earlier tests, none of which may hold the shutdown.

A stream on `a3b_llm` finishes. An `ensemble` stream finishes or ends cleanly:
each of its steps is a new request to `postprocessing`, and Triton 2.51 refuses
new requests to a model once the server is stopping ("Server is stopping,
scheduler for model has stopped accepting new inference requests"), so the
stream ends with that error after a prefix of its text (seen in one of the last
three runs)."""
from __future__ import annotations

import concurrent.futures
import json
import time

import numpy as np
import psutil
import pytest

from served import CAPITAL, stream_infer, text_request, texts

pytestmark = pytest.mark.served
EXIT_TIMEOUT_S = 30  # scripts/serve.sh --exit-timeout-secs


def test_sigterm_lets_in_flight_streams_finish_and_exits(server):
    sampling = {"temperature": 0, "max_tokens": 24}
    reference, error = stream_infer(server.grpc_url, "ensemble", text_request(CAPITAL, True, sampling))
    assert error is None
    tokens = {"input_ids": np.arange(100, 120, dtype=np.int32), "stream": True,
              "sampling_parameters": json.dumps({"max_tokens": 24, "ignore_eos": True})}
    group = list(psutil.Process(server.proc.pid).children(recursive=True))
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        direct = pool.submit(stream_infer, server.grpc_url, "a3b_llm", tokens)
        running = [pool.submit(stream_infer, server.grpc_url, "ensemble", text_request(CAPITAL, True, sampling))
                   for _ in range(2)]
        time.sleep(1)
        stopped_at = time.monotonic()
        server.proc.terminate()
        responses, error = direct.result(timeout=60)
        assert error is None and sum(len(r["token_ids"]) for r in responses) == 24
        for future in running:
            responses, error = future.result(timeout=60)
            text = "".join(texts(responses))
            if error is None:
                assert text == "".join(texts(reference))
            else:
                assert "Server is stopping" in error and "".join(texts(reference)).startswith(text), error
    server.proc.wait(timeout=EXIT_TIMEOUT_S + 30)
    held = [line for line in server.log.read_text().splitlines() if "in-flight inferences" in line]
    assert time.monotonic() - stopped_at < EXIT_TIMEOUT_S, "\n".join(held[-5:])
    time.sleep(2)
    assert not [p.pid for p in group if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

"""SIGTERM with streams in flight. Runs last of the session (file order): it
stops the session's server, after every cancelled, dropped and failed request
of the earlier tests.

What holds: a stream on `a3b_llm` finishes; the server and every process it
started are gone within the exit timeout + 15 s. What Triton 2.51 does to an
`ensemble` stream in flight: each of its steps is a new request to
`postprocessing`, which Triton refuses once the server is stopping. The stream
then either ends with "Server is stopping, scheduler for model has stopped
accepting new inference requests", or stalls while Triton keeps the request
counted in flight, waits out its whole exit timeout and hangs on exit, until
scripts/serve.sh kills it and the client sees the connection close
(UNAVAILABLE). Seen on a fresh server too, so not a leftover of earlier tests."""
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
KILL_GRACE_S = 15  # scripts/serve.sh kills what is left this long after the exit timeout


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
                assert "Server is stopping" in error or "UNAVAILABLE" in error, error
                assert "".join(texts(reference)).startswith(text)
    server.proc.wait(timeout=EXIT_TIMEOUT_S + KILL_GRACE_S + 30)
    assert time.monotonic() - stopped_at < EXIT_TIMEOUT_S + KILL_GRACE_S + 5
    time.sleep(2)
    assert not [p.pid for p in group if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

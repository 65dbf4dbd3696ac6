"""The drain before shutdown (a3b_backend/serving/drain.py): in-flight count from a
metrics scrape, the drain file, waiting until idle against a local HTTP server."""
from __future__ import annotations

import http.server
import threading

import pytest

from a3b_backend.serving import drain

SCRAPE = """# HELP a3b_num_requests_in_flight Requests admitted by a3b_llm and not yet finished
# TYPE a3b_num_requests_in_flight gauge
a3b_num_requests_in_flight{{model="a3b_llm",version="1"}} {first}
a3b_num_requests_in_flight{{model="a3b_llm",version="2"}} {second}
# HELP nv_inference_count Number of inferences performed
# TYPE nv_inference_count counter
nv_inference_count{{model="ensemble",version="1"}} 7
"""


def test_in_flight_sums_every_model_version():
    assert drain.in_flight(SCRAPE.format(first=3, second=2)) == 5
    assert drain.in_flight(SCRAPE.format(first=0, second=0)) == 0


def test_in_flight_without_the_gauge_is_an_error():
    with pytest.raises(ValueError, match="a3b_num_requests_in_flight not in the scrape"):
        drain.in_flight('nv_inference_count{model="ensemble",version="1"} 7\n')


def test_requested_follows_the_drain_file(tmp_path, monkeypatch):
    path = tmp_path / "drain"
    monkeypatch.delenv(drain.DRAIN_FILE_ENV, raising=False)
    assert not drain.requested()
    monkeypatch.setenv(drain.DRAIN_FILE_ENV, str(path))
    assert not drain.requested()
    path.touch()
    assert drain.requested()


def test_refusal_puts_the_drain_before_the_engines_reason(tmp_path, monkeypatch):
    path = tmp_path / "drain"
    monkeypatch.setenv(drain.DRAIN_FILE_ENV, str(path))
    assert drain.refusal(lambda: None) is None
    assert drain.refusal(lambda: "server busy") == "server busy"
    path.touch()
    assert drain.refusal(lambda: "server busy") == drain.SHUTTING_DOWN


def serve_counts(counts: list[int]) -> http.server.ThreadingHTTPServer:
    """A metrics endpoint whose in-flight count steps through `counts`, then stays at the last."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            count = counts.pop(0) if len(counts) > 1 else counts[0]
            body = SCRAPE.format(first=count, second=0).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_wait_idle_returns_once_nothing_is_in_flight_twice_in_a_row():
    counts = [3, 1, 0, 2, 0, 0]
    server = serve_counts(counts)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        assert drain.wait_idle(url, timeout_s=10, poll_s=0.01)
        assert counts == [0]  # the lone 0 between 1 and 2 did not end the drain
    finally:
        server.shutdown()


def test_wait_idle_gives_up_at_the_timeout():
    server = serve_counts([4])
    try:
        assert not drain.wait_idle(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout_s=0.2,
                                   poll_s=0.01)
    finally:
        server.shutdown()


def test_cli_reports_an_unreachable_metrics_port():
    assert drain.main(["--metrics-url", "http://127.0.0.1:9/metrics", "--timeout", "1"]) == 2

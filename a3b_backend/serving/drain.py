"""Draining before shutdown.

Triton 2.51 refuses every new request to a model once the server is stopping,
and an `ensemble` stream needs a new `postprocessing` request per token: a
stream in flight at SIGTERM stalls or fails. So scripts/serve.sh does not hand
SIGTERM to tritonserver at once. It first creates the drain file (path in
A3B_DRAIN_FILE), which makes `a3b_llm` refuse new requests with a retryable
"shutting down" error, waits here until no request is in flight (the
`a3b_num_requests_in_flight` gauge on the metrics port) or the drain timeout
passes, and only then stops the server.

    python -m a3b_backend.serving.drain --metrics-url http://127.0.0.1:8002/metrics --timeout 30
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.request
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families

DRAIN_FILE_ENV = "A3B_DRAIN_FILE"
IN_FLIGHT_METRIC = "a3b_num_requests_in_flight"
SHUTTING_DOWN = "server shutting down: not accepting new requests; retry on another replica"


def requested() -> bool:
    """True once serve.sh has asked this server to drain."""
    path = os.environ.get(DRAIN_FILE_ENV)
    return bool(path) and os.path.exists(path)


def refusal(engine_refusal: Callable[[], str | None]) -> str | None:
    """Why a3b_llm refuses a new request now (retryable): the drain first, then the engine's own reason."""
    return SHUTTING_DOWN if requested() else engine_refusal()


def in_flight(metrics_text: str) -> int:
    """Requests in flight across every a3b_llm instance in a Prometheus text scrape."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == IN_FLIGHT_METRIC:
            return int(sum(sample.value for sample in family.samples))
    raise ValueError(f"{IN_FLIGHT_METRIC} not in the scrape (is a3b_llm loaded?)")


def wait_idle(metrics_url: str, timeout_s: float, poll_s: float = 0.5, quiet_polls: int = 2) -> bool:
    """Waits until `quiet_polls` scrapes in a row see nothing in flight.

    The extra scrape covers an ensemble's last step: `postprocessing` gets the
    final token just after a3b_llm counts its request finished."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while time.monotonic() < deadline:
        with urllib.request.urlopen(metrics_url, timeout=5) as response:
            count = in_flight(response.read().decode())
        quiet = quiet + 1 if count == 0 else 0
        if quiet >= quiet_polls:
            return True
        print(f"drain: {count} requests in flight", file=sys.stderr, flush=True)
        time.sleep(poll_s)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--metrics-url", required=True)
    parser.add_argument("--timeout", type=float, required=True, help="seconds to wait for in-flight requests")
    args = parser.parse_args(argv)
    try:
        idle = wait_idle(args.metrics_url, args.timeout)
    except (OSError, ValueError) as exc:
        print(f"drain: cannot read in-flight requests ({exc}); stopping now", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("drain: interrupted; stopping now", file=sys.stderr)
        return 130
    if not idle:
        print(f"drain: requests still in flight after {args.timeout:g} s; stopping anyway", file=sys.stderr)
        return 1
    print("drain: no requests in flight", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

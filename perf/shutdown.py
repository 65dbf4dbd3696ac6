"""SIGTERM with `ensemble` streams in flight, against a server of its own
started through scripts/serve.sh (the drain before shutdown, docs/operations.md).

    make bench-shutdown            # perf/results/shutdown.md

STREAMS streams of TOKENS tokens are started, SIGTERM goes to serve.sh one
second later, then a new request is sent during the drain. Reported: when each
stream finished (after the signal) and whether its text equals the same
request's without a shutdown, what the late
request got, and when the server and all its processes were gone; once with
clients that keep their gRPC streams open, once with clients that close them.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import time
from pathlib import Path

from a3b_backend.bench import loadgen, server_process
from a3b_backend.bench.perf_report import machine
from a3b_backend.profiles import PROJECT_ROOT

PROMPT = "Write a short story about a lighthouse keeper."
LOG = PROJECT_ROOT / "perf" / "results" / "tmp" / "shutdown.server.log"


def scenario(streams: int, tokens: int, close_streams: bool, log: Path) -> list[str]:
    """One server, `streams` ensemble streams, SIGTERM, a late request; the report's lines."""
    values = {"text_input": PROMPT, "stream": True,
              "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": tokens, "ignore_eos": True})}
    print(f"starting the server (clients {'close' if close_streams else 'keep'} their streams)...", flush=True)
    server = server_process.start(log)
    clients = [loadgen.StreamClient(server.grpc_url) for _ in range(streams + 1)]
    reference = "".join(clients[-1].request("ensemble", values, timeout_s=120).texts)
    finished: dict[int, float] = {}

    def stream(i: int):
        record = clients[i].request("ensemble", values, timeout_s=120)
        finished[i] = time.monotonic()
        if close_streams:
            clients[i].close()
        return record

    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(stream, i) for i in range(streams)]
        time.sleep(1)
        signalled = time.monotonic()
        server.proc.terminate()
        time.sleep(0.5)
        late = clients[-1].request("ensemble", values, timeout_s=30)
        if close_streams:
            clients[-1].close()
        records = [f.result() for f in futures]
    server.proc.wait(timeout=120)
    gone = time.monotonic() - signalled
    server_process.kill_group(server.proc)
    lines = [f"## Clients {'close their streams after their request' if close_streams else 'keep their streams open'}",
             "", "| stream | finished after SIGTERM (s) | text as without SIGTERM | error |", "|---|---|---|---|"]
    for i, record in enumerate(records):
        complete = "yes" if "".join(record.texts) == reference else "NO"
        lines.append(f"| {i} | {finished[i] - signalled:.1f} | {complete} | {record.error or '-'} |")
    return lines + ["", f"Request sent during the drain: {late.error or 'admitted (not refused)'}", "",
                    f"Server and all its processes gone {gone:.1f} s after SIGTERM.", ""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "perf" / "results" / "shutdown.md")
    args = parser.parse_args(argv)
    lines = ["# SIGTERM with ensemble streams in flight", "",
             f"Machine: {machine()}. Command: `make bench-shutdown` ({args.streams} streams x {args.tokens} tokens, "
             "SIGTERM 1 s after they start, one more request 0.5 s after the signal).", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    LOG.parent.mkdir(parents=True, exist_ok=True)
    for close_streams in (False, True):
        lines += scenario(args.streams, args.tokens, close_streams, LOG)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

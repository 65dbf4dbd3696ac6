"""Overload: what admitted requests see when more clients arrive than the
server admits (profile max_in_flight), against a running server (`make serve`).

    make bench-overload              # or: python perf/overload.py --url localhost:8001

1. perf_analyzer (streaming gRPC, count windows) below the admission limit:
   at the first error response it aborts its run (seen: "Thread [0] had
   error: server busy ...") or hangs ("Failed to retrieve results from
   inference request.", then nothing), so it cannot drive a server to the
   point where it refuses requests. At exactly the limit a client that sends
   its next request the moment a stream ends can already be refused: the
   finished request leaves the in-flight count a moment after its last response.
2. Our closed-loop tritonclient generator at, below and past the limit:
   refused requests are counted ("server busy ... retry later"), admitted ones
   are timed, and a request without its final response within the timeout
   counts as hung.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from a3b_backend.bench import loadgen, perf_analyzer, perf_report
from a3b_backend.profiles import PROJECT_ROOT, get_profile

PROMPT = "Write one sentence about the sea."


def request_values(output_tokens: int) -> dict:
    return {"text_input": PROMPT, "stream": True, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": output_tokens, "ignore_eos": True})}


def perf_analyzer_level(url: str, model: str, concurrency: int, output_tokens: int, requests: int,
                        workdir: Path) -> perf_report.LoadLevel | None:
    if not (PROJECT_ROOT / ".venv-perf" / "bin" / "perf_analyzer").exists():
        print("perf_analyzer not installed (make perf-tools): skipping its run")
        return None
    data = workdir / "input.json"
    data.write_text(json.dumps({"data": [{k: [v] for k, v in request_values(output_tokens).items()}]}))
    export = workdir / f"pa_c{concurrency}.json"
    cmd = ["-m", model, "-u", url, "-i", "grpc", "--streaming", "--async",
           "--input-data", str(data), "--concurrency-range", str(concurrency),
           "--measurement-mode", "count_windows", "--measurement-request-count", str(requests),
           "--stability-percentage", "999", "--max-trials", "3"]
    print("$", " ".join(perf_analyzer.command(cmd, export)[1:]), flush=True)
    [level] = perf_report.records_from_export(perf_analyzer.run(cmd, export, workdir / f"pa_c{concurrency}.log",
                                                                timeout_s=900))
    level.source = "perf_analyzer"
    return level


def overload_row(level: perf_report.LoadLevel, summary: perf_report.Summary) -> list[str]:
    refused = sum(1 for r in level.records if r.error and loadgen.BUSY_MARKER in r.error)
    hung = sum(1 for r in level.records if r.error and r.error.startswith("no response within"))
    other = summary.errors - refused - hung
    ms = lambda d: f"{d[50]:.0f} / {d[99]:.0f}"  # noqa: E731
    return [level.source, level.label, str(len(level.records)), str(summary.requests), str(refused), str(hung),
            str(other), ms(summary.ttft_ms), ms(summary.e2e_ms), f"{summary.output_tokens_per_s:.1f}"]


HEADER = ["client", "load", "requests sent", "admitted+finished", "refused busy", "hung", "other errors",
          "TTFT ms p50 / p99", "e2e ms p50 / p99", "output tok/s"]


def plot(rows: list[list[str]], summaries: list[perf_report.Summary], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_lat, ax_ref) = plt.subplots(1, 2, figsize=(11, 4))
    for client in dict.fromkeys(r[0] for r in rows):
        picked = [(r, s) for r, s in zip(rows, summaries) if r[0] == client]
        x = [int(r[1].split()[-1]) for r, _ in picked]
        ax_lat.plot(x, [s.e2e_ms[99] / 1000 for _, s in picked], marker="o", label=f"{client} e2e p99")
        ax_lat.plot(x, [s.ttft_ms[99] / 1000 for _, s in picked], marker="x", ls="--", label=f"{client} TTFT p99")
        ax_ref.bar([f"{client}\n{v}" for v in x], [int(r[4]) / max(int(r[2]), 1) * 100 for r, _ in picked])
    ax_lat.set(xlabel="concurrent clients", ylabel="seconds", title="admitted requests: latency")
    ax_lat.legend(fontsize=7)
    ax_lat.grid(alpha=0.3)
    ax_ref.set(ylabel="% of requests refused (server busy)", title="refusals")
    ax_ref.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC address")
    parser.add_argument("--model", default="ensemble")
    parser.add_argument("--profile", help="the served profile (for its admission limit)")
    parser.add_argument("--concurrency", type=int, nargs="+",
                        help="default: limit/4, 3/4 limit, limit, 1.5x and 2x limit")
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a request counts as hung")
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "perf" / "results" / "overload")
    args = parser.parse_args(argv)
    profile = get_profile(args.profile)
    limit = profile.max_in_flight
    levels = args.concurrency or [limit // 4, limit * 3 // 4, limit, limit * 3 // 2, limit * 2]
    count = perf_report.token_counter(profile.resolve_model_dir(PROJECT_ROOT))
    runs: list[perf_report.LoadLevel] = []
    with tempfile.TemporaryDirectory() as tmp:
        for c in (c for c in levels if c < limit):
            level = perf_analyzer_level(args.url, args.model, c, args.output_tokens, c, Path(tmp))
            if level is not None:
                runs.append(level)
    for c in levels:
        print(f"tritonclient closed loop: {c} clients, {2 * c} requests", flush=True)
        runs.append(loadgen.closed_loop(args.url, args.model, lambda _: request_values(args.output_tokens), c,
                                        2 * c, timeout_s=args.timeout))
        runs[-1].source = "tritonclient"
    summaries = [perf_report.summarize(level, count) for level in runs]
    rows = [overload_row(level, s) for level, s in zip(runs, summaries)]
    table = "| " + " | ".join(HEADER) + " |\n|" + "---|" * len(HEADER) + "\n"
    table += "".join("| " + " | ".join(r) + " |\n" for r in rows)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(rows, summaries, args.out / "overload.png")
    (args.out / "overload.md").write_text(
        f"# Overload against `{args.model}` (profile {profile.name}, max_in_flight {limit})\n\n"
        f"Machine: {perf_report.machine()}. "
        f"Command: `make bench-overload`. {args.output_tokens} output tokens per request, "
        f"each client sends 2 requests on average; refused clients back off 0.5 s.\n\n{table}\n"
        "![overload](overload.png)\n")
    print(f"wrote {args.out / 'overload.md'}")


if __name__ == "__main__":
    main()

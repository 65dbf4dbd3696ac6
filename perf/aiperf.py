"""AIPerf beside genai-perf against the running server (`make aiperf`), the same
synthetic load for both: TTFT and inter-token latency side by side
(perf/results/aiperf/: Markdown table, JSON, PNG).

    make aiperf        # or: python perf/aiperf.py --http-url http://localhost:8000 --grpc-url localhost:8001

AIPerf 0.13 has no Triton endpoint of its own; its template endpoint sends a
JSON body rendered from perf/inputs/aiperf_generate_stream.jinja to Triton's
HTTP `generate_stream` (server-sent events) and reads `text_output` from each
event. genai-perf drives perf_analyzer over gRPC with `--backend vllm`. So the
two differ in transport (HTTP SSE vs gRPC stream) as well as in client; both
run one after the other on the same server.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path
from a3b_backend.profiles import PROJECT_ROOT

TEMPLATE = PROJECT_ROOT / "perf" / "inputs" / "aiperf_generate_stream.jinja"
METRICS = (("time_to_first_token", "TTFT"), ("inter_token_latency", "ITL"))
STATS = ("avg", "p50", "p99")


def genai_perf_command(args: argparse.Namespace, out: Path) -> list[str]:
    return ["bash", str(PROJECT_ROOT / "scripts" / "genai_perf.sh"), "profile", "-m", "ensemble", "--endpoint-type", "kserve",
            "--backend", "vllm", "--streaming", "--tokenizer", str(args.tokenizer), "-u", args.grpc_url,
            "--synthetic-input-tokens-mean", str(args.isl), "--output-tokens-mean", str(args.osl),
            "--concurrency", str(args.concurrency), "--request-count", str(args.requests), "--artifact-dir", str(out)]


def aiperf_command(args: argparse.Namespace, out: Path) -> list[str]:
    return [str(PROJECT_ROOT / ".venv-aiperf" / "bin" / "aiperf"), "profile", "--model", "ensemble", "--url", args.http_url,
            "--endpoint", "/v2/models/ensemble/generate_stream", "--endpoint-type", "template", "--streaming",
            "--extra-inputs", f"payload_template:{TEMPLATE}", "--extra-inputs", "response_field:text_output",
            "--tokenizer", str(args.tokenizer), "--isl", str(args.isl), "--osl", str(args.osl),
            "--concurrency", str(args.concurrency), "--request-count", str(args.requests), "--artifact-dir", str(out),
            "--ui", "none"]


def export(directory: Path, name: str) -> dict:
    """The tool's summary export: {metric: {unit, avg, p50, p99, ...}}."""
    found = sorted(directory.rglob(name))
    if not found:
        raise FileNotFoundError(f"no {name} under {directory}: did the run fail? (see its output above)")
    return json.loads(found[-1].read_text())


def comparison(results: dict[str, dict]) -> list[dict]:
    rows = []
    for key, label in METRICS:
        for stat in STATS:
            rows.append({"metric": f"{label} {stat} (ms)",
                         **{tool: round(summary[key][stat], 1) for tool, summary in results.items()}})
    return rows


def write_report(out: Path, rows: list[dict], args: argparse.Namespace, tools: list[str]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from a3b_backend.bench.perf_report import machine

    lines = ["# AIPerf beside genai-perf\n",
             f"Machine: {machine()}. Command: `make aiperf`. Model `ensemble` (profile of the running server), "
             f"synthetic input {args.isl} tokens, output {args.osl} tokens, concurrency {args.concurrency}, "
             f"{args.requests} requests per tool, one tool after the other. genai-perf: gRPC streaming "
             f"(`--backend vllm`); AIPerf: HTTP `generate_stream` through its template endpoint.\n",
             "| metric | " + " | ".join(tools) + " |", "|---" * (len(tools) + 1) + "|"]
    lines += [f"| {row['metric']} | " + " | ".join(f"{row[t]:.1f}" for t in tools) + " |" for row in rows]
    out.mkdir(parents=True, exist_ok=True)
    report = out / "aiperf_vs_genai_perf.md"
    report.write_text("\n".join(lines) + "\n")
    (out / "aiperf_vs_genai_perf.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1,
                                                              default=str))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(tools)
    for i, tool in enumerate(tools):
        ax.bar([x + i * width for x in range(len(rows))], [row[tool] for row in rows], width, label=tool)
    ax.set_xticks([x + width * (len(tools) - 1) / 2 for x in range(len(rows))], [r["metric"] for r in rows],
                  rotation=30, ha="right")
    ax.set_ylabel("ms")
    ax.set_title("TTFT and inter-token latency, same load")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "aiperf_vs_genai_perf.png", dpi=120)
    plt.close(fig)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--http-url", default="http://localhost:8000")
    parser.add_argument("--grpc-url", default="localhost:8001")
    parser.add_argument("--tokenizer", type=Path, default=PROJECT_ROOT / "models" / "smollm2-135m-instruct")
    parser.add_argument("--isl", type=int, default=64)
    parser.add_argument("--osl", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "perf" / "results" / "aiperf")
    parser.add_argument("--dry-run", action="store_true", help="print the two commands, run nothing")
    args = parser.parse_args(argv)
    runs = {"genai-perf": (genai_perf_command, "profile_export_genai_perf.json"),
            "AIPerf": (aiperf_command, "profile_export_aiperf.json")}
    if args.dry_run:
        for command, _ in runs.values():
            print(shlex.join(command(args, args.out)))
        return 0
    results = {}
    for step, (tool, (command, name)) in enumerate(runs.items(), 1):
        print(f"==> [{step}/{len(runs)}] {tool}", flush=True)
        artifacts = args.out / tool
        if subprocess.run(command(args, artifacts)).returncode != 0:
            print(f"{tool} failed; see its output above", file=sys.stderr)
            return 1
        results[tool] = export(artifacts, name)
    rows = comparison(results)
    report = write_report(args.out, rows, args, list(results))
    print(report.read_text())
    print(f"wrote {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

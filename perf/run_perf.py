"""perf_analyzer sweeps for a profile against a running server, then the report.

    make perf                                   # cpu profile, server from `make serve`
    python perf/run_perf.py --profile h200 --url gpu-host:8001 --dry-run   # print the commands

Inputs come from a3b_backend.perf_inputs (exact token lengths), every run
streams over gRPC with count-based measurement windows and writes a
`--profile-export-file`; a3b_backend.perf_report turns the exports into
perf/results/<profile>/report.{md,png,json}.
"""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from a3b_backend import perf_inputs, perf_report  # noqa: E402
from a3b_backend.profiles import Profile, get_profile  # noqa: E402


def runs(profile: Profile, inputs: Path, exports: Path) -> list[tuple[str, list[str]]]:
    """(export name, perf_analyzer arguments) for the profile's plan: every prompt
    length and the RAG mix at every concurrency in the vllm_backend flavour, the
    TensorRT-LLM flavour at the shortest length, and the request-rate run."""
    plan = profile.perf
    common = ["-i", "grpc", "--streaming", "--async", "--measurement-mode", "count_windows",
              "--measurement-request-count", str(plan.requests_per_window),
              # one window per load level: LLM latencies on a busy CPU never meet
              # the default 10% stability criterion, and more windows only repeat it
              "--stability-percentage", "999", "--max-trials", "1"]
    shortest = min(plan.prompt_lengths)
    files = [perf_inputs.input_file_name(n, "vllm") for n in plan.prompt_lengths]
    files += [f"rag{plan.rag_document_tokens}_vllm.json", perf_inputs.input_file_name(shortest, "trtllm")]
    out = []
    for name in files:
        for c in plan.concurrencies:
            stem = f"{Path(name).stem}_c{c}"
            out.append((stem, ["--input-data", str(inputs / name), "--concurrency-range", str(c),
                               "--profile-export-file", str(exports / f"{stem}.json"), *common]))
    if plan.request_rate_per_min:
        rate = plan.request_rate_per_min / 60
        name = f"rag{plan.rag_document_tokens}_vllm.json"
        stem = f"rag_rate{plan.request_rate_per_min}pm"
        out.append((stem, ["--input-data", str(inputs / name), "--request-rate-range", f"{rate:.4f}",
                           "--profile-export-file", str(exports / f"{stem}.json"), *common]))
    return out


def main(argv: list[str] | None = None) -> None:
    from tqdm import tqdm

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", help="default: $A3B_PROFILE or cpu")
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC address")
    parser.add_argument("--model", default="ensemble")
    parser.add_argument("--out", type=Path, help="default: perf/results/<profile>")
    parser.add_argument("--dry-run", action="store_true", help="write the inputs, print the commands, run nothing")
    args = parser.parse_args(argv)
    profile = get_profile(args.profile)
    out = args.out or ROOT / "perf" / "results" / profile.name
    inputs = ROOT / "perf" / "inputs" / profile.name
    exports = out / "exports"
    exports.mkdir(parents=True, exist_ok=True)
    perf_inputs.main(["--profile", profile.name, "--out", str(inputs)])
    plan = runs(profile, inputs, exports)
    tool = ROOT / "scripts" / "perf_analyzer.sh"
    if args.dry_run:
        for _, cmd in plan:
            print(shlex.join([str(tool), "-m", args.model, "-u", args.url, *cmd]))
        return
    started = time.monotonic()
    for stem, cmd in tqdm(plan, desc=f"perf_analyzer ({profile.name})", unit="run"):
        log = exports / f"{stem}.log"
        with open(log, "w") as fh:
            done = subprocess.run(["bash", str(tool), "-m", args.model, "-u", args.url, *cmd],
                                  stdout=fh, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise SystemExit(f"perf_analyzer failed for {stem} (exit {done.returncode}); see {log}:\n"
                             + log.read_text()[-2000:])
    count = perf_report.token_counter(profile.resolve_model_dir(ROOT))
    levels = perf_report.load_levels(sorted(exports.glob("*.json")))
    summaries = [perf_report.summarize(level, count) for level in levels]
    preamble = (f"Command: `make perf` (perf/run_perf.py --profile {profile.name}), "
                f"{len(plan)} perf_analyzer runs in {time.monotonic() - started:.0f} s; "
                f"{profile.perf.output_tokens} output tokens per request, streaming gRPC against `{args.model}`.")
    print(perf_report.markdown_table(summaries))
    print(f"wrote {perf_report.write_report(summaries, out, f'perf_analyzer, profile {profile.name}', preamble)}")


if __name__ == "__main__":
    main()

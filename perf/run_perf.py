"""perf_analyzer sweeps for a profile against a running server, then the report.

    make perf                                   # cpu profile, server from `make serve`
    make perf PERF_ARGS=--resume                # keep the runs an interrupted invocation finished
    python perf/run_perf.py --profile h200 --url gpu-host:8001 --dry-run   # print the commands

Inputs come from a3b_backend.bench.perf_inputs (exact token lengths), every run
streams over gRPC with count-based measurement windows and writes a
`--profile-export-file`; a3b_backend.bench.perf_report turns the exports into
perf/results/<profile>/report.{md,png,json}.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import time
from pathlib import Path

from a3b_backend.bench import perf_analyzer, perf_inputs, perf_report
from a3b_backend.profiles import PROJECT_ROOT, Profile, get_profile


# perf_analyzer's max/min bound across windows, in percent: any ratio up to 10,000x passes
STABILITY_ANY = 1_000_000


@dataclasses.dataclass
class Run:
    stem: str  # export name
    input_name: str  # file under the profile's inputs
    load: list[str]  # --concurrency-range c or --request-rate-range r
    requests: int  # prompts it may use (count windows plus what is in flight)


def runs(profile: Profile) -> list[Run]:
    """The profile's plan: every prompt length and the RAG mix at every
    concurrency in the vllm_backend flavour, the TensorRT-LLM flavour at the
    shortest length, and the request-rate run on the RAG mix."""
    plan = profile.perf
    files = [perf_inputs.input_file_name(n, "vllm") for n in plan.prompt_lengths]
    files += [f"rag{plan.rag_document_tokens}_vllm.json", perf_inputs.input_file_name(min(plan.prompt_lengths), "trtllm")]
    out = [Run(f"{Path(name).stem}_c{c}", name, ["--concurrency-range", str(c)], plan.requests_per_run(c))
           for name in files for c in plan.concurrencies]
    if plan.request_rate_per_min:
        out.append(Run(f"rag_rate{plan.request_rate_per_min}pm", f"rag{plan.rag_document_tokens}_vllm.json",
                       ["--request-rate-range", f"{plan.request_rate_per_min / 60:.4f}"], plan.requests_per_run(1)))
    return out


def perf_analyzer_args(profile: Profile, run: Run, input_file: Path) -> list[str]:
    return ["-i", "grpc", "--streaming", "--async", "--input-data", str(input_file), *run.load,
            "--measurement-mode", "count_windows",
            "--measurement-request-count", str(profile.perf.requests_per_window),
            # three windows per load level, accepted as they come: LLM latencies
            # on a busy CPU rarely meet the default 10% stability criterion
            # (perf_analyzer needs 3 windows to judge, and with 1 writes no export),
            # and the RAG mix's first window, which prefills the document, may take
            # 40x its others (qwen-tiny's 86K document: 126 s, then ~3 s)
            "--stability-percentage", str(STABILITY_ANY), "--max-trials", str(profile.perf.windows)]


def run_inputs(plan: list[Run], inputs: Path, exports: Path) -> dict[str, Path]:
    """Each run gets the input file rotated past the prompts earlier runs of
    the same file used, so no prompt is sent twice and prefix caching cannot
    flatter a later load level (the RAG mix shares its document on purpose)."""
    used: dict[str, int] = {}
    out = {}
    for run in plan:
        data = json.loads((inputs / run.input_name).read_text())["data"]
        offset = used.get(run.input_name, 0) % len(data)
        used[run.input_name] = used.get(run.input_name, 0) + run.requests
        path = exports / f"{run.stem}.input.json"
        path.write_text(json.dumps({"data": data[offset:] + data[:offset]}))
        out[run.stem] = path
    return out


def exported(path: Path) -> bool:
    """Whether `path` is a whole perf_analyzer export (perf_analyzer can exit 0 with it cut short)."""
    try:
        return bool(perf_report.records_from_export(json.loads(path.read_text())))
    except (OSError, ValueError, KeyError):
        return False


def main(argv: list[str] | None = None) -> None:
    from tqdm import tqdm

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", help="default: $A3B_PROFILE or cpu")
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC address")
    parser.add_argument("--model", default="ensemble")
    parser.add_argument("--out", type=Path, help="default: perf/results/<profile>")
    parser.add_argument("--dry-run", action="store_true", help="write the inputs, print the commands, run nothing")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs whose export an earlier invocation wrote whole; run the others")
    args = parser.parse_args(argv)
    profile = get_profile(args.profile)
    out = args.out or PROJECT_ROOT / "perf" / "results" / profile.name
    inputs = PROJECT_ROOT / "perf" / "inputs" / profile.name
    exports = out / "exports"
    exports.mkdir(parents=True, exist_ok=True)
    perf_inputs.main(["--profile", profile.name, "--out", str(inputs)])
    plan = runs(profile)
    input_files = run_inputs(plan, inputs, exports)
    commands = [(run.stem, ["-m", args.model, "-u", args.url, *perf_analyzer_args(profile, run, input_files[run.stem])])
                for run in plan]
    if args.dry_run:
        for stem, cmd in commands:
            print(shlex.join(perf_analyzer.command(cmd, exports / f"{stem}.json")[1:]))
        return
    started = time.monotonic()
    kept = [stem for stem, _ in commands if args.resume and exported(exports / f"{stem}.json")]
    for stem, cmd in tqdm(commands, desc=f"perf_analyzer ({profile.name})", unit="run"):
        if stem in kept:
            continue
        try:
            perf_analyzer.run(cmd, exports / f"{stem}.json", exports / f"{stem}.log")
        except RuntimeError as err:
            raise SystemExit(f"{stem}: {err}") from None
    count = perf_report.token_counter(profile.resolve_model_dir(PROJECT_ROOT))
    levels = perf_report.load_levels(sorted(exports / f"{run.stem}.json" for run in plan))
    summaries = [perf_report.summarize(level, count) for level in levels]
    preamble = (f"Machine: {perf_report.machine()}. "
                f"Command: `make perf` (perf/run_perf.py --profile {profile.name}), "
                f"{len(plan)} perf_analyzer runs, {len(plan) - len(kept)} in {time.monotonic() - started:.0f} s"
                + (f" (--resume kept {', '.join(kept)} from an earlier invocation)" if kept else "") + "; "
                f"{profile.perf.output_tokens} output tokens per request, streaming gRPC against `{args.model}`.")
    print(perf_report.markdown_table(summaries))
    print(f"wrote {perf_report.write_report(summaries, out, f'perf_analyzer, profile {profile.name}', preamble)}")


if __name__ == "__main__":
    main()

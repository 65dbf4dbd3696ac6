"""The serving path's ceiling without the engine (`make bench-serving-path`):
the real tritonserver with our real preprocessing, postprocessing and
`ensemble`, rendered as `a3b-render` renders them, and only `a3b_llm` swapped
for perf/token_source (an engine stand-in that costs next to nothing: one step
every 12.5 ms, one real token per running stream per step).

perf_analyzer (C++, so the client costs little CPU) streams from `ensemble`
(or from each of `--models` in turn, e.g. `ensemble a3b_bls ensemble`: the two
entry points side by side, and the first against itself for the A/A floor)
at each concurrency of the sweep. Reported per level: streamed tokens/s and
responses/s delivered to the client, each token's lateness (arrival at the
client minus the step's scheduled time, carried in `cumulative_logprob`),
and the CPU used by tritonserver, each Python stub and the client.
Table, JSON and PNG under perf/results/serving_path/.
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import get_args

import numpy as np

from a3b_backend import contract

from a3b_backend.deploy import repository
from a3b_backend.bench import perf_analyzer, perf_report, server_process
from a3b_backend.bench.token_source import SENDING_DESCRIPTIONS, SENDING_ENV, Sending
from a3b_backend.profiles import PROJECT_ROOT, get_profile

TOKEN_SOURCE = PROJECT_ROOT / "perf" / "token_source" / "model.py"
# real text the token source replays: the GNU GPL v3 as Debian and Ubuntu ship it
SOURCE_TEXT = Path("/usr/share/common-licenses/GPL-3")
CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PROMPT = "Summarize the GNU General Public License in one paragraph."
# the processes whose CPU is reported, by what their command line holds
ROLES = ("tritonserver", "preprocessing", contract.LLM_MODEL, "postprocessing", contract.BLS_MODEL)


@dataclass
class Level:
    model: str  # the entry point perf_analyzer streamed from ("#2": its second run in the sweep)
    concurrency: int
    requests: int
    errors: int
    # requests whose streamed pieces do not join into the passage the source replayed
    mangled: int
    tokens_per_s: float
    responses_per_s: float
    offered_tokens_per_s: float
    lateness_ms: dict[int, float]
    cores: dict[str, float]  # CPU seconds per wall second, by role and for the client


def build_repository(into: Path) -> Path:
    """The model repository as rendered, with the token source as a3b_llm."""
    repo = into / "model_repository"
    shutil.copytree(PROJECT_ROOT / "model_repository", repo,
                    ignore=shutil.ignore_patterns("model.json", "multi_lora.json", "__pycache__"))
    for model, text in repository.render().items():
        (repo / model / "config.pbtxt").write_text(text)
    shutil.copy(TOKEN_SOURCE, repo / contract.LLM_MODEL / "1" / "model.py")
    return repo


def input_file(path: Path, tokens: int) -> Path:
    values = {"text_input": [PROMPT], "stream": [True], "exclude_input_in_output": [True],
              "return_cumulative_logprob": [True], "return_num_output_tokens": [True],
              "sampling_parameters": [json.dumps({"max_tokens": tokens, "ignore_eos": True})]}
    path.write_text(json.dumps({"data": [values]}))
    return path


def replayed_text(model_dir: Path) -> str:
    """The token source's text as its token ids decode (every stream replays a passage of it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.decode(tokenizer(SOURCE_TEXT.read_text())["input_ids"], clean_up_tokenization_spaces=False)


def role_cpu(server: server_process.Server) -> dict[str, float]:
    """CPU seconds so far of the server and of each stub (by the model it serves)."""
    import psutil

    totals = dict.fromkeys(ROLES, 0.0)
    for proc in [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]:
        try:
            cmdline, times = " ".join(proc.cmdline()), proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        stub_of = next((r for r in ROLES[1:] if f"/{r}/" in cmdline), None)
        role = stub_of or ("tritonserver" if "tritonserver" in cmdline else None)
        if role:
            totals[role] += times.user + times.system
    return totals


def client_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_level(server, model: str, label: str, concurrency: int, tokens: int, interval_ms: float, epoch_ns: int,
              work: Path, source_text: str) -> Level:
    args = ["-m", model, "-u", server.grpc_url, "-i", "grpc", "--streaming", "--async",
            "--input-data", str(input_file(work / "input.json", tokens)), "--concurrency-range", str(concurrency),
            "--measurement-mode", "count_windows", "--measurement-request-count", str(max(8, 2 * concurrency)),
            "--stability-percentage", "999", "--max-trials", "3"]
    before, client_before, started = role_cpu(server), client_cpu(), time.monotonic()
    try:
        name = f"{label.replace(' #', '-')}-c{concurrency}"
        measured = perf_analyzer.run(args, work / f"{name}.json", work / f"{name}.log")
    except RuntimeError as err:
        raise SystemExit(f"{label}, concurrency {concurrency}: {err}") from None
    wall = time.monotonic() - started
    after, client_after = role_cpu(server), client_cpu()
    cores = {role: (after[role] - before[role]) / wall for role in ROLES}
    cores["client (perf_analyzer)"] = (client_after - client_before) / wall
    return summarize(measured, label, concurrency, tokens, interval_ms, epoch_ns, cores, source_text)


def output_value(out: dict, name: str) -> float:
    """A one-element numeric output as perf_analyzer exports it."""
    value = out[name]
    return float(value[0] if isinstance(value, list) else value)


def summarize(export: dict, label: str, concurrency: int, tokens: int, interval_ms: float, epoch_ns: int,
              cores: dict[str, float], source_text: str) -> Level:
    [experiment] = export["experiments"]
    lateness, token_count, responses, errors, mangled = [], 0, 0, 0, 0
    starts, ends = [], []
    for req in experiment["requests"]:
        outputs = [o for o in req.get("response_outputs", []) if o and "cumulative_logprob" in o]
        if len(outputs) == 0:
            errors += 1
            continue
        starts.append(int(req["timestamp"]))
        text = "".join(perf_report.bytes_text(o.get("text_output", "")) for o in outputs)
        mangled += text not in source_text
        ends.append(int(req["response_timestamps"][-1]))
        for stamp, out in zip(req["response_timestamps"], req["response_outputs"]):
            if not out or "cumulative_logprob" not in out:
                continue
            responses += 1
            token_count += int(output_value(out, "num_output_tokens"))
            due_ns = epoch_ns + output_value(out, "cumulative_logprob") * 1e9
            lateness.append((int(stamp) - due_ns) / 1e6)
    span_s = (max(ends) - min(starts)) / 1e9
    return Level(model=label, concurrency=concurrency, requests=len(starts), errors=errors, mangled=mangled,
                 tokens_per_s=token_count / span_s, responses_per_s=responses / span_s,
                 offered_tokens_per_s=concurrency * 1000 / interval_ms,
                 lateness_ms={p: float(np.percentile(lateness, p)) for p in (50, 99)}, cores=cores)


def markdown(levels: list[Level]) -> str:
    roles = list(levels[0].cores)
    header = ["entry point", "streams", "offered tok/s", "delivered tok/s", "responses/s", "lateness ms p50 / p99", "errors",
              "texts not intact",
              *(f"cores: {r}" for r in roles)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for lv in levels:
        lines.append("| " + " | ".join([
            lv.model, str(lv.concurrency), f"{lv.offered_tokens_per_s:.0f}", f"{lv.tokens_per_s:.0f}",
            f"{lv.responses_per_s:.0f}",
            f"{lv.lateness_ms[50]:.1f} / {lv.lateness_ms[99]:.1f}", str(lv.errors), str(lv.mangled),
            *(f"{lv.cores[r]:.2f}" for r in roles)]) + " |")
    return "\n".join(lines) + "\n"


def ratios(levels: list[Level]) -> str:
    """Each later entry point's responses/s, tokens/s and p50 lateness against the first's, level by level
    (the first's own second run is the A/A floor)."""
    labels = list(dict.fromkeys(lv.model for lv in levels))
    first = {lv.concurrency: lv for lv in levels if lv.model == labels[0]}
    lines = [f"| entry point | streams | responses/s vs {labels[0]} | tokens/s vs {labels[0]} | "
             f"p50 lateness ms, {labels[0]} / it |", "|---|---|---|---|---|"]
    for lv in levels:
        if lv.model == labels[0]:
            continue
        base = first[lv.concurrency]
        lines.append(f"| {lv.model} | {lv.concurrency} | {lv.responses_per_s / base.responses_per_s:.2f}x | "
                     f"{lv.tokens_per_s / base.tokens_per_s:.2f}x | {base.lateness_ms[50]:.1f} / "
                     f"{lv.lateness_ms[50]:.1f} |")
    return "\n".join(lines) + "\n"


def plot(levels: list[Level], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    labels = list(dict.fromkeys(lv.model for lv in levels))
    for label in labels:
        mine = [lv for lv in levels if lv.model == label]
        x = [lv.concurrency for lv in mine]
        tag = f" ({label})" if len(labels) > 1 else ""
        if label == labels[0]:
            axes[0].plot(x, [lv.offered_tokens_per_s for lv in mine], "k--", label="offered")
        axes[0].plot(x, [lv.tokens_per_s for lv in mine], "o-", label=f"tokens/s delivered{tag}")
        axes[0].plot(x, [lv.responses_per_s for lv in mine], "x-", label=f"responses/s delivered{tag}")
        axes[1].plot(x, [lv.lateness_ms[50] for lv in mine], "o-", label=f"p50{tag}")
        axes[1].plot(x, [lv.lateness_ms[99] for lv in mine], "x--", label=f"p99{tag}")
        for role in mine[0].cores:
            if any(lv.cores[role] > 0 for lv in mine):
                axes[2].plot(x, [lv.cores[role] for lv in mine], "o-", label=f"{role}{tag}")
    axes[1].set_yscale("log")
    for ax, name in zip(axes, ("throughput", "token lateness (ms)", "CPU (cores)")):
        ax.set_title(name)
        ax.set_xlabel("concurrent streams")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    from tqdm import tqdm

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=CONCURRENCIES)
    parser.add_argument("--models", nargs="+", choices=(contract.ENSEMBLE_MODEL, contract.BLS_MODEL),
                        default=[contract.ENSEMBLE_MODEL],
                        help="the entry points to stream from, in turn at each level (one named twice: an A/A run)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    parser.add_argument("--interval-ms", type=float, default=12.5, help="the token source's step")
    parser.add_argument("--sending", choices=get_args(Sending), default="paced",
                        help="how the source sends a stream's tokens (perf/token_source/model.py); "
                             "a3b_llm sends paced")
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "perf" / "results" / "serving_path")
    args = parser.parse_args(argv)
    if not (PROJECT_ROOT / ".venv-perf" / "bin" / "perf_analyzer").exists():
        raise SystemExit("perf_analyzer is not installed: run make perf-tools")
    args.out.mkdir(parents=True, exist_ok=True)
    epoch_ns = time.time_ns()
    source_text = replayed_text(get_profile().resolve_model_dir(PROJECT_ROOT))
    with tempfile.TemporaryDirectory(prefix="a3b-serving-path-") as tmp:
        work = Path(tmp)
        env = {"A3B_MODEL_REPOSITORY": str(build_repository(work)),
               "A3B_MODEL_DIR": str(get_profile().resolve_model_dir(PROJECT_ROOT)),
               "A3B_TOKEN_SOURCE_TEXT": str(SOURCE_TEXT), "A3B_TOKEN_SOURCE_EPOCH_NS": str(epoch_ns),
               "A3B_TOKEN_SOURCE_INTERVAL_MS": str(args.interval_ms),
               SENDING_ENV: args.sending}
        print("starting tritonserver with the token source as a3b_llm ...", flush=True)
        server = server_process.start(work / "tritonserver.log", env)
        levels = []
        try:
            # a model named again is labelled by its run: "ensemble #2"
            labels = [model if args.models[:i].count(model) == 0 else f"{model} #{args.models[:i].count(model) + 1}"
                      for i, model in enumerate(args.models)]
            runs = [(concurrency, model, label) for concurrency in args.concurrency
                    for model, label in zip(args.models, labels)]
            for concurrency, model, label in tqdm(runs, desc="serving path", unit="run"):
                levels.append(run_level(server, model, label, concurrency, args.tokens, args.interval_ms, epoch_ns,
                                        work, source_text))
                tqdm.write(markdown(levels[-1:]).splitlines()[-1])
        finally:
            server.stop()
    sending = SENDING_DESCRIPTIONS[args.sending]
    title = f"Serving path without the engine ({sending})"
    plot(levels, args.out / "serving_path.png", title)
    (args.out / "serving_path.json").write_text(json.dumps(
        {"machine": perf_report.machine(), "tokens_per_stream": args.tokens, "interval_ms": args.interval_ms,
         "sending": args.sending, "models": args.models,
         "pacing_responses_per_s": get_profile().stream_responses_per_s,
         "levels": [asdict(lv) for lv in levels]}, indent=1))
    report = args.out / "serving_path.md"
    report.write_text(
        f"# {title}\n\nMachine: {perf_report.machine()}; client and server share it. Command: "
        f"`perf/serving_path.py {' '.join(sys.argv[1:] if argv is None else argv)}` (make bench-serving-path, "
        f"bench-entry-points): tritonserver with our preprocessing, postprocessing, `ensemble` and `a3b_bls`, "
        f"a3b_llm replaced by perf/token_source ({args.interval_ms} ms steps, one token per stream per step, {args.tokens} tokens per stream; {sending}); perf_analyzer streams over gRPC. "
        f"Lateness: arrival at the "
        f"client minus the token's scheduled step. Cores: CPU seconds per second of each level's run.\n\n"
        f"{markdown(levels)}\n"
        + (f"Entry points against `{args.models[0]}` (streamed in turn at each level):\n\n{ratios(levels)}\n"
           if len(args.models) > 1 else "")
        + "![plots](serving_path.png)\n")
    print(markdown(levels))
    print(f"wrote {report}")


if __name__ == "__main__":
    main()

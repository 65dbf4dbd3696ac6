"""Where the served path's CPU goes: for each process of tritonserver's tree
(tritonserver itself, each model's Python stub, vLLM's engine processes), CPU
ms per streamed token while C streams run through `a3b_llm` and through the
`ensemble`, with `make bench-overhead`'s prompts and greedy answers; the
ensemble also asked for vLLM's `stream_interval` (several tokens per
response), which splits its serving CPU into a part per response and a part
per token (a least-squares line through the ensemble's runs).

    make bench-serving-cpu    # starts its own server; table + PNG under perf/results/serving_cpu/
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from a3b_backend import contract
from a3b_backend.bench import loadgen, perf_inputs, perf_report, server_process
from a3b_backend.bench.server_process import ENGINE_PROCESS
from a3b_backend.profiles import PROJECT_ROOT, get_profile
from overhead import OUTPUT_TOKENS, PROMPT_TOKENS, Variant, served_requests

RUNS = (Variant(contract.LLM_MODEL, contract.LLM_MODEL), Variant(contract.ENSEMBLE_MODEL, contract.ENSEMBLE_MODEL),
        *(Variant(f"{contract.ENSEMBLE_MODEL}, stream_interval {n}", contract.ENSEMBLE_MODEL, n) for n in (4, 32)))


@dataclasses.dataclass(frozen=True)
class Measured:
    model: str
    cpu_ms: dict[str, float]  # by process, over the measured rounds
    tokens: int
    responses: int
    requests: int

    def per_token(self) -> dict[str, float]:
        return {name: ms / self.tokens for name, ms in self.cpu_ms.items()}

    def serving_ms(self) -> float:
        return sum(ms for name, ms in self.cpu_ms.items() if not ENGINE_PROCESS.match(name))


def split_cost(runs: list[Measured]) -> tuple[float, float]:
    """(serving CPU ms per response, per token) of runs that differ in responses
    per request only: the least-squares line through their per-request figures."""
    per_request = np.array([r.serving_ms() / r.requests for r in runs])
    design = np.array([[r.responses / r.requests, r.tokens / r.requests] for r in runs])
    (per_response, per_token), *_ = np.linalg.lstsq(design, per_request, rcond=None)
    return float(per_response), float(per_token)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per model, after one that is not")
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "perf" / "results" / "serving_cpu")
    args = parser.parse_args(argv)
    profile = get_profile()
    tokenizer = perf_inputs.tokenizer_for(profile, PROJECT_ROOT)
    corpus = perf_inputs.Corpus(tokenizer)
    prompts = [tokenizer.encode(corpus.text_of_length(PROMPT_TOKENS, start=i * 997))
               for i in range(args.concurrency)]
    measured: dict[str, Measured] = {}
    with tempfile.TemporaryDirectory() as tmp:
        print("starting tritonserver ...", flush=True)
        server = server_process.start(Path(tmp) / "tritonserver.log")
        loop = asyncio.new_event_loop()
        try:
            for run in RUNS:
                requests, output = served_requests(run.model, prompts, tokenizer, run.stream_interval)

                def round_() -> list:
                    return loop.run_until_complete(
                        loadgen.stream_all(server.grpc_url, run.model, requests, 300, output))

                round_()  # not measured: the first requests of a model pay for warming up
                before, start = server.cpu_by_process(), time.monotonic()
                records = [r for _ in range(args.rounds) for r in round_()]
                after, seconds = server.cpu_by_process(), time.monotonic() - start
                failed = [r.error for r in records if r.error]
                if failed:
                    raise RuntimeError(f"{run.name}: {len(failed)} requests failed, first: {failed[0]}")
                measured[run.name] = Measured(run.model, {n: 1000 * (after[n] - before.get(n, 0.0)) for n in after},
                                              tokens=len(records) * OUTPUT_TOKENS,
                                              responses=sum(len(r.response_ns) for r in records),
                                              requests=len(records))
                print(f"{run.name}: {measured[run.name].responses} responses in {seconds:.1f} s", flush=True)
        finally:
            loop.close()
            server.stop()
    write_report(args, measured, profile.name)


def write_report(args, measured: dict[str, Measured], profile_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(measured)
    by_process = {run: m.per_token() for run, m in measured.items()}
    names = sorted({n for per in by_process.values() for n, ms in per.items() if ms >= 0.005},
                   key=lambda n: (bool(ENGINE_PROCESS.match(n)), n))
    ensemble_runs = [m for m in measured.values() if m.model == contract.ENSEMBLE_MODEL]
    per_response, per_token_ms = split_cost(ensemble_runs)
    lines = [f"# Serving CPU per streamed token, by process (profile {profile_name})", "",
             f"Machine: {perf_report.machine()}. Command: `make bench-serving-cpu`. {args.concurrency} streams at "
             f"once, {PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} greedy tokens each; one round per column not "
             f"measured, then {args.rounds}. CPU ms of each process of tritonserver's tree over the measured rounds, "
             "per streamed token (with one response per token, per response).", "",
             "| process | " + " | ".join(runs) + " |", "|---" * (len(runs) + 1) + "|",
             "| responses per request | " + " | ".join(f"{m.responses / m.requests:.1f}" for m in measured.values())
             + " |"]
    lines += [f"| {n} | " + " | ".join(f"{by_process[r].get(n, 0.0):.3f}" for r in runs) + " |" for n in names]
    lines.append("| **serving (all but the engine)** | "
                 + " | ".join(f"**{m.serving_ms() / m.tokens:.3f}**" for m in measured.values()) + " |")
    lines += ["", f"The ensemble's serving CPU, fitted over its {len(ensemble_runs)} columns: "
              f"{per_response:.2f} ms per response plus {per_token_ms:.2f} ms per token (a least-squares line "
              "through each column's CPU per request against its responses per request)."]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving_cpu.md").write_text("\n".join(lines) + "\n\n![serving cpu](serving_cpu.png)\n")
    (args.out / "serving_cpu.json").write_text(json.dumps(
        {"per_token_ms": by_process,
         "responses_per_request": {r: m.responses / m.requests for r, m in measured.items()},
         "ensemble_ms_per_response": per_response, "ensemble_ms_per_token": per_token_ms}, indent=1))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bottom = np.zeros(len(runs))
    for n in (n for n in names if not ENGINE_PROCESS.match(n)):
        heights = np.array([by_process[r].get(n, 0.0) for r in runs])
        ax.bar(runs, heights, bottom=bottom, label=n)
        bottom += heights
    ax.set(ylabel="CPU ms per streamed token", title="serving CPU by process (engine processes left out)")
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "serving_cpu.png", dpi=110)
    plt.close(fig)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

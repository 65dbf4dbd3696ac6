"""Where the served path's CPU goes: for each process of tritonserver's tree
(tritonserver itself, each model's Python stub, vLLM's engine processes), CPU
ms per streamed response while C streams run through `a3b_llm` and through
the `ensemble`, with `make bench-overhead`'s prompts and greedy answers.

    make bench-serving-cpu    # starts its own server; table + PNG under perf/results/serving_cpu/
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from a3b_backend import contract  # noqa: E402
from a3b_backend.bench import loadgen, perf_inputs, perf_report, server_process  # noqa: E402
from a3b_backend.bench.server_process import ENGINE_PROCESS  # noqa: E402
from a3b_backend.profiles import get_profile  # noqa: E402
from overhead import OUTPUT_TOKENS, PROMPT_TOKENS, served_requests  # noqa: E402

MODELS = (contract.LLM_MODEL, contract.ENSEMBLE_MODEL)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per model, after one that is not")
    parser.add_argument("--out", type=Path, default=ROOT / "perf" / "results" / "serving_cpu")
    args = parser.parse_args(argv)
    profile = get_profile()
    tokenizer = perf_inputs.tokenizer_for(profile, ROOT)
    corpus = perf_inputs.Corpus(tokenizer)
    prompts = [tokenizer.encode(corpus.text_of_length(PROMPT_TOKENS, start=i * 997))
               for i in range(args.concurrency)]
    table: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        print("starting tritonserver ...", flush=True)
        server = server_process.start(Path(tmp) / "tritonserver.log")
        loop = asyncio.new_event_loop()
        try:
            for model in MODELS:
                requests, output = served_requests(model, prompts, tokenizer)

                def round_() -> int:
                    records = loop.run_until_complete(loadgen.stream_all(server.grpc_url, model, requests, 300, output))
                    return sum(len(r.response_ns) for r in records)

                round_()  # not measured: the first requests of a model pay for warming up
                before, start = server.cpu_by_process(), time.monotonic()
                responses = sum(round_() for _ in range(args.rounds))
                after, seconds = server.cpu_by_process(), time.monotonic() - start
                table[model] = {name: 1000 * (after[name] - before.get(name, 0.0)) / responses for name in after}
                print(f"{model}: {responses} responses in {seconds:.1f} s", flush=True)
        finally:
            loop.close()
            server.stop()
    write_report(args, table, profile.name)


def write_report(args, table: dict[str, dict[str, float]], profile_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({n for per in table.values() for n, ms in per.items() if ms >= 0.005},
                   key=lambda n: (bool(ENGINE_PROCESS.match(n)), n))
    lines = [f"# Serving CPU per streamed response, by process (profile {profile_name})", "",
             f"Machine: {perf_report.machine()}. Command: `make bench-serving-cpu`. {args.concurrency} streams at "
             f"once, {PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} greedy tokens, one response per token; one "
             f"round per model not measured, then {args.rounds}. CPU ms of each process of tritonserver's tree "
             "over the measured rounds, per response.", "",
             "| process | " + " | ".join(MODELS) + " |", "|---" * (len(MODELS) + 1) + "|"]
    lines += [f"| {n} | " + " | ".join(f"{table[m].get(n, 0.0):.3f}" for m in MODELS) + " |" for n in names]
    serving = {m: sum(ms for n, ms in table[m].items() if not ENGINE_PROCESS.match(n)) for m in MODELS}
    lines.append("| **serving (all but the engine)** | " + " | ".join(f"**{serving[m]:.3f}**" for m in MODELS) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving_cpu.md").write_text("\n".join(lines) + "\n\n![serving cpu](serving_cpu.png)\n")
    (args.out / "serving_cpu.json").write_text(json.dumps(table, indent=1))
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = np.zeros(len(MODELS))
    for n in (n for n in names if not ENGINE_PROCESS.match(n)):
        heights = np.array([table[m].get(n, 0.0) for m in MODELS])
        ax.bar(MODELS, heights, bottom=bottom, label=n)
        bottom += heights
    ax.set(ylabel="CPU ms per streamed response", title="serving CPU by process (engine processes left out)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "serving_cpu.png", dpi=110)
    plt.close(fig)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

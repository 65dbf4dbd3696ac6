"""What Triton adds: the same prompts and sampling through (a) vLLM's AsyncLLM
directly in this process, (b) `a3b_llm` through tritonserver (token ids in and
out), (c) the full `ensemble` (text in, text out) and (d) the ensemble asked
for STREAM_INTERVAL tokens per response, interleaved a b c d d c b a a b c d ...;
on request (--variants e), (e) a second AsyncLLM in this process, set up as a's.

    make bench-overhead       # starts its own server; table + PNG under perf/results/overhead/

Variants run 2 s apart (the idle engine's OpenMP threads stop spinning),
after warm-up rounds that are not measured.
Every request has its own 128-token prompt (so no variant reuses another's
prefix cache) and generates exactly OUTPUT_TOKENS greedy tokens. Per round,
C requests start together (C = 1, 8 and 32). Reported: median TTFT and
inter-token latency per variant, and per-round paired differences against a
(each round's median over a's median, in %) as their mean with a 95%
bootstrap interval, so whether the serving path's cost shows through the
machine's noise is read from the interval, not from one median.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from a3b_backend import contract
from a3b_backend.bench import loadgen, perf_inputs, perf_report, server_process
from a3b_backend.bench.perf_report import RequestRecord
from a3b_backend.profiles import PROJECT_ROOT, get_profile

OUTPUT_TOKENS = 32
PROMPT_TOKENS = 128


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    model: str | None  # the served model asked; None: vLLM's AsyncLLM in this process
    stream_interval: int | None = None  # asked for in sampling_parameters
    engine: int = 0  # which of this process's AsyncLLM engines, where model is None

    @property
    def letter(self) -> str:
        return self.name.split(":")[0]


# d: the same ensemble requests asking for vLLM's stream_interval, so what
# fewer, larger responses save is read beside c in the same run.
STREAM_INTERVAL = 4
BARE = Variant("a: AsyncLLM", None)  # the baseline every variant is compared with
ENSEMBLE = Variant("c: ensemble", contract.ENSEMBLE_MODEL)  # what clients use; the goals are about it
VARIANTS = (BARE, Variant("b: a3b_llm", contract.LLM_MODEL), ENSEMBLE,
            Variant(f"d: ensemble, stream_interval {STREAM_INTERVAL}", contract.ENSEMBLE_MODEL, STREAM_INTERVAL))
# e: a second AsyncLLM in this process, configured as a's, against a as any
# variant is: the change between two engines that differ in nothing but the
# instance, the floor under what the comparison can tell apart. Not run unless
# asked for.
SECOND_ENGINE = Variant("e: AsyncLLM, a second engine", None, engine=1)
# vLLM's CPU engine processes, whose waits for a CPU the report shows
ENGINE_PROCESSES = ("VLLM::Worker", "VLLM::EngineCore")
SETTLE_S = 2.0
# Served rounds ran about 15% slower than bare vLLM for their first 6 rounds
# at concurrency 8 and within a few % after (each round's medians in
# overhead.json of `perf/overhead.py --rounds 12 --concurrency 8 32
# --warmup-rounds 0`), so every variant warms up first.
WARMUP_CONCURRENCY = 8


def sampling(**extra) -> dict:
    return {"temperature": 0, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True, **extra}


def served_requests(model: str, prompts: list[list[int]], tokenizer, stream_interval: int | None = None
                    ) -> tuple[list[dict], str]:
    """Streamed requests of `prompts` for a served model (token ids for a3b_llm,
    text for the ensemble), and the output tensor that carries their answers."""
    extra = {"stream_interval": stream_interval} if stream_interval else {}
    common = {"stream": True, "sampling_parameters": json.dumps(sampling(**extra))}
    if model == contract.LLM_MODEL:
        return [{"input_ids": np.asarray(p, dtype=np.int32), **common} for p in prompts], "token_ids"
    return [{"text_input": tokenizer.decode(p), **common} for p in prompts], "text_output"


async def direct_round(engine, prompts: list[list[int]]) -> list[RequestRecord]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(**sampling(), output_kind=RequestOutputKind.DELTA)

    async def one(i: int, ids: list[int]) -> RequestRecord:
        record = RequestRecord(time.perf_counter_ns(), [], [])
        async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), params, f"direct-{time.time_ns()}-{i}"):
            if out.outputs:
                record.add(time.perf_counter_ns(), " ".join(map(str, out.outputs[0].token_ids)))
        return record

    return list(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts))))


@dataclasses.dataclass
class Round:
    """One variant's requests of one round."""
    ttft_ms: list[float]
    itl_ms: list[float]
    responses: int  # that carried tokens
    requests: int
    # this process's CPU while the round ran: the client's, for the served variants
    process_cpu_s: float
    # CPU of what serves the engine while the round ran: tritonserver and its Python stubs for the
    # served variants (the engine's processes left out), this process's for bare AsyncLLM
    serving_cpu_s: float
    # seconds the variant's engine processes were ready to run but waited for a CPU, by process title
    engine_wait_s: dict[str, float]
    wall_s: float


def engine_core_process(engine) -> psutil.Process:
    """An AsyncLLM's one EngineCore process, whose tree holds its worker."""
    (engine_core,) = engine.engine_core.resources.engine_manager.processes
    return psutil.Process(engine_core.pid)


def latencies(records: list[RequestRecord]) -> tuple[list[float], list[float]]:
    """(TTFT ms, inter-token ms) per request; every request made exactly OUTPUT_TOKENS tokens."""
    for r in records:
        if r.error or not r.response_ns:
            raise RuntimeError(f"request failed: {r.error}")
    ttft = [(r.response_ns[0] - r.start_ns) / 1e6 for r in records]
    itl = [(r.response_ns[-1] - r.response_ns[0]) / 1e6 / (OUTPUT_TOKENS - 1) for r in records]
    return ttft, itl


def percent_changes(variant: list[float], base: list[float]) -> np.ndarray:
    """Each round's change of `variant` against `base`, in %."""
    return np.array([100 * (v / b - 1) for v, b in zip(variant, base)])


def bootstrap_mean(changes: np.ndarray, resamples: int = 10000) -> dict[str, float]:
    """Mean of `changes` with a 95% percentile-bootstrap interval."""
    rng = np.random.default_rng(0)
    means = changes[rng.integers(0, len(changes), (resamples, len(changes)))].mean(axis=1)
    return {"mean": float(changes.mean()), "low": float(np.percentile(means, 2.5)),
            "high": float(np.percentile(means, 97.5))}


def paired_percent(variant: list[float], base: list[float]) -> dict[str, float]:
    """Mean per-round change of `variant` against `base` in %, with a 95% bootstrap interval."""
    return bootstrap_mean(percent_changes(variant, base))


def interval_text(change: dict[str, float]) -> str:
    return f"{change['mean']:+.1f} [{change['low']:+.1f}, {change['high']:+.1f}]"


@dataclasses.dataclass(frozen=True)
class Goal:
    """The serving path's cost over bare vLLM: the upper end of the ensemble's 95% interval at most `high_percent`."""
    measure: str  # the row's key
    per_round: str  # the row's key of each round's median, in ms
    label: str
    high_percent: float


GOALS = (Goal("itl_vs_a_percent", "round_itl_ms", "inter-token", 3.0),
         Goal("ttft_vs_a_percent", "round_ttft_ms", "TTFT", 5.0))
GOAL_CONCURRENCY = (8, 32)


def goal_verdicts(rows: list[dict]) -> list[str]:
    """A line per goal this run measured: the ensemble's interval against it, met or missed."""
    lines = []
    for r in rows:
        if r["variant"] != ENSEMBLE.name or r["concurrency"] not in GOAL_CONCURRENCY:
            continue
        for goal in GOALS:
            change = r[goal.measure]
            verdict = "met" if change["high"] <= goal.high_percent else "missed"
            lines.append(f"concurrency {r['concurrency']}, {goal.label}: {interval_text(change)} %, "
                         f"upper end at most {goal.high_percent:+g}: {verdict}")
    return lines


def plot(rows: list[dict], variants: list[Variant], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT median (ms)"), (axes[1], "itl_ms", "inter-token median (ms)")):
        width = 0.8 / len(variants)
        for offset, variant in enumerate(variants):
            picked = [r for r in rows if r["variant"] == variant.name]
            xs = [i + (offset - (len(variants) - 1) / 2) * width for i in range(len(picked))]
            ax.bar(xs, [r[key] for r in picked], width=width, label=variant.name)
        ax.set_xticks(range(len(picked)), [f"concurrency {r['concurrency']}" for r in picked])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    from tqdm import tqdm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds per concurrency")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--warmup-rounds", type=int, default=6,
                        help=f"interleaved rounds at concurrency {WARMUP_CONCURRENCY} first, not measured")
    parser.add_argument("--variants", nargs="+", choices=[v.letter for v in (*VARIANTS, SECOND_ENGINE)],
                        default=[v.letter for v in VARIANTS],
                        help="which variants run (a, the baseline, always does); fewer make a round shorter")
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "perf" / "results" / "overhead")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    variants = [v for v in (*VARIANTS, SECOND_ENGINE) if v is BARE or v.letter in args.variants]
    command = "make bench-overhead" if not argv else " ".join(["python perf/overhead.py", *argv])
    profile = get_profile()
    os.environ.update(profile.engine_env())  # the served engine's settings (a3b_llm sets the same)
    tokenizer = perf_inputs.tokenizer_for(profile, PROJECT_ROOT)
    corpus = perf_inputs.Corpus(tokenizer)
    schedule = [(WARMUP_CONCURRENCY, False)] * args.warmup_rounds
    schedule += [(c, True) for c in args.concurrency for _ in range(args.rounds)]
    needed = sum(c for c, _ in schedule) * len(variants)
    stride = len(corpus.ids) // needed
    prompts = iter([tokenizer.encode(corpus.text_of_length(PROMPT_TOKENS, start=i * stride)) for i in range(needed)])

    with tempfile.TemporaryDirectory() as tmp:
        print("starting tritonserver ...", flush=True)
        server = server_process.start(Path(tmp) / "tritonserver.log")
        loop = asyncio.new_event_loop()
        try:
            engines = []
            for _ in range(1 + max(v.engine for v in variants)):
                print(f"starting AsyncLLM {len(engines) + 1} in this process ...", flush=True)
                engines.append(AsyncLLM.from_engine_args(AsyncEngineArgs(**profile.engine_args(PROJECT_ROOT))))
            engine_cores = [engine_core_process(engine) for engine in engines]

            def engine_wait_s(variant: Variant) -> dict[str, float]:
                if variant.model:
                    return server.engine_wait_s()
                return server_process.engine_run_queue_wait_s(engine_cores[variant.engine])

            def run(variant: Variant, ids: list[list[int]]) -> Round:
                cpu_before, wall_before = time.process_time(), time.monotonic()
                served_before, wait_before = server.serving_cpu_s(), engine_wait_s(variant)
                if variant.model is None:
                    records = loop.run_until_complete(direct_round(engines[variant.engine], ids))
                else:
                    requests, output = served_requests(variant.model, ids, tokenizer, variant.stream_interval)
                    records = loop.run_until_complete(loadgen.stream_all(
                        server.grpc_url, variant.model, requests, timeout_s=300, output=output))
                process_cpu = time.process_time() - cpu_before
                waited = engine_wait_s(variant)
                return Round(*latencies(records), responses=sum(len(r.response_ns) for r in records),
                             requests=len(records), process_cpu_s=process_cpu,
                             serving_cpu_s=server.serving_cpu_s() - served_before if variant.model else process_cpu,
                             engine_wait_s={n: w - wait_before.get(n, 0.0) for n, w in waited.items()},
                             wall_s=time.monotonic() - wall_before)

            results: dict[tuple[Variant, int], list[Round]] = {}
            with tqdm(total=len(schedule) * len(variants), desc="interleaved rounds (warm-up first)",
                      unit="run") as bar:
                for round_index, (c, measured) in enumerate(schedule):
                    # Every other round in reverse order, so that a drift of the
                    # machine's speed within a round favours no variant.
                    for variant in variants if round_index % 2 == 0 else variants[::-1]:
                        outcome = run(variant, [next(prompts) for _ in range(c)])
                        if measured:
                            results.setdefault((variant, c), []).append(outcome)
                        bar.update()
                        # Two engines share the cores: the one that just ran keeps its
                        # OpenMP threads spinning for a while and would slow the next
                        # variant's prefill (seen: TTFT 2x for whichever engine ran second).
                        time.sleep(SETTLE_S)
            for engine in engines:
                engine.shutdown()
        finally:
            loop.close()
            server.stop()

    # each round's medians (TTFT, inter-token), by variant and concurrency
    medians = {key: ([statistics.median(r.ttft_ms) for r in rounds], [statistics.median(r.itl_ms) for r in rounds])
               for key, rounds in results.items()}
    rows = []
    for (variant, c), rounds in results.items():
        (round_ttft, round_itl), (base_ttft, base_itl) = medians[(variant, c)], medians[(BARE, c)]
        responses = sum(r.responses for r in rounds)
        rows.append(dict(variant=variant.name, concurrency=c, rounds=len(rounds),
                         ttft_ms=statistics.median(x for r in rounds for x in r.ttft_ms),
                         itl_ms=statistics.median(x for r in rounds for x in r.itl_ms),
                         responses_per_request=responses / sum(r.requests for r in rounds),
                         serving_cpu_ms_per_response=1000 * sum(r.serving_cpu_s for r in rounds) / responses,
                         client_cpu_ms_per_response=(1000 * sum(r.process_cpu_s for r in rounds) / responses
                                                     if variant.model else None),
                         ttft_vs_a_percent=paired_percent(round_ttft, base_ttft),
                         itl_vs_a_percent=paired_percent(round_itl, base_itl),
                         engine_wait_percent={name: 100 * sum(r.engine_wait_s.get(name, 0.0) for r in rounds)
                                              / sum(r.wall_s for r in rounds) for name in ENGINE_PROCESSES},
                         round_ttft_ms=round_ttft, round_itl_ms=round_itl))
    header = ("| variant | concurrency | TTFT median ms | ITL median ms | responses per request | "
              "serving CPU ms per response | client CPU ms per response | TTFT vs a, % (mean [95% interval]) | "
              "ITL vs a, % (mean [95% interval]) | "
              + " | ".join(f"{name} waiting for a CPU, % of the time" for name in ENGINE_PROCESSES)
              + " |\n" + "|---" * (9 + len(ENGINE_PROCESSES)) + "|\n")
    table = header + "".join(
        f"| {r['variant']} | {r['concurrency']} | {r['ttft_ms']:.1f} | {r['itl_ms']:.2f} | "
        f"{r['responses_per_request']:.1f} | "
        + f"{r['serving_cpu_ms_per_response']:.2f} | "
        + (f"{r['client_cpu_ms_per_response']:.2f}" if r["client_cpu_ms_per_response"] is not None else "-")
        + f" | {interval_text(r['ttft_vs_a_percent'])} | {interval_text(r['itl_vs_a_percent'])} | "
        + " | ".join(f"{r['engine_wait_percent'][name]:.1f}" for name in ENGINE_PROCESSES) + " |\n" for r in rows)
    verdicts = goal_verdicts(rows)
    print(table + "".join(f"goal: {line}\n" for line in verdicts))
    args.out.mkdir(parents=True, exist_ok=True)
    plot(rows, variants, args.out / "overhead.png")
    (args.out / "overhead.json").write_text(json.dumps(rows, indent=1))
    (args.out / "overhead.md").write_text(
        f"# Serving overhead: bare AsyncLLM vs a3b_llm vs ensemble (profile {profile.name})\n\n"
        f"Machine: {perf_report.machine()}. "
        f"Command: `{command}`. {args.warmup_rounds} warm-up rounds at concurrency "
        f"{WARMUP_CONCURRENCY} (not measured), then {args.rounds} interleaved rounds per concurrency (every "
        "other round in reverse order), "
        f"{PROMPT_TOKENS}-token prompts (each its own), {OUTPUT_TOKENS} greedy output tokens. "
        "Per round: the variant's median over a's median, as a change in %; mean over rounds with a 95% "
        "bootstrap interval. Inter-token latency: (last response - first) / (tokens - 1) per request, so a "
        "response that carries several tokens does not shorten it. b, c and d are streamed over one asyncio gRPC "
        "channel of this process (loadgen.stream_all); client CPU is this process's CPU during the round per "
        "response; serving CPU, per response, is that of tritonserver and its Python stubs (vLLM's engine "
        "processes left out) for b, c and d, and this process's (AsyncLLM's front end) for a. "
        "Waiting for a CPU: the time the variant's vLLM processes were ready to run but not running (the "
        "kernel's schedstat of their threads that carry the process's name), over the rounds' wall time. "
        f"a3b_llm paces each stream's responses at {profile.stream_responses_per_s:g} responses/s "
        "over all streams (a3b_backend/serving/pacing.py).\n"
        f"Goals, at concurrency {' and '.join(map(str, GOAL_CONCURRENCY))}: the interval of {ENSEMBLE.name} ends "
        + " and ".join(f"at most {g.high_percent:+g}% {g.label}" for g in GOALS) + ".\n\n"
        f"{table}\n" + "".join(f"- {line}\n" for line in verdicts) + "\n![overhead](overhead.png)\n")
    print(f"wrote {args.out / 'overhead.md'}")


if __name__ == "__main__":
    main()

"""TTFT on the RAG mix with and without vLLM's prefix caching, same engine
settings otherwise (the profile's), one engine after the other in this process.

    make bench-prefix-cache        # table under perf/results/prefix_cache/

Requests share the system prompt and one document chunk and differ in their
question (a3b_backend.bench.perf_inputs.rag_data); they are sent one at a time, so
TTFT is prefill alone. The first request fills the cache; the figure is the
median over the others.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

from a3b_backend.bench import perf_inputs, perf_report
from a3b_backend.profiles import PROJECT_ROOT, get_profile


async def ttfts(engine, prompts: list[list[int]]) -> list[float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=1)
    out = []
    for i, ids in enumerate(prompts):
        start = time.perf_counter()
        async for _ in engine.generate(TokensPrompt(prompt_token_ids=ids), params, f"rag-{time.time_ns()}-{i}"):
            out.append((time.perf_counter() - start) * 1000)
            break
    return out


def measure(profile, prompts: list[list[int]], caching: bool) -> list[float]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = dict(profile.engine_args(PROJECT_ROOT), enable_prefix_caching=caching)
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
    try:
        return asyncio.run(ttfts(engine, prompts))
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "perf" / "results" / "prefix_cache")
    args = parser.parse_args(argv)
    profile = get_profile()
    os.environ.update(profile.engine_env())  # the served engine's settings (a3b_llm sets the same)
    tokenizer = perf_inputs.tokenizer_for(profile, PROJECT_ROOT)
    corpus = perf_inputs.Corpus(tokenizer)
    data = perf_inputs.rag_data(corpus, profile, profile.perf.rag_document_tokens, 1, "vllm", args.requests)
    prompts = [tokenizer.encode(entry["text_input"][0]) for entry in data["data"]]
    rows = []
    for caching in (False, True):
        print(f"prefix caching {'on' if caching else 'off'}: starting an engine ...", flush=True)
        times = measure(profile, prompts, caching)
        rows.append(dict(prefix_caching=caching, first_ms=times[0], later_median_ms=statistics.median(times[1:]),
                         ttft_ms=times))
    speedup = rows[0]["later_median_ms"] / rows[1]["later_median_ms"]
    table = ("| prefix caching | first request TTFT ms | later requests TTFT ms (median) |\n|---|---|---|\n"
             + "".join(f"| {'on' if r['prefix_caching'] else 'off'} | {r['first_ms']:.0f} | "
                       f"{r['later_median_ms']:.0f} |\n" for r in rows))
    print(table + f"\nlater requests: {speedup:.1f}x faster with prefix caching")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_cache.json").write_text(json.dumps(rows, indent=1))
    (args.out / "prefix_cache.md").write_text(
        f"# Prefix caching on the RAG mix (profile {profile.name})\n\n"
        f"Machine: {perf_report.machine()}. Command: `make bench-prefix-cache`. {args.requests} requests, "
        f"each {len(prompts[0])} tokens or so: shared system prompt + a {profile.perf.rag_document_tokens}-token "
        f"document + its own question; one at a time, 1 output token.\n\n{table}\n"
        f"Later requests: {speedup:.1f}x lower TTFT with prefix caching.\n")
    print(f"wrote {args.out / 'prefix_cache.md'}")


if __name__ == "__main__":
    main()

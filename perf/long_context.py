"""Long prompts through the whole served path on Qwen3.6's architecture at its
131072-token context: the real tritonserver with A3B_PROFILE=qwen-tiny, the
ensemble (tokenizer + chat template -> engine -> detokenizer), prompts of real text.

    make bench-long-context        # perf/results/long_context/{report.md,results.json,long_context.png}

1. Prompts of 1K to 130K tokens, each its own text (no prefix-cache hit),
   streamed over gRPC, and over HTTP (generate_stream) up to 32K: TTFT, mean
   inter-token latency, the time `preprocessing` spent on it (Triton's own
   compute-duration counter), peak RSS of tritonserver and of vLLM's engine
   processes, and the engine's peak KV/state cache use.
2. The RAG mix: one 86K-token document behind different questions, one at a
   time, then RAG_CONCURRENCY at once: TTFT and the prompt tokens the prefix
   cache saved for each (the rise of a3b_prompt_tokens_cached_total).
3. A 130K prefill cancelled by its client part-way, through `ensemble` and
   through `a3b_bls`: how long a short request sent right after waits beyond
   its idle TTFT, against one prefill chunk's time at that context.
Every request must come back whole, with num_input_tokens equal to the
prompt's tokens as the chat template renders them.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import http.client
import json
import math
import queue
import threading
import time
from pathlib import Path

from a3b_backend import contract
from a3b_backend.bench import loadgen, perf_inputs, perf_report, server_process
from a3b_backend.profiles import PROJECT_ROOT, get_profile

PROFILE = get_profile("qwen-tiny")
LENGTHS = (1024, 8192, 32768, 86016, 130048)
# HTTP up to this length too
HTTP_MAX_LENGTH = 32768
OUTPUT_TOKENS = 32
RAG_SEQUENTIAL = 4
RAG_CONCURRENCY = 3
SHORT_AFTER_CANCEL = 1024
# Of the longest prefill's measured TTFT: late, where a chunk costs the most.
CANCEL_AT = 0.8
REQUEST_TIMEOUT_S = 1800
# The server's processes by role (vLLM's EngineCore and worker summed as "engine")
RSS_ROLES = ("tritonserver", "preprocessing", "a3b_llm", "postprocessing", "engine")
OUT = PROJECT_ROOT / "perf" / "results" / "long_context"
LOG = PROJECT_ROOT / "perf" / "results" / "tmp" / "long_context.server.log"


@dataclasses.dataclass
class Measured:
    label: str
    prompt_tokens: int
    num_input_tokens: int
    ttft_s: float
    itl_ms: float
    output_tokens: int
    preprocess_ms: float
    cached_tokens: int
    peak_rss_gib: dict[str, float]
    peak_kv_cache_use: float
    error: str | None = None


class Sampler:
    """Peak RSS by process role and peak KV-cache use, sampled while a request runs."""

    def __init__(self, server: server_process.Server):
        self.server = server
        self.rss: dict[str, float] = {}
        self.kv = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        root = psutil.Process(self.server.proc.pid)
        tick = 0
        while not self._stop.is_set():
            now: dict[str, float] = {}
            for name, proc in server_process.named_processes(root):
                role = "engine" if server_process.ENGINE_PROCESS.match(name) else name
                try:
                    now[role] = now.get(role, 0.0) + proc.memory_info().rss / 2**30
                except psutil.NoSuchProcess:
                    continue
            for role, gib in now.items():
                self.rss[role] = max(self.rss.get(role, 0.0), gib)
            if tick % 4 == 0:
                self.kv = max(self.kv, counters(self.server)["kv"])
            tick += 1
            self._stop.wait(0.25)


def counters(server: server_process.Server) -> dict[str, float]:
    values = server_process.scrape_metrics(server.metrics_port)
    llm = lambda name: values.get(f'{name}{{model="a3b_llm",version="1"}}', 0.0)  # noqa: E731
    return {"cached": llm("a3b_prompt_tokens_cached_total"), "kv": llm("a3b_kv_cache_usage_perc"),
            "running": llm("a3b_num_requests_running"),
            "preprocess_us": values.get('nv_inference_compute_infer_duration_us{model="preprocessing",version="1"}',
                                        0.0)}


def settled(server: server_process.Server, before: dict[str, float]) -> dict[str, float]:
    """Counters once the finished request's engine statistics are recorded (they trail its last response)."""
    deadline = time.monotonic() + 5
    while True:
        now = counters(server)
        if (now["running"] == 0 and now["preprocess_us"] > before["preprocess_us"]) or time.monotonic() > deadline:
            time.sleep(0.5)
            return counters(server)
        time.sleep(0.2)


def mean_gap_ms(stamps: list[int]) -> float:
    """Mean inter-token latency: the gaps between responses with text, in ms (NaN below two)."""
    return (stamps[-1] - stamps[0]) / 1e6 / (len(stamps) - 1) if len(stamps) > 1 else math.nan


def values(prompt: str) -> dict:
    return {"text_input": prompt, "stream": True, "apply_chat_template": True, "exclude_input_in_output": True,
            "return_num_input_tokens": True,
            "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True})}


def grpc_stream(url: str, prompt: str, cancel_after_s: float | None = None,
                model: str = contract.ENSEMBLE_MODEL) -> tuple[list[int], int, str | None]:
    """Arrival times (ns, from the send) of the responses carrying text, num_input_tokens, error."""
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((time.perf_counter_ns(), result, error)))
    start = time.perf_counter_ns()
    client.async_stream_infer(model, loadgen.infer_inputs(values(prompt)), enable_empty_final_response=True)
    stamps, input_tokens, error = [], 0, None
    try:
        while True:
            elapsed = (time.perf_counter_ns() - start) / 1e9
            wait = REQUEST_TIMEOUT_S if cancel_after_s is None else cancel_after_s - elapsed
            try:
                stamp, result, err = results.get(timeout=max(wait, 0.001))
            except queue.Empty:
                error = "cancelled by the client" if cancel_after_s is not None else f"no response in {wait:.0f} s"
                break
            if err is not None:
                error = str(err)
                break
            if loadgen.output_text(result, "text_output"):
                stamps.append(stamp - start)
            if tokens := loadgen.output_text(result, "num_input_tokens"):
                input_tokens = int(tokens)
            if loadgen.is_final(result):
                break
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    return stamps, input_tokens, error


def http_stream(url: str, prompt: str) -> tuple[list[int], int, str | None]:
    """The same over HTTP: POST generate_stream, server-sent events as they arrive."""
    host, port = url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT_S)
    start = time.perf_counter_ns()
    conn.request("POST", "/v2/models/ensemble/generate_stream", json.dumps(values(prompt)),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        return [], 0, f"HTTP {response.status}: {response.read()[:500]!r}"
    stamps, input_tokens = [], 0
    for line in response:
        if not line.startswith(b"data: "):
            continue
        event = json.loads(line[len(b"data: "):])
        if "error" in event:
            return stamps, input_tokens, event["error"]
        if event.get("text_output"):
            stamps.append(time.perf_counter_ns() - start)
        input_tokens = int(event.get("num_input_tokens", input_tokens) or input_tokens)
    conn.close()
    return stamps, input_tokens, None


class Bench:
    def __init__(self, server: server_process.Server):
        from transformers import AutoTokenizer

        self.server = server
        self.tokenizer = AutoTokenizer.from_pretrained(PROFILE.resolve_model_dir(PROJECT_ROOT))
        self.corpus = perf_inputs.Corpus(perf_inputs.tokenizer_for(PROFILE, PROJECT_ROOT))
        self._offset = 0

    def document(self, tokens: int) -> str:
        """Text of exactly `tokens` tokens from a part of the corpus no earlier document began at."""
        self._offset += 7919  # a prime stride: no two documents share a start, so no prefix-cache hit
        return self.corpus.text_of_length(tokens, start=self._offset)

    def chat_tokens(self, prompt: str) -> int:
        rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                      add_generation_prompt=True)
        return len(self.tokenizer.encode(rendered, add_special_tokens=False))

    def measure(self, label: str, prompt: str, send) -> Measured:
        before = counters(self.server)
        with Sampler(self.server) as sampler:
            stamps, input_tokens, error = send(prompt)
        after = settled(self.server, before)
        ttft = stamps[0] / 1e9 if stamps else math.nan
        itl = mean_gap_ms(stamps)
        m = Measured(label, self.chat_tokens(prompt), input_tokens, ttft, itl, len(stamps),
                     (after["preprocess_us"] - before["preprocess_us"]) / 1e3, int(after["cached"] - before["cached"]),
                     {k: round(v, 3) for k, v in sampler.rss.items()}, sampler.kv, error)
        print(f"  {label}: {m.prompt_tokens} tokens, TTFT {m.ttft_s:.2f} s, ITL {m.itl_ms:.1f} ms, "
              f"cached {m.cached_tokens}, {'error: ' + error if error else 'ok'}", flush=True)
        return m


def lengths_run(bench: Bench, lengths: list[int]) -> list[Measured]:
    out = []
    for length in lengths:
        out.append(bench.measure(f"gRPC {length}", bench.document(length),
                                 lambda p: grpc_stream(bench.server.grpc_url, p)))
        if length <= HTTP_MAX_LENGTH:
            out.append(bench.measure(f"HTTP {length}", bench.document(length),
                                     lambda p: http_stream(bench.server.http_url, p)))
    return out


def rag_run(bench: Bench, document_tokens: int) -> list[Measured]:
    document = bench.document(document_tokens)
    questions = [f"{perf_inputs.RAG_SYSTEM_PROMPT}{document}\n\nQuestion: {q}\nAnswer:"
                 for q in (*perf_inputs.RAG_QUESTIONS, "Who wrote it?", "When does it apply?", "What is it for?")]
    send = lambda p: grpc_stream(bench.server.grpc_url, p)  # noqa: E731
    out = [bench.measure(f"RAG {i + 1} of {RAG_SEQUENTIAL}, one at a time", questions[i], send)
           for i in range(RAG_SEQUENTIAL)]
    together = questions[RAG_SEQUENTIAL:RAG_SEQUENTIAL + RAG_CONCURRENCY]
    before = counters(bench.server)
    with concurrent.futures.ThreadPoolExecutor(RAG_CONCURRENCY) as pool:
        results = list(pool.map(send, together))
    cached = int(settled(bench.server, before)["cached"] - before["cached"])
    for i, ((stamps, input_tokens, error), prompt) in enumerate(zip(results, together)):
        itl = mean_gap_ms(stamps)
        out.append(Measured(f"RAG at concurrency {RAG_CONCURRENCY}, request {i + 1}", bench.chat_tokens(prompt),
                            input_tokens, stamps[0] / 1e9 if stamps else math.nan, itl, len(stamps), math.nan,
                            cached // RAG_CONCURRENCY, {}, math.nan, error))
        print(f"  {out[-1].label}: TTFT {out[-1].ttft_s:.2f} s", flush=True)
    return out


def cancel_run(bench: Bench, length: int, full_prefill_s: float, model: str) -> dict:
    """A `length`-token prefill sent to `model` and cancelled part-way; then a short request to it."""
    short = lambda p: grpc_stream(bench.server.grpc_url, p, model=model)  # noqa: E731
    idle = bench.measure("short prompt on the idle engine", bench.document(SHORT_AFTER_CANCEL), short)
    cancel_after = CANCEL_AT * full_prefill_s
    stamps, _, error = grpc_stream(bench.server.grpc_url, bench.document(length), cancel_after_s=cancel_after,
                                   model=model)
    cancelled_at = time.perf_counter()
    follow = bench.measure("short prompt right after the cancel", bench.document(SHORT_AFTER_CANCEL), short)
    freed_s = time.perf_counter() - cancelled_at
    return {"entry_point": model, "length": length, "cancelled_after_s": round(cancel_after, 2),
            "responses_before_cancel": len(stamps), "cancel_error": error, "next_ttft_s": follow.ttft_s, "idle_ttft_s": idle.ttft_s,
            "wait_s": follow.ttft_s - idle.ttft_s, "engine_idle_after_s": round(freed_s, 2),
            "next_request_ok": follow.error is None and follow.num_input_tokens == follow.prompt_tokens}


def chunk_time_s(rows: list[Measured], context: float) -> float:
    """One prefill chunk's time at `context` tokens: the chunk times the marginal prefill
    time per token between the two measured lengths around it (gRPC rows)."""
    points = sorted((m.prompt_tokens, m.ttft_s) for m in rows if m.label.startswith("gRPC"))
    for (n0, t0), (n1, t1) in zip(points, points[1:]):
        if n0 <= context <= n1:
            return PROFILE.max_num_batched_tokens * (t1 - t0) / (n1 - n0)
    return math.nan


def isa() -> str:
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    return ", ".join(f for f in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
                     if f in flags) or "no AVX-512 / AMX"


def report(rows: list[Measured], rag: list[Measured], cancels: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({
        "profile": PROFILE.name, "machine": perf_report.machine(), "isa": isa(),
        "lengths": [dataclasses.asdict(m) for m in rows], "rag": [dataclasses.asdict(m) for m in rag],
        "cancel": cancels}, indent=1))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for transport, marker in (("gRPC", "o"), ("HTTP", "s")):
        pts = [(m.prompt_tokens, m.ttft_s, m.itl_ms) for m in rows if m.label.startswith(transport)]
        left.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=transport)
        right.plot([p[0] for p in pts], [p[2] for p in pts], marker=marker, label=transport)
    first = rag[0].ttft_s
    left.scatter([m.prompt_tokens for m in rag[1:]], [m.ttft_s for m in rag[1:]], marker="x", color="C2",
                 label="86K document again (prefix cache)")
    left.scatter([rag[0].prompt_tokens], [first], marker="x", color="C3", label="86K document, first use")
    for axis, title, unit in ((left, "time to first token", "s"), (right, "inter-token latency", "ms")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("prompt tokens (chat-templated)")
        axis.set_ylabel(unit)
        axis.set_title(f"qwen-tiny, {title}")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    left.set_yscale("log")
    fig.tight_layout()
    fig.savefig(out / "long_context.png", dpi=110)

    lines = [
        "# Long context (128K) on the CPU: qwen-tiny served", "",
        f"`make bench-long-context` on {perf_report.machine()} (ISA: {isa()}); profile `{PROFILE.name}`: "
        f"max_model_len {PROFILE.max_model_len}, {PROFILE.max_num_batched_tokens}-token prefill chunks, "
        f"KV cache {PROFILE.kv_cache_dtype}, {PROFILE.cpu_kv_cache_gib} GiB of KV/state cache, "
        f"{OUTPUT_TOKENS} output tokens, greedy. Each prompt is its own text (no prefix-cache hit) "
        "in the chat template.", "",
        "| request | prompt tokens | num_input_tokens | TTFT s | ITL ms | responses with text | preprocessing ms | "
        + " | ".join(f"peak RSS {r} GiB" for r in RSS_ROLES) + " | peak KV/state use |",
        "|---|---|---|---|---|---|---|" + "---|" * len(RSS_ROLES) + "---|"]
    for m in rows:
        lines.append(f"| {m.label} | {m.prompt_tokens} | {m.num_input_tokens} | {m.ttft_s:.2f} | {m.itl_ms:.1f} | "
                     f"{m.output_tokens} | {m.preprocess_ms:.0f} | "
                     + " | ".join(f"{m.peak_rss_gib.get(r, math.nan):.2f}" for r in RSS_ROLES)
                     + f" | {m.peak_kv_cache_use:.1%} |" + (f" error: {m.error}" if m.error else ""))
    lines += ["", f"## RAG mix: one {rag[0].prompt_tokens}-token prompt's document, different questions", "",
              "| request | prompt tokens | TTFT s | vs first | prompt tokens from the prefix cache |",
              "|---|---|---|---|---|"]
    for m in rag:
        lines.append(f"| {m.label} | {m.prompt_tokens} | {m.ttft_s:.2f} | {m.ttft_s / first:.3f} | "
                     f"{m.cached_tokens}{' (mean of the three)' if 'concurrency' in m.label else ''} |"
                     + (f" error: {m.error}" if m.error else ""))
    context = CANCEL_AT * cancels[0]["length"]
    chunk = chunk_time_s(rows, context)
    lines += ["", f"## A {cancels[0]['length']}-token prefill cancelled by its client", "",
              f"Cancelled {CANCEL_AT:.0%} of its measured TTFT in; a {SHORT_AFTER_CANCEL}-token request sent right "
              f"after to the same entry point waits beyond its TTFT on the idle engine. One "
              f"{PROFILE.max_num_batched_tokens}-token chunk at ~{context:.0f} tokens of context takes ~{chunk:.2f} s "
              f"(the marginal prefill time between the measured lengths).", "",
              "| entry point | cancelled after s | next request's TTFT s | idle TTFT s | waited s | next request whole |",
              "|---|---|---|---|---|---|"]
    for c in cancels:
        lines.append(f"| {c['entry_point']} | {c['cancelled_after_s']} | {c['next_ttft_s']:.2f} | "
                     f"{c['idle_ttft_s']:.2f} | {c['wait_s']:.2f} | {c['next_request_ok']} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS),
                        help="prompt lengths in tokens; the longest is also the one cancelled")
    parser.add_argument("--rag-tokens", type=int, default=PROFILE.perf.rag_document_tokens,
                        help="the RAG mix's document length in tokens")
    args = parser.parse_args(argv)
    LOG.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(f"starting tritonserver with A3B_PROFILE={PROFILE.name} (log: {LOG})...", flush=True)
    server = server_process.start(LOG, {"A3B_PROFILE": PROFILE.name})
    try:
        bench = Bench(server)
        print("prompt lengths:", flush=True)
        rows = lengths_run(bench, args.lengths)
        print("RAG mix:", flush=True)
        rag = rag_run(bench, args.rag_tokens)
        print("cancel:", flush=True)
        longest = max(args.lengths)
        full = next(m.ttft_s for m in rows if m.label == f"gRPC {longest}")
        cancels = [cancel_run(bench, longest, full, model)
                   for model in (contract.ENSEMBLE_MODEL, contract.BLS_MODEL)]
    finally:
        server.stop()
    report(rows, rag, cancels, args.out)
    bad = [m.label for m in rows + rag if m.error or m.num_input_tokens != m.prompt_tokens]
    print(f"wrote {args.out}/report.md in {(time.monotonic() - started) / 60:.1f} min"
          + (f"; incomplete or miscounted: {', '.join(bad)}" if bad else ""))
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

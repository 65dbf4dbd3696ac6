"""vLLM on the CPU profile's model in each engine mode (eager or torch.compile,
bf16 or float32): greedy answer, start time, decode and prefill speed.

    .venv/bin/python perf/cpu_engine_modes.py                  # every mode, one after the other
    .venv/bin/python perf/cpu_engine_modes.py --mode eager/float32

Each mode runs in a fresh process (vLLM engines do not share one well).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from a3b_backend.profiles import PROJECT_ROOT

QUESTION = "What is the capital of France?"
DECODE_TOKENS = 64
PREFILL_TEXT = "The quick brown fox jumps over the lazy dog. " * 90  # ~900 tokens
MODES = ("eager/float32", "eager/bfloat16", "compiled/float32")


def measure(mode: str) -> dict:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from a3b_backend.profiles import get_profile

    profile = get_profile("cpu")
    args = profile.engine_args(PROJECT_ROOT)
    compile_mode, args["dtype"] = mode.split("/")
    args["enforce_eager"] = compile_mode == "eager"
    tokenizer = AutoTokenizer.from_pretrained(args["model"])
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                         add_generation_prompt=True)
    prompt = TokensPrompt(prompt_token_ids=tokenizer.encode(text, add_special_tokens=False))
    start = time.perf_counter()
    llm = LLM(**args)
    started_s = time.perf_counter() - start
    answer = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].text
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True))
    tokens_per_s = DECODE_TOKENS / (time.perf_counter() - start)
    long_prompt = TokensPrompt(prompt_token_ids=tokenizer.encode(PREFILL_TEXT))
    start = time.perf_counter()
    llm.generate([long_prompt], SamplingParams(max_tokens=1))
    prefill_tokens_per_s = len(long_prompt["prompt_token_ids"]) / (time.perf_counter() - start)
    llm.llm_engine.engine_core.shutdown()  # else the EngineCore process can outlive this one
    return {"mode": mode, "start_s": round(started_s, 1), "decode_tokens_per_s": round(tokens_per_s, 1),
            "prefill_tokens_per_s": round(prefill_tokens_per_s), "greedy_answer": answer}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=MODES)
    args = parser.parse_args()
    if args.mode:
        print("RESULT " + json.dumps(measure(args.mode)), flush=True)
        return 0
    rows = []
    for mode in MODES:
        done = subprocess.run([sys.executable, __file__, "--mode", mode], capture_output=True, text=True)
        line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append(json.loads(line[len("RESULT "):]))
    print("| mode | engine start (s) | decode tokens/s | prefill tokens/s | greedy answer |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['start_s']} | {r['decode_tokens_per_s']} | {r['prefill_tokens_per_s']} "
              f"| {r['greedy_answer']!r} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

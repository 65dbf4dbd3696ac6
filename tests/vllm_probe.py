"""Runs vLLM on a checkpoint in a process of its own (vLLM spawns its engine;
tests call this with subprocess). Prints one JSON line prefixed with RESULT.

    python tests/vllm_probe.py prompt-logprobs MODEL_DIR 1,2,3
    python tests/vllm_probe.py greedy MODEL_DIR 1,2,3 [max_tokens]
    python tests/vllm_probe.py check MODEL_DIR PROMPTS.json STEPS   # bf16: per prompt,
        prompt log-probs and STEPS greedy tokens with their log-probs, all prompts in one batch
    python tests/vllm_probe.py paced MODEL_DIR 1,2,3 [max_tokens]   # AsyncLLM streaming (DELTA),
        as it comes and through a3b_backend.serving.pacing.paced: each output's token ids
"""
from __future__ import annotations

import json
import sys


# An explicit KV size: otherwise vLLM's CPU worker reserves 90% of the
# machine's memory and refuses to start beside another engine (the served
# tests' server).
ENGINE_ARGS = dict(skip_tokenizer_init=True, enforce_eager=True, max_model_len=256, max_num_batched_tokens=256,
                   max_num_seqs=8, load_format="safetensors", kv_cache_memory_bytes=256 << 20)


def engine(model_dir: str, dtype: str = "float32"):
    from vllm import LLM

    return LLM(model=model_dir, dtype=dtype, **ENGINE_ARGS)


def check(model_dir: str, prompts_file: str, steps: str) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads(open(prompts_file).read())
    llm = engine(model_dir, "bfloat16")  # vLLM's CPU Gated DeltaNet runs in bf16 only
    prefill = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                           SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False))
    decode = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                          SamplingParams(temperature=0, max_tokens=int(steps), logprobs=0, detokenize=False,
                                         ignore_eos=True))
    llm.llm_engine.engine_core.shutdown()
    return {
        "prompt_logprobs": [[lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], p[1:])]
                            for out, p in zip(prefill, prompts)],
        "greedy": [list(out.outputs[0].token_ids) for out in decode],
        "greedy_logprobs": [[lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
                            for out in decode],
    }


def streamed(model_dir: str, prompt_ids: list[int], max_tokens: int) -> dict:
    import asyncio

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from a3b_backend.serving.pacing import ResponsePacing, paced

    # 20 responses/s for one stream: a 50 ms gap, several of this model's steps
    pacing = ResponsePacing(responses_per_s=20.0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)

    async def run() -> dict:
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model_dir, dtype="float32", **ENGINE_ARGS))
        try:
            result = {}
            for name, wrap in (("unpaced", lambda outs: outs), ("paced", lambda outs: paced(outs, pacing, lambda: 1))):
                outputs = llm.generate(TokensPrompt(prompt_token_ids=prompt_ids), params, name)
                result[name] = [list(out.outputs[0].token_ids) async for out in wrap(outputs)]
            return result
        finally:
            llm.shutdown()

    return asyncio.run(run())


def main(mode: str, model_dir: str, ids: str, max_tokens: str = "16") -> None:
    if mode == "check":
        print("RESULT " + json.dumps(check(model_dir, ids, max_tokens)), flush=True)
        return
    if mode == "paced":
        token_ids = [int(i) for i in ids.split(",")]
        print("RESULT " + json.dumps(streamed(model_dir, token_ids, int(max_tokens))), flush=True)
        return
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    token_ids = [int(i) for i in ids.split(",")]
    prompt = TokensPrompt(prompt_token_ids=token_ids)
    llm = engine(model_dir)
    if mode == "prompt-logprobs":
        out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False))[0]
        # position i (i >= 1): log p(prompt[i] | prompt[:i])
        result = [p[t].logprob for p, t in zip(out.prompt_logprobs[1:], token_ids[1:])]
    else:
        params = SamplingParams(temperature=0, max_tokens=int(max_tokens), detokenize=False, ignore_eos=True)
        result = list(llm.generate([prompt], params)[0].outputs[0].token_ids)
    llm.llm_engine.engine_core.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])

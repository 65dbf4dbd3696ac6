"""postprocessing: one engine step -> the text-level outputs of the ensemble."""
from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np

from a3b_backend.contract import POSTPROCESS_CONFIG
from a3b_backend.serving.detokenize import DecodeRule, text_delta
from a3b_backend.serving.tensors import string_tensor, string_value


# Asked for, they make a3b_llm parse the answer (preprocess.parser_config).
PARSED_OUTPUT_FLAGS = ("return_reasoning", "return_tool_calls")
# Like vllm_backend, an output is sent only when its flag asks for it.
OUTPUTS_BY_FLAG = {
    "return_finish_reason": ("finish_reason",),
    "return_cumulative_logprob": ("cumulative_logprob",),
    "return_logprobs": ("logprobs",),
    "return_num_input_tokens": ("num_input_tokens",),
    "return_num_output_tokens": ("num_output_tokens",),
    "return_log_probs": ("cum_log_probs", "output_log_probs"),
    "return_reasoning": ("reasoning_output",),
    "return_tool_calls": ("tool_calls",),
}


def _ids(tensors: Mapping[str, np.ndarray], name: str) -> list[int]:
    """An optional id tensor (absent: none)."""
    return tensors[name].reshape(-1).tolist() if name in tensors else []


def step_outputs(tensors: Mapping[str, np.ndarray], tokenizer: Any) -> dict[str, np.ndarray]:
    config = json.loads(string_value(tensors, POSTPROCESS_CONFIG) or "{}")
    rule = DecodeRule.from_params(config)
    finish_reason = string_value(tensors, "finish_reason")
    final = bool(finish_reason)
    returns = config.get("returns", {})
    parsed = any(returns.get(flag) for flag in PARSED_OUTPUT_FLAGS)
    if parsed:  # a3b_llm's parser already split reasoning, answer and tool calls
        text = string_value(tensors, "content_text")
    else:
        text = text_delta(
            tokenizer,
            _ids(tensors, "context_ids"),
            _ids(tensors, "token_ids"),
            rule,
            final=final,
            stopped_by=string_value(tensors, "stop_reason") or None,
        )
    if final and config.get("echo"):
        text = config["echo"] + text
    # a3b_llm sends the optional step tensors only when they hold something (contract.LLM_OUTPUTS)
    cumulative = float(tensors["cumulative_logprob"].reshape(-1)[0]) if "cumulative_logprob" in tensors else np.nan
    token_logprobs = tensors.get("token_logprobs", np.zeros(0)).reshape(-1).astype(np.float32)
    outputs = {
        "text_output": string_tensor(text),
        "finish_reason": string_tensor(finish_reason),
        "cumulative_logprob": np.array([cumulative], dtype=np.float32),
        "logprobs": string_tensor(string_value(tensors, "logprobs")),
        "num_input_tokens": tensors["num_input_tokens"].reshape(1).astype(np.uint32),
        "num_output_tokens": tensors["num_output_tokens"].reshape(1).astype(np.uint32),
        "cum_log_probs": np.array([cumulative], dtype=np.float32),
        "output_log_probs": token_logprobs,
    }
    if parsed:
        outputs.update(reasoning_output=string_tensor(string_value(tensors, "reasoning_text")),
                       tool_calls=string_tensor(string_value(tensors, "tool_calls")))
    asked = {name for flag, names in OUTPUTS_BY_FLAG.items() if returns.get(flag) for name in names}
    return {name: value for name, value in outputs.items() if name == "text_output" or name in asked}

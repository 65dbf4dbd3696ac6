"""The tensor contract of the four models: the source config.pbtxt files are rendered from.

Names and types of `ensemble` follow Triton's vllm_backend and the TensorRT-LLM
ensemble so that their clients, perf_analyzer inputs and genai-perf work
unchanged; shapes follow vllm_backend (no batch dimension, [1] for scalars).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # Triton type without the TYPE_ prefix
    dims: tuple[int, ...] = (1,)
    optional: bool = True


def _t(name: str, dtype: str, dims: tuple[int, ...] = (1,), optional: bool = True) -> Tensor:
    return Tensor(name, dtype, dims, optional)


def names(tensors: tuple[Tensor, ...]) -> tuple[str, ...]:
    return tuple(t.name for t in tensors)


# The token-level engine model and the tensors its adapters and the
# postprocessing step's cancellation forwarding name.
LLM_MODEL = "a3b_llm"
# The text-level model clients address (tokenizer -> LLM -> detokenizer).
ENSEMBLE_MODEL = "ensemble"
# The same contract in one Python model calling a3b_llm by BLS: a cancellation stops the engine at once.
BLS_MODEL = "a3b_bls"
POSTPROCESS_CONFIG = "postprocess_config"
ABORT_REQUEST_ID = "abort_request_id"
REQUEST_ID = "request_id"
# TensorRT-LLM's stop input: a request with it true ends the generations sent with the same request id.
STOP = "stop"


VLLM_BACKEND_INPUTS = (
    # Optional in the config although required: Triton 2.51's ensemble drops a
    # request missing a required input without any error, so preprocessing
    # checks for it and answers with a clear one.
    _t("text_input", "STRING"),
    _t("stream", "BOOL"),
    _t("sampling_parameters", "STRING"),
    _t("exclude_input_in_output", "BOOL"),
    _t("return_finish_reason", "BOOL"),
    _t("return_cumulative_logprob", "BOOL"),
    _t("return_logprobs", "BOOL"),
    _t("return_num_input_tokens", "BOOL"),
    _t("return_num_output_tokens", "BOOL"),
)
TRTLLM_INPUTS = (
    _t("max_tokens", "INT32"),
    *(_t(n, "FP32") for n in ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                              "repetition_penalty", "length_penalty")),
    *(_t(n, "INT32") for n in ("top_k", "min_tokens", "min_length", "end_id", "pad_id",
                               "beam_width", "num_return_sequences")),
    _t("seed", "UINT64"),
    _t("stop_words", "STRING", (-1,)),
    _t("bad_words", "STRING", (-1,)),
    _t("return_log_probs", "BOOL"),
    _t("guided_decoding_guide_type", "STRING"),
    _t("guided_decoding_guide", "STRING"),
)
# Ours: the model's own chat template, applied to text_input as one user turn
# (apply_chat_template) or to a JSON list of chat messages (messages, instead
# of text_input), with tool definitions and template keyword arguments.
EXTENSION_INPUTS = (
    _t("apply_chat_template", "BOOL"),
    _t("messages", "STRING"),
    _t("chat_template_kwargs", "STRING"),
    _t("tools", "STRING"),
    # reasoning and tool calls parsed out of the answer (profiles with parsers)
    _t("return_reasoning", "BOOL"),
    _t("return_tool_calls", "BOOL"),
)
TEXT_INPUTS = VLLM_BACKEND_INPUTS + TRTLLM_INPUTS + EXTENSION_INPUTS

TEXT_OUTPUTS = (
    _t("text_output", "STRING", (-1,)),
    _t("finish_reason", "STRING", (-1,)),
    _t("cumulative_logprob", "FP32", (-1,)),
    _t("logprobs", "STRING", (-1,)),
    _t("num_input_tokens", "UINT32", (-1,)),
    _t("num_output_tokens", "UINT32", (-1,)),
    _t("cum_log_probs", "FP32", (-1,)),
    _t("output_log_probs", "FP32", (-1,)),
    _t("reasoning_output", "STRING", (-1,)),
    _t("tool_calls", "STRING", (-1,)),
)

# preprocessing -> a3b_llm
LLM_REQUEST_INPUTS = (
    # Optional in the config although a generation needs it: a stop request has none
    # (a3b_llm names it when a generation lacks it).
    _t("input_ids", "INT32", (-1,)),
    _t("sampling_parameters", "STRING"),
    _t("stream", "BOOL"),
    # Opaque JSON echoed on every response: postprocessing is fed only by the
    # decoupled a3b_llm, so whatever it needs must travel through it.
    _t(POSTPROCESS_CONFIG, "STRING"),
    # JSON for a3b_llm's per-request reasoning/tool-call parser ("" = none)
    _t("parser_config", "STRING"),
)
# Control requests. abort_request_id: abort the generation with this request_id
# (a3b_llm's response output); Triton 2.51 does not pass an ensemble client's
# cancellation to a3b_llm, but postprocessing sees it and forwards it with
# this. stop: end the generations sent with this request's own id (the
# client's, known before any response: a prefill can be stopped).
LLM_CONTROL_INPUTS = (_t(ABORT_REQUEST_ID, "STRING"), _t(STOP, "BOOL"))
LLM_INPUTS = LLM_REQUEST_INPUTS + LLM_CONTROL_INPUTS
# a3b_llm -> postprocessing (one set per engine step). The optional ones are
# sent only when they hold something (absent: empty, or NaN for
# cumulative_logprob): every tensor costs its copy through Triton and both
# Python stubs on every token.
LLM_OUTPUTS = (
    _t("token_ids", "INT32", (-1,), optional=False),
    _t("context_ids", "INT32", (-1,)),
    _t("finish_reason", "STRING", (1,)),
    _t("stop_reason", "STRING", (1,)),
    _t("cumulative_logprob", "FP32", (1,)),
    _t("token_logprobs", "FP32", (-1,)),
    _t("logprobs", "STRING", (1,)),
    _t("num_input_tokens", "UINT32", (1,), optional=False),
    _t("num_output_tokens", "UINT32", (1,), optional=False),
    _t(POSTPROCESS_CONFIG, "STRING", (1,), optional=False),
    _t(REQUEST_ID, "STRING", (1,), optional=False),
    # this step's pieces when the request is parsed
    _t("reasoning_text", "STRING", (1,)),
    _t("content_text", "STRING", (1,)),
    _t("tool_calls", "STRING", (1,)),
)
PREPROCESS_OUTPUTS = tuple(dataclasses.replace(t, optional=False) for t in LLM_REQUEST_INPUTS)
POSTPROCESS_INPUTS = LLM_OUTPUTS

"""Both wire forms (vllm_backend and TensorRT-LLM ensemble) -> one validated request.

Everything here is pure: it takes numpy arrays keyed by tensor name and returns
plain data, so it is unit-tested without Triton. Every error message names the
tensor or parameter, the value received and what is allowed.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

import numpy as np

from a3b_backend.serving import structured
from a3b_backend.serving.sampling import (SAMPLING_PARAMS, TRTLLM_SAMPLING_TENSORS, coerce, parse_sampling_json,
                                         validated)
from a3b_backend.serving.tensors import RequestError, decode_utf8, scalar, string_value

RETURN_FLAGS = (
    "return_finish_reason",
    "return_cumulative_logprob",
    "return_logprobs",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "return_log_probs",
    "return_reasoning",
    "return_tool_calls",
)


MESSAGE_ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass
class GenerationRequest:
    """One validated text request, as the preprocessing model hands it on:
    a prompt (text_input) or chat messages, rendered by the model's template."""

    prompt: str
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    stream: bool = False
    exclude_input_in_output: bool = False
    apply_chat_template: bool = False
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)
    returns: dict[str, bool] = dataclasses.field(default_factory=dict)

    @property
    def echo_prompt(self) -> bool:
        # vllm_backend: non-streamed text repeats the prompt unless excluded;
        # streamed pieces never do.
        return not self.stream and not self.exclude_input_in_output


# ---------------------------------------------------------------------------
# Tensor access helpers
def _bool_tensor(tensors: Mapping[str, np.ndarray], name: str, default: bool) -> bool:
    value = scalar(tensors, name)
    if value is None:
        return default
    if isinstance(value, (bytes, str, np.bytes_)):
        return coerce("bool", decode_utf8(value, name), name)
    return bool(value)


def _string_list(tensors: Mapping[str, np.ndarray], name: str) -> list[str] | None:
    arr = tensors.get(name)
    if arr is None:
        return None
    return [decode_utf8(x, name) for x in arr.reshape(-1)]


def _trtllm_sampling(tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tensor, param in TRTLLM_SAMPLING_TENSORS.items():
        if tensor not in tensors:
            continue
        if SAMPLING_PARAMS[param].kind == "str_list":
            value: Any = _string_list(tensors, tensor)
        else:
            value = scalar(tensors, tensor).item()
        if param in out:
            raise RequestError("inputs 'min_tokens' and 'min_length' are aliases; send only one")
        try:
            out[param] = validated(param, value)
        except RequestError as exc:
            raise RequestError(str(exc).replace(f"parameter '{param}'", f"input '{tensor}'", 1)) from None
    _refuse_unsupported_trtllm(tensors)
    if "end_id" in tensors:
        end_id = int(scalar(tensors, "end_id"))
        if end_id < 0:
            raise RequestError(f"input 'end_id' = {end_id} is out of range: allowed is a token id >= 0")
        out["stop_token_ids"] = [end_id]
    return out


def _refuse_unsupported_trtllm(tensors: Mapping[str, np.ndarray]) -> None:
    for name, what in (("beam_width", "beam search"), ("num_return_sequences", "several sequences per request")):
        value = scalar(tensors, name)
        if value is not None and int(value) != 1:
            raise RequestError(f"input '{name}' = {int(value)} is not supported: allowed is 1 ({what} is not available)")
    value = scalar(tensors, "length_penalty")
    if value is not None and float(value) != 1.0:
        raise RequestError(
            f"input 'length_penalty' = {float(value)} is not supported: allowed is 1.0 "
            "(it only applies to beam search, which is not available)"
        )


def _json_input(tensors: Mapping[str, np.ndarray], name: str, expected: type, what: str) -> Any:
    raw = string_value(tensors, name)
    if not raw.strip():
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestError(f"input '{name}' is not valid JSON: {exc.msg} at char {exc.pos}") from None
    if not isinstance(value, expected):
        raise RequestError(f"input '{name}' must be {what}, got {type(value).__name__}")
    return value


def _messages(tensors: Mapping[str, np.ndarray]) -> list[dict[str, Any]] | None:
    messages = _json_input(tensors, "messages", list, "a JSON list of chat messages")
    if messages is None:
        return None
    if not messages:
        raise RequestError("input 'messages' is an empty list; at least one message is required")
    for i, message in enumerate(messages):
        where = f"input 'messages'[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if role not in MESSAGE_ROLES:
            raise RequestError(f"{where} has role {role!r}; allowed: {', '.join(MESSAGE_ROLES)}")
        content = message.get("content")
        if not (isinstance(content, str) or (content is None and role == "assistant")):
            raise RequestError(f"{where} ({role}) needs 'content' as a string"
                               + (" (or null with tool_calls)" if role == "assistant" else ""))
        calls = message.get("tool_calls")
        if calls is not None and not (role == "assistant" and isinstance(calls, list)):
            raise RequestError(f"{where}: 'tool_calls' is a list, on assistant messages only")
    return messages


def _tools(tensors: Mapping[str, np.ndarray]) -> list[dict[str, Any]] | None:
    tools = _json_input(tensors, "tools", list, "a JSON list of tool definitions (OpenAI function format)")
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str) and function["name"]):
            raise RequestError(f"input 'tools'[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                               f"\"parameters\": ...}}}}")
    return tools


def _guided_decoding(tensors: Mapping[str, np.ndarray]) -> dict[str, Any] | None:
    guide_type = string_value(tensors, "guided_decoding_guide_type")
    guide = string_value(tensors, "guided_decoding_guide")
    if not guide_type:
        if guide:
            raise RequestError("input 'guided_decoding_guide' needs 'guided_decoding_guide_type' "
                               f"({', '.join(structured.GUIDE_TYPES)})")
        return None
    return structured.from_guide(guide_type, guide or None)


def parse_request(tensors: Mapping[str, np.ndarray]) -> GenerationRequest:
    """Merge the vllm_backend and TensorRT-LLM forms; refuse conflicts."""
    raw_prompt = scalar(tensors, "text_input")
    messages = _messages(tensors)
    if (raw_prompt is None) == (messages is None):
        raise RequestError("send exactly one of input 'text_input' (a STRING tensor of shape [1]) and input "
                           "'messages' (a JSON list of chat messages)"
                           + (", not both" if messages is not None else ""))
    prompt = "" if raw_prompt is None else decode_utf8(raw_prompt, "text_input")
    if messages is None and not prompt.strip():
        raise RequestError("input 'text_input' is empty; a non-empty prompt is required")

    sampling = parse_sampling_json(string_value(tensors, "sampling_parameters"))
    for name, value in _trtllm_sampling(tensors).items():
        if name in sampling and sampling[name] != value:
            raise RequestError(
                f"parameter '{name}' is given both in 'sampling_parameters' ({sampling[name]!r}) "
                f"and as a tensor ({value!r}); send it once"
            )
        sampling[name] = value
    guided = _guided_decoding(tensors)
    if guided is not None:
        if "structured_outputs" in sampling:
            raise RequestError("structured outputs are given both in 'sampling_parameters' (structured_outputs) "
                               "and as 'guided_decoding_guide_type'; send them once")
        sampling["structured_outputs"] = guided

    returns = {flag: _bool_tensor(tensors, flag, False) for flag in RETURN_FLAGS}
    if returns["return_log_probs"] or returns["return_logprobs"] or returns["return_cumulative_logprob"]:
        sampling.setdefault("logprobs", 0)
    return GenerationRequest(
        prompt=prompt,
        messages=messages,
        tools=_tools(tensors),
        chat_template_kwargs=_json_input(tensors, "chat_template_kwargs", dict, "a JSON object") or {},
        stream=_bool_tensor(tensors, "stream", False),
        exclude_input_in_output=_bool_tensor(tensors, "exclude_input_in_output", False),
        apply_chat_template=_bool_tensor(tensors, "apply_chat_template", False),
        sampling=sampling,
        returns=returns,
    )

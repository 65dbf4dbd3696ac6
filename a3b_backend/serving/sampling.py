"""Sampling parameters in both wire forms' vocabulary, and the limits a profile
puts on a request: the parameter table, coercion (vllm_backend lets
sampling_parameters carry numbers as strings), range checks, and the context
window applied once the prompt's length is known. Every error names the
parameter, the value received and what is allowed.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable, Literal

import numpy as np

from a3b_backend.profiles import Profile
from a3b_backend.serving import structured
from a3b_backend.serving.tensors import RequestError

# ---------------------------------------------------------------------------
# Parameter table: name -> (kind, check, allowed-range text). `kind` coerces the
# value (vllm_backend lets sampling_parameters carry numbers as strings).
Check = Callable[[Any], bool]
ParamKind = Literal["float", "int", "bool", "str", "str_list", "int_list", "structured"]


@dataclasses.dataclass(frozen=True)
class Param:
    kind: ParamKind
    check: Check
    allowed: str


def _finite(lo: float, hi: float, lo_open: bool = False) -> Check:
    return lambda v: math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi


SAMPLING_PARAMS: dict[str, Param] = {
    "max_tokens": Param("int", lambda v: v >= 1, "an integer >= 1"),
    "min_tokens": Param("int", lambda v: v >= 0, "an integer >= 0"),
    "temperature": Param("float", _finite(0.0, 100.0), "a number in [0, 100] (0 = greedy)"),
    "top_p": Param("float", _finite(0.0, 1.0, lo_open=True), "a number in (0, 1]"),
    "top_k": Param("int", lambda v: v == -1 or v >= 0, "-1 or 0 (disabled) or an integer >= 1"),
    "min_p": Param("float", _finite(0.0, 1.0), "a number in [0, 1]"),
    "presence_penalty": Param("float", _finite(-2.0, 2.0), "a number in [-2, 2]"),
    "frequency_penalty": Param("float", _finite(-2.0, 2.0), "a number in [-2, 2]"),
    "repetition_penalty": Param("float", _finite(0.0, 10.0, lo_open=True), "a number in (0, 10]"),
    "seed": Param("int", lambda v: 0 <= v < 2**63, "an integer in [0, 2^63)"),
    "stop": Param("str_list", lambda v: all(v), "a string or a list of non-empty strings"),
    "stop_token_ids": Param("int_list", lambda v: all(t >= 0 for t in v), "a list of token ids >= 0"),
    "bad_words": Param("str_list", lambda v: all(v), "a list of non-empty strings"),
    "ignore_eos": Param("bool", lambda v: True, "true or false"),
    "include_stop_str_in_output": Param("bool", lambda v: True, "true or false"),
    "skip_special_tokens": Param("bool", lambda v: True, "true or false"),
    "logprobs": Param("int", lambda v: 0 <= v <= 20, "an integer in [0, 20]"),
    # vLLM's: a stream's response carries this many new tokens (the first and
    # the last go at once), for clients that want fewer, larger pieces.
    "stream_interval": Param("int", lambda v: v >= 1, "an integer >= 1"),
    "n": Param("int", lambda v: v == 1, "1 (several sequences per request are not supported)"),
    "best_of": Param("int", lambda v: v == 1, "1 (best-of sampling is not supported)"),
    "use_beam_search": Param("bool", lambda v: v is False, "false (beam search is not supported)"),
    "structured_outputs": Param("structured", lambda v: True,
                                "an object with one of json, regex, choice, grammar, json_object"),
    # The name older vLLM releases (and the Triton OpenAI frontend built on them) send.
    "guided_decoding": Param("structured", lambda v: True, "the same as structured_outputs"),
    # checked against the served adapters by a3b_llm (a3b_backend/serving/lora.py)
    "lora_name": Param("str", lambda v: bool(v), "the name of a served LoRA adapter"),
}

# TensorRT-LLM ensemble tensors that map straight onto a sampling parameter.
TRTLLM_SAMPLING_TENSORS: dict[str, str] = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens",
    "min_length": "min_tokens",  # genai-perf's tensorrtllm mode sends this name
    "seed": "seed",
    "stop_words": "stop",
    "bad_words": "bad_words",
}

# ---------------------------------------------------------------------------
# Coercion and validation
def coerce(kind: ParamKind, value: Any, name: str) -> Any:
    if kind == "structured":  # its own errors name what is wrong inside it
        return structured.from_sampling(value)
    where = f"'{name}'"
    try:
        if kind == "bool":
            if isinstance(value, (bool, np.bool_)):
                return bool(value)
            if isinstance(value, str) and value.strip().lower() in ("true", "false"):
                return value.strip().lower() == "true"
            if isinstance(value, (int, np.integer)) and value in (0, 1):
                return bool(value)
            raise TypeError
        if kind == "int":
            if isinstance(value, (bool, np.bool_)):
                raise TypeError
            if isinstance(value, str):
                value = value.strip()
                return int(value)
            if isinstance(value, (float, np.floating)):
                if not float(value).is_integer():
                    raise TypeError
            return int(value)
        if kind == "float":
            if isinstance(value, (bool, np.bool_)):
                raise TypeError
            return float(value.strip() if isinstance(value, str) else value)
        if kind == "str":
            if isinstance(value, str):
                return value
            raise TypeError
        if kind == "str_list":
            if isinstance(value, str):
                return [value]
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                return list(value)
            raise TypeError
        if kind == "int_list":
            if isinstance(value, list):
                return [coerce("int", v, name) for v in value]
            raise TypeError
    except (TypeError, ValueError, OverflowError):
        pass
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise RequestError(f"parameter {where} has value {shown}, which is not {_KIND_TEXT[kind]}")


_KIND_TEXT = {
    "bool": "a boolean",
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "str_list": "a string or list of strings",
    "int_list": "a list of integers",
    "structured": "an object",
}


def validated(name: str, value: Any) -> Any:
    if name == "logprobs" and isinstance(value, bool):
        # OpenAI chat's form, which Triton's OpenAI frontend passes on: false = none, true = the sampled token's
        return 0 if value else None
    spec = SAMPLING_PARAMS.get(name)
    if spec is None:
        raise RequestError(
            f"unknown sampling parameter '{name}'; allowed: {', '.join(sorted(SAMPLING_PARAMS))}"
        )
    coerced = coerce(spec.kind, value, name)
    if not spec.check(coerced):
        raise RequestError(f"parameter '{name}' = {value!r} is out of range: allowed is {spec.allowed}")
    return coerced


def parse_sampling_json(raw: str) -> dict[str, Any]:
    """vllm_backend's `sampling_parameters`: a JSON object, values may be strings."""
    if not raw.strip():
        return {}
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestError(f"input 'sampling_parameters' is not valid JSON: {exc.msg} at char {exc.pos}") from None
    if not isinstance(obj, dict):
        raise RequestError(
            f"input 'sampling_parameters' must be a JSON object, got {type(obj).__name__}"
        )
    if "guided_decoding" in obj and "structured_outputs" in obj:
        raise RequestError("parameters 'guided_decoding' and 'structured_outputs' are the same; send one")
    checked = {"structured_outputs" if name == "guided_decoding" else name: validated(name, value)
               for name, value in obj.items()}
    return {name: value for name, value in checked.items() if value is not None}


@dataclasses.dataclass(frozen=True)
class Limits:
    max_model_len: int
    default_max_tokens: int
    max_stop_words: int = 16
    max_stop_word_chars: int = 256
    vocab_size: int | None = None
    # what the profile can parse out of an answer (vLLM parser names)
    reasoning_parser: str | None = None
    tool_parser: str | None = None

    @classmethod
    def from_profile(cls, profile: Profile, vocab_size: int | None = None) -> "Limits":
        """The profile's limits; `vocab_size` where the model is loaded (a3b_llm checks token ids against it)."""
        return cls(max_model_len=profile.max_model_len, default_max_tokens=profile.default_max_tokens,
                   max_stop_words=profile.max_stop_words, max_stop_word_chars=profile.max_stop_word_chars,
                   vocab_size=vocab_size, reasoning_parser=profile.reasoning_parser, tool_parser=profile.tool_parser)

    @property
    def max_prompt_bytes(self) -> int:
        # Refused before tokenizing: no token of real text is longer than this.
        return 32 * self.max_model_len


def check_prompt_size(prompt: str, limits: Limits, name: str = "text_input") -> None:
    size = len(prompt.encode("utf-8"))
    if size > limits.max_prompt_bytes:
        raise RequestError(
            f"input '{name}' is {size} bytes; allowed is at most {limits.max_prompt_bytes} bytes "
            f"(32 bytes per token of the {limits.max_model_len}-token context)"
        )


def check_token_ids(ids: list[int], limits: Limits) -> None:
    if not ids:
        raise RequestError("input 'input_ids' is empty; at least one token id is required")
    if limits.vocab_size is not None:
        low, high = min(ids), max(ids)
        if low < 0 or high >= limits.vocab_size:
            bad = low if low < 0 else high
            raise RequestError(
                f"input 'input_ids' holds token id {bad}; allowed is 0..{limits.vocab_size - 1} (the vocabulary)"
            )


def finalize_sampling(sampling: dict[str, Any], num_prompt_tokens: int, limits: Limits,
                      prompt_input: str = "text_input") -> dict[str, Any]:
    """Apply the context window and defaults once the prompt length is known."""
    room = limits.max_model_len - num_prompt_tokens
    if room < 1:
        raise RequestError(
            f"input '{prompt_input}' is {num_prompt_tokens} tokens; the model's context is "
            f"{limits.max_model_len} tokens (max_model_len), which leaves no room to generate: "
            f"shorten the prompt to at most {limits.max_model_len - 1} tokens"
        )
    out = dict(sampling)
    if "max_tokens" in out:
        if out["max_tokens"] > room:
            raise RequestError(
                f"parameter 'max_tokens' = {out['max_tokens']} is out of range: the prompt is "
                f"{num_prompt_tokens} tokens and the context {limits.max_model_len}, so allowed is 1..{room}"
            )
    else:
        out["max_tokens"] = min(limits.default_max_tokens, room)
    if out.get("min_tokens", 0) > out["max_tokens"]:
        raise RequestError(
            f"parameter 'min_tokens' = {out['min_tokens']} exceeds max_tokens = {out['max_tokens']}"
        )
    for name in ("stop", "bad_words"):
        words = out.get(name, [])
        if len(words) > limits.max_stop_words:
            raise RequestError(
                f"parameter '{name}' has {len(words)} entries; allowed is at most {limits.max_stop_words}"
            )
        longest = max((len(w) for w in words), default=0)
        if longest > limits.max_stop_word_chars:
            raise RequestError(
                f"parameter '{name}' has an entry of {longest} characters; allowed is at most "
                f"{limits.max_stop_word_chars}"
            )
    return out

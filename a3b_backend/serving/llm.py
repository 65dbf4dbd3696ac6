"""Turns vLLM step outputs into the per-step data a3b_llm sends.

Each step carries the new token ids plus the window of earlier generated ids
that the stateless postprocessing step needs to detokenize safely.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np

from a3b_backend.contract import POSTPROCESS_CONFIG, REQUEST_ID
from a3b_backend.serving.detokenize import DecodeRule
from a3b_backend.serving.parsing import ChatParser, ParsedStep, parser_class, tool_calls_json
from a3b_backend.serving.sampling import Limits, check_token_ids, finalize_sampling, parse_sampling_json
from a3b_backend.serving.tensors import RequestError, string_tensor, string_value

# Validated for clear errors, but not SamplingParams fields in vLLM 0.32
# (lora_name becomes the request's LoRARequest).
_NOT_ENGINE_FIELDS = ("best_of", "use_beam_search", "lora_name")


@dataclasses.dataclass
class Step:
    token_ids: list[int]
    context_ids: list[int]
    finish_reason: str
    stop_reason: str
    cumulative_logprob: float
    token_logprobs: list[float]
    logprobs_json: str
    num_input_tokens: int
    num_output_tokens: int
    parsed: ParsedStep | None = None

    @property
    def final(self) -> bool:
        return bool(self.finish_reason)


@dataclasses.dataclass
class LlmRequest:
    prompt_ids: list[int]
    sampling: dict[str, Any]
    stream: bool
    parser_config: dict[str, Any] | None = None

    @property
    def lora_name(self) -> str | None:
        return self.sampling.get("lora_name")

    @property
    def decode_rule(self) -> DecodeRule:
        return DecodeRule.from_params(self.sampling)

    def sampling_params(self):
        from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

        kwargs = {k: v for k, v in self.sampling.items() if k not in _NOT_ENGINE_FIELDS}
        if "structured_outputs" in kwargs:
            kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
        kind = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        return SamplingParams(**kwargs, output_kind=kind)


def parse_llm_request(tensors: dict[str, np.ndarray], limits: Limits) -> LlmRequest:
    """a3b_llm's inputs -> a validated request (the same rules as the text path)."""
    if "input_ids" not in tensors:
        raise RequestError("input 'input_ids' is required (INT32 token ids, shape [-1])")
    prompt_ids = tensors["input_ids"].reshape(-1).tolist()
    check_token_ids(prompt_ids, limits)
    sampling = finalize_sampling(parse_sampling_json(string_value(tensors, "sampling_parameters")),
                                 len(prompt_ids), limits, "input_ids")
    stream = tensors.get("stream")
    raw_parser_config = string_value(tensors, "parser_config")
    try:
        parser_config = json.loads(raw_parser_config) if raw_parser_config else None
    except json.JSONDecodeError as exc:
        raise RequestError(f"input 'parser_config' is not valid JSON: {exc.msg}") from None
    return LlmRequest(prompt_ids=prompt_ids, sampling=sampling,
                      stream=bool(stream.reshape(-1)[0]) if stream is not None else False,
                      parser_config=parser_config)


def _parser_for(request: LlmRequest, tokenizer: Any) -> ChatParser | None:
    """The request's reasoning / tool-call parser (parsing.py says why it lives in a3b_llm)."""
    config = request.parser_config
    if config is None:
        return None
    if tokenizer is None:
        raise RequestError("input 'parser_config' asks for parsing but the served profile has no parsers")
    return ChatParser(parser_class(config.get("reasoning_parser"), config.get("tool_parser"), tokenizer),
                      tokenizer, request.prompt_ids, config.get("tools"), config.get("chat_template_kwargs") or {})


class StepTracker:
    """Follows one request's outputs (DELTA when streaming, FINAL_ONLY otherwise),
    parsing reasoning and tool calls out of them when the request asks for it.
    Built before the request is submitted, so a bad parser request is refused at once."""

    def __init__(self, request: LlmRequest, tokenizer: Any = None):
        self.request = request
        self._parser = _parser_for(request, tokenizer)
        self._context_tokens = request.decode_rule.context_tokens
        self._want_logprobs = request.sampling.get("logprobs") is not None
        self._generated: list[int] = []
        self._cumulative = 0.0

    def step(self, output: Any) -> Step:
        completion = output.outputs[0]
        new_ids = list(completion.token_ids)
        context = self._generated[-self._context_tokens:] if self._generated else []
        self._generated.extend(new_ids)
        token_logprobs, logprobs_json = self._logprobs(completion, new_ids)
        self._cumulative += sum(token_logprobs)
        finish = completion.finish_reason or ("stop" if output.finished else "")
        parsed = None if self._parser is None else self._parser.step(completion.text, new_ids, bool(finish))
        stop_reason = completion.stop_reason
        return Step(
            token_ids=new_ids,
            context_ids=context,
            finish_reason=finish or "",
            stop_reason=stop_reason if isinstance(stop_reason, str) else "",
            cumulative_logprob=self._cumulative if self._want_logprobs else math.nan,
            token_logprobs=token_logprobs,
            logprobs_json=logprobs_json,
            num_input_tokens=len(output.prompt_token_ids or []),
            # vllm_backend's count: this response's tokens (a stream's counts sum to the total)
            num_output_tokens=len(new_ids),
            parsed=parsed,
        )

    def _logprobs(self, completion: Any, new_ids: list[int]) -> tuple[list[float], str]:
        if not self._want_logprobs or not completion.logprobs:
            return [], ""
        entries = list(completion.logprobs)[-len(new_ids):] if new_ids else []
        sampled = [entry[tok].logprob for entry, tok in zip(entries, new_ids)]
        # vllm_backend's `logprobs` layout: per token {token_id: {logprob, rank, decoded_token}}.
        listed = [
            {str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for tid, lp in entry.items()}
            for entry in entries
        ]
        return sampled, json.dumps(listed)


def request_arrays(postprocess_config: str, request_id: str) -> dict[str, np.ndarray]:
    """Outputs that are the same on every step of a request: built once, not per token."""
    return {
        POSTPROCESS_CONFIG: string_tensor(postprocess_config),
        REQUEST_ID: string_tensor(request_id),
    }


def step_arrays(step: Step, per_request: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The a3b_llm output tensors of one step: the optional ones only when they
    hold something (contract.LLM_OUTPUTS)."""
    arrays = {
        "token_ids": np.asarray(step.token_ids, dtype=np.int32),
        "num_input_tokens": np.full(1, step.num_input_tokens, dtype=np.uint32),
        "num_output_tokens": np.full(1, step.num_output_tokens, dtype=np.uint32),
        **per_request,
    }
    if step.context_ids:
        arrays["context_ids"] = np.asarray(step.context_ids, dtype=np.int32)
    for name, text in (("finish_reason", step.finish_reason), ("stop_reason", step.stop_reason),
                       ("logprobs", step.logprobs_json)):
        if text:
            arrays[name] = string_tensor(text)
    if not math.isnan(step.cumulative_logprob):
        arrays["cumulative_logprob"] = np.full(1, step.cumulative_logprob, dtype=np.float32)
    if step.token_logprobs:
        arrays["token_logprobs"] = np.asarray(step.token_logprobs, dtype=np.float32)
    if step.parsed:
        for name, text in (("reasoning_text", step.parsed.reasoning), ("content_text", step.parsed.content),
                           ("tool_calls", tool_calls_json(step.parsed.tool_calls))):
            if text:
                arrays[name] = string_tensor(text)
    return arrays

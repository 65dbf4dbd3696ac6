"""preprocessing: text request -> token ids + normalized engine request."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

import numpy as np

from a3b_backend.serving.request import GenerationRequest, parse_request

from a3b_backend.serving.sampling import Limits, check_prompt_size, finalize_sampling
from a3b_backend.serving.tensors import RequestError, string_tensor


@dataclasses.dataclass
class Prepared:
    input_ids: list[int]
    sampling_json: str
    stream: bool
    postprocess_config: str
    parser_config: str = ""


def rendered_prompt(tokenizer: Any, request: GenerationRequest) -> str:
    """The text the model reads: text_input as it is, or the model's chat template
    applied to `messages` (or to text_input as one user turn), with tools and
    chat_template_kwargs."""
    if request.messages is None and not request.apply_chat_template:
        for name, given in (("chat_template_kwargs", request.chat_template_kwargs), ("tools", request.tools)):
            if given:
                raise RequestError(f"input '{name}' is given but no chat template is applied: send 'messages', "
                                   "or set 'apply_chat_template'")
        return request.prompt
    source = "messages" if request.messages is not None else "apply_chat_template"
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError(f"input '{source}' needs a chat template, and the served model has none")
    messages = request.messages or [{"role": "user", "content": request.prompt}]
    try:
        return tokenizer.apply_chat_template(messages, tools=request.tools, tokenize=False,
                                             add_generation_prompt=True, **request.chat_template_kwargs)
    except Exception as exc:  # the template's own refusals (raise_exception) and its failures on odd input
        raise RequestError(f"the model's chat template refused input '{source}': {exc}") from None


def parser_config(request: GenerationRequest, limits: Limits) -> dict[str, Any] | None:
    """What a3b_llm's per-request parser needs, when reasoning or tool calls are asked for."""
    wants_reasoning, wants_tools = request.returns["return_reasoning"], request.returns["return_tool_calls"]
    if not (wants_reasoning or wants_tools):
        return None
    for flag, wanted, parser in (("return_reasoning", wants_reasoning, limits.reasoning_parser),
                                 ("return_tool_calls", wants_tools, limits.tool_parser)):
        if wanted and parser is None:
            raise RequestError(f"input '{flag}' is true but the served profile has no "
                               f"{'reasoning' if flag == 'return_reasoning' else 'tool-call'} parser")
    return {"reasoning_parser": limits.reasoning_parser, "tool_parser": limits.tool_parser if wants_tools else None,
            "tools": request.tools, "chat_template_kwargs": request.chat_template_kwargs}


def postprocess_config(request: GenerationRequest, prompt: str) -> dict[str, Any]:
    return {
        "echo": prompt if request.echo_prompt else "",
        **{k: request.sampling[k] for k in ("stop", "include_stop_str_in_output", "skip_special_tokens")
           if k in request.sampling},
        "returns": request.returns,
    }


def prepare(tensors: Mapping[str, np.ndarray], tokenizer: Any, limits: Limits) -> Prepared:
    request = parse_request(tensors)
    source = "messages" if request.messages is not None else "text_input"
    prompt = rendered_prompt(tokenizer, request)
    check_prompt_size(prompt, limits, source)
    templated = request.messages is not None or request.apply_chat_template
    # A template's text carries its special tokens; a plain prompt gets the tokenizer's own.
    ids = list(tokenizer.encode(prompt, add_special_tokens=not templated))
    sampling = finalize_sampling(request.sampling, len(ids), limits, source)
    parsing = parser_config(request, limits)
    # echoed as the client sent it: text_input as is, messages as rendered
    echo = request.prompt if request.messages is None else prompt
    return Prepared(
        input_ids=ids,
        sampling_json=json.dumps(sampling),
        stream=request.stream,
        postprocess_config=json.dumps(postprocess_config(request, echo)),
        parser_config=json.dumps(parsing) if parsing else "",
    )


def prepared_arrays(prepared: Prepared) -> dict[str, np.ndarray]:
    return {
        "input_ids": np.asarray(prepared.input_ids, dtype=np.int32),
        "sampling_parameters": string_tensor(prepared.sampling_json),
        "stream": np.array([prepared.stream], dtype=bool),
        "postprocess_config": string_tensor(prepared.postprocess_config),
        "parser_config": string_tensor(prepared.parser_config),
    }

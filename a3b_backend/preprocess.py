"""preprocessing: text request -> token ids + normalized engine request."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

import numpy as np

from a3b_backend.request import GenerationRequest, Limits, check_prompt_size, finalize_sampling, parse_request
from a3b_backend.triton_io import RequestError, string_tensor


@dataclasses.dataclass
class Prepared:
    input_ids: list[int]
    sampling_json: str
    stream: bool
    postprocess_config: str


def tokenize(tokenizer: Any, request: GenerationRequest) -> list[int]:
    if not request.apply_chat_template:
        return list(tokenizer.encode(request.prompt, add_special_tokens=True))
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("input 'apply_chat_template' is true but the served model has no chat template")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": request.prompt}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def postprocess_config(request: GenerationRequest) -> dict[str, Any]:
    return {
        "echo": request.prompt if request.echo_prompt else "",
        **{k: request.sampling[k] for k in ("stop", "include_stop_str_in_output", "skip_special_tokens")
           if k in request.sampling},
        "returns": request.returns,
    }


def prepare(tensors: Mapping[str, np.ndarray], tokenizer: Any, limits: Limits) -> Prepared:
    request = parse_request(tensors)
    check_prompt_size(request.prompt, limits)
    ids = tokenize(tokenizer, request)
    sampling = finalize_sampling(request.sampling, len(ids), limits)
    return Prepared(
        input_ids=ids,
        sampling_json=json.dumps(sampling),
        stream=request.stream,
        postprocess_config=json.dumps(postprocess_config(request)),
    )


def prepared_arrays(prepared: Prepared) -> dict[str, np.ndarray]:
    return {
        "input_ids": np.asarray(prepared.input_ids, dtype=np.int32),
        "sampling_parameters": string_tensor(prepared.sampling_json),
        "stream": np.array([prepared.stream], dtype=bool),
        "postprocess_config": string_tensor(prepared.postprocess_config),
    }

"""Chat messages, structured outputs in both forms and vllm_backend's counts,
through the real server (the session's, default model)."""
from __future__ import annotations

import concurrent.futures
import json
import re

import jsonschema
import numpy as np
import pytest

from served import CAPITAL, GREEDY, stream_infer, text_request, texts

pytestmark = pytest.mark.served
# SmolLM2's own default system text (its template adds it when none is given)
CHAT = [{"role": "system", "content": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"},
        {"role": "user", "content": CAPITAL}]
# bounded values: unbounded, the greedy answer's length follows the checkpoint (one of make model's
# wrote "population": 1111... to max_tokens), and an object cut there is not valid
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
          "required": ["city", "population"], "additionalProperties": False}


def ensemble(server, inputs: dict) -> list[dict]:
    responses, error = stream_infer(server.grpc_url, "ensemble", inputs)
    assert error is None, error
    return responses


def answer(server, inputs: dict) -> str:
    return "".join(texts(ensemble(server, inputs)))


def test_messages_are_rendered_by_the_models_template(server, tokenizer):
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    [whole] = ensemble(server, {"messages": json.dumps(CHAT), "sampling_parameters": json.dumps(GREEDY),
                                "return_num_input_tokens": True})
    text = whole["text_output"].reshape(-1)[0].decode()
    assert int(whole["num_input_tokens"][0]) == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert text.startswith(rendered)  # the echoed prompt is the rendering (exclude_input_in_output false)
    assert "Paris" in text[len(rendered):]


def test_num_output_tokens_counts_each_response(server):
    sampling = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    streamed = ensemble(server, text_request(CAPITAL, True, sampling, return_num_output_tokens=True))
    counts = [int(r["num_output_tokens"][0]) for r in streamed]
    assert sum(counts) == 12 and max(counts) < 12  # per response, not a running total
    [whole] = ensemble(server, text_request(CAPITAL, False, sampling, return_num_output_tokens=True))
    assert int(whole["num_output_tokens"][0]) == 12


def structured_request(prompt: str, trtllm: tuple[str, str] | None = None, **constraint) -> dict:
    sampling = {"temperature": 0, "max_tokens": 64}
    if constraint:
        sampling["structured_outputs"] = constraint
    extra = {"guided_decoding_guide_type": trtllm[0], "guided_decoding_guide": trtllm[1]} if trtllm else {}
    return text_request(prompt, False, sampling, exclude_input_in_output=True, **extra)


def validates(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


@pytest.mark.parametrize("form", ["vllm_backend", "tensorrtllm"])
def test_json_schema_is_followed(server, form):
    prompt = CAPITAL
    assert not validates(answer(server, structured_request(prompt)))  # the constraint is what makes it valid
    request = (structured_request(prompt, json=SCHEMA) if form == "vllm_backend"
               else structured_request(prompt, ("json_schema", json.dumps(SCHEMA))))
    text = answer(server, request)
    assert validates(text), text


def test_choice_regex_and_any_json(server):
    choices = ["zebra-7", "quartz-9"]
    assert answer(server, structured_request(CAPITAL, choice=choices)) in choices
    # bounded, so the answer ends within max_tokens whatever letters the greedy model picks
    pattern = "[A-Z][a-z]{1,12} [0-9]{3}"
    assert answer(server, structured_request(CAPITAL, ("regex", pattern))).count(" ") == 1
    assert re.fullmatch(pattern, answer(server, structured_request(CAPITAL, regex=pattern)))
    # any JSON has no length bound, and a free answer's length follows the checkpoint (make model's
    # of one calibration text closed "Answer in JSON: what is the capital of France?" at two keys, the
    # next one's listed keywords to the end): the prompt gives the object to copy, which closes it
    text = answer(server, structured_request('Repeat this JSON exactly: {"city": "Paris", "country": "France"}',
                                             ("json", "")))
    assert isinstance(json.loads(text), dict), text


BAD_CHAT_INPUTS = [
    ({"text_input": "hi", "messages": json.dumps(CHAT)}, "not both"),
    ({"messages": "[{not json"}, "input 'messages' is not valid JSON"),
    ({"messages": json.dumps([{"role": "narrator", "content": "x"}])}, "has role 'narrator'"),
    ({"messages": json.dumps([{"role": "user"}])}, "needs 'content' as a string"),
    ({"messages": json.dumps(CHAT), "tools": json.dumps({"name": "f"})}, "input 'tools' must be a JSON list"),
    ({"messages": json.dumps(CHAT), "chat_template_kwargs": "[true]"}, "'chat_template_kwargs' must be a JSON object"),
    ({"text_input": "hi", "chat_template_kwargs": json.dumps({"enable_thinking": False})},
     "no chat template is applied"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"structured_outputs": {"json": {"type": "objectx"}}})},
     "invalid json: Unsupported type"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"structured_outputs": {"regex": "(unclosed"}})},
     "invalid regex"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"structured_outputs": {"grammar": "root ::= "}})},
     "invalid grammar"),
    ({"text_input": "hi", "guided_decoding_guide_type": "yaml", "guided_decoding_guide": "a: b"},
     "'guided_decoding_guide_type' = 'yaml' is not supported"),
    ({"text_input": "hi", "guided_decoding_guide_type": "ebnf_grammar"}, "needs 'guided_decoding_guide'"),
    ({"text_input": "hi", "guided_decoding_guide": "[a-z]+"}, "needs 'guided_decoding_guide_type'"),
]


def test_bad_chat_and_structured_inputs_are_refused_while_streams_finish(server):
    sampling = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(stream_infer, server.grpc_url, "ensemble", text_request(CAPITAL, True, sampling))
                   for _ in range(2)]
        for inputs, fragment in BAD_CHAT_INPUTS:
            responses, error = stream_infer(server.grpc_url, "ensemble", inputs)
            assert error is not None and fragment in error, (inputs, error)
        for stream in streams:
            responses, error = stream.result()
            assert error is None and sum(len(t) for t in texts(responses)) > 0
    assert server.is_ready()


def test_trtllm_tensors_and_messages_combine(server):
    """A TensorRT-LLM-style client sending messages: tensor sampling parameters apply."""
    inputs = {"messages": json.dumps(CHAT), "max_tokens": np.array([5], np.int32), "stream": True,
              "return_num_output_tokens": True}
    responses = ensemble(server, inputs)
    assert sum(int(r["num_output_tokens"][0]) for r in responses) <= 5


# Triton's OpenAI-compatible frontend (`--backend vllm`) applies the chat
# template itself and sends vllm_backend's tensors: the rendered prompt as
# text_input, exclude_input_in_output true, both count flags, and the request's
# non-None OpenAI fields as sampling_parameters (chat's `logprobs` a boolean).
# For a named tool choice it adds the tool's parameter schema as a JSON string
# of the whole structured-outputs dataclass: `structured_outputs` (vLLM's
# StructuredOutputsParams, `_`-private fields) or, in releases built on older
# vLLM, `guided_decoding` (GuidedDecodingParams, with backend fields).
OPENAI_DEFAULTS = {"frequency_penalty": 0.0, "logprobs": False, "n": 1, "presence_penalty": 0.0, "top_p": 1.0}
WEATHER_TOOL = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def frontend_request(tokenizer, stream: bool, **sampling) -> dict:
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    return {"text_input": prompt, "stream": stream, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({**OPENAI_DEFAULTS, "temperature": 0.0, "max_tokens": 24, **sampling}),
            "return_num_input_tokens": True, "return_num_output_tokens": True}


def usage(responses: list[dict]) -> tuple[int, int]:
    """What the frontend reads: prompt tokens once, completion tokens summed over responses."""
    return int(responses[0]["num_input_tokens"][0]), sum(int(r["num_output_tokens"][0]) for r in responses)


def test_openai_frontend_chat_request(server, tokenizer):
    [response] = ensemble(server, frontend_request(tokenizer, stream=False))
    text = response["text_output"].reshape(-1)[0].decode()
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert "Paris" in text and not text.startswith("<|im_start|>")
    prompt_tokens, completion_tokens = usage([response])
    assert prompt_tokens == len(tokenizer.encode(prompt))
    assert 0 < completion_tokens <= 24


def test_openai_frontend_streaming_request(server, tokenizer):
    whole = ensemble(server, frontend_request(tokenizer, stream=False, ignore_eos=True))
    streamed = ensemble(server, frontend_request(tokenizer, stream=True, ignore_eos=True))
    assert len(streamed) > 1 and "".join(texts(streamed)) == texts(whole)[0]
    assert usage(streamed) == usage(whole) and usage(whole)[1] == 24


@pytest.mark.parametrize("dataclass_form", ["structured_outputs", "guided_decoding"])
def test_openai_frontend_named_tool_choice(server, tokenizer, dataclass_form):
    schema = json.dumps(WEATHER_TOOL)
    if dataclass_form == "structured_outputs":
        import dataclasses

        from vllm.sampling_params import StructuredOutputsParams

        constraint = dataclasses.asdict(StructuredOutputsParams(json=schema))
    else:  # GuidedDecodingParams' fields in the vLLM releases that had it
        constraint = {"json": schema, "regex": None, "choice": None, "grammar": None, "json_object": None,
                      "backend": None, "backend_was_auto": False, "disable_fallback": False,
                      "disable_any_whitespace": False, "disable_additional_properties": False,
                      "whitespace_pattern": None, "structural_tag": None}
    [response] = ensemble(server, frontend_request(tokenizer, stream=False, **{dataclass_form: json.dumps(constraint)}))
    arguments = json.loads(response["text_output"].reshape(-1)[0].decode())
    jsonschema.validate(arguments, WEATHER_TOOL)

"""Request parsing: both wire forms, coercion, and the error messages users see."""
import json

import numpy as np
import pytest

from a3b_backend.serving.sampling import Limits, finalize_sampling

from a3b_backend.serving.request import parse_request
from a3b_backend.serving.tensors import RequestError

LIMITS = Limits(max_model_len=100, default_max_tokens=20)


def s(value):
    return np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)


def test_vllm_backend_form_with_string_values():
    req = parse_request({
        "text_input": s("hi"), "stream": np.array([True]),
        "sampling_parameters": s(json.dumps({"temperature": "0.5", "max_tokens": "7", "top_k": 3, "stop": "x"})),
        "exclude_input_in_output": np.array([True]), "return_finish_reason": np.array([True]),
    })
    assert req.prompt == "hi" and req.stream and req.exclude_input_in_output
    assert req.sampling == {"temperature": 0.5, "max_tokens": 7, "top_k": 3, "stop": ["x"]}
    assert req.returns["return_finish_reason"] and not req.returns["return_num_input_tokens"]


def test_trtllm_form_maps_tensors():
    req = parse_request({
        "text_input": s("hi"), "max_tokens": np.array([5], np.int32), "temperature": np.array([0.0], np.float32),
        "top_k": np.array([1], np.int32), "top_p": np.array([0.9], np.float32),
        "seed": np.array([42], np.uint64), "stop_words": np.array([b"END", b"STOP"], dtype=np.object_),
        "min_length": np.array([2], np.int32), "end_id": np.array([2], np.int32),
        "beam_width": np.array([1], np.int32), "pad_id": np.array([0], np.int32),
    })
    assert req.sampling["max_tokens"] == 5 and req.sampling["stop"] == ["END", "STOP"]
    assert req.sampling["min_tokens"] == 2 and req.sampling["seed"] == 42
    assert req.sampling["stop_token_ids"] == [2]
    assert req.sampling["top_p"] == pytest.approx(0.9)


def test_echo_default_follows_vllm_backend():
    assert parse_request({"text_input": s("a")}).echo_prompt
    assert not parse_request({"text_input": s("a"), "stream": np.array([True])}).echo_prompt
    assert not parse_request({"text_input": s("a"), "exclude_input_in_output": np.array([True])}).echo_prompt


def test_logprob_flags_ask_engine_for_logprobs():
    req = parse_request({"text_input": s("a"), "return_cumulative_logprob": np.array([True])})
    assert req.sampling["logprobs"] == 0


@pytest.mark.parametrize("tensors, fragment", [
    ({}, "send exactly one of input 'text_input'"),
    ({"text_input": s("   ")}, "'text_input' is empty"),
    ({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)}, "'text_input' is not valid UTF-8"),
    ({"text_input": s("a"), "sampling_parameters": s("{bad")}, "'sampling_parameters' is not valid JSON"),
    ({"text_input": s("a"), "sampling_parameters": s("[1]")}, "must be a JSON object"),
    ({"text_input": s("a"), "sampling_parameters": s('{"temprature": 1}')}, "unknown sampling parameter 'temprature'"),
    ({"text_input": s("a"), "sampling_parameters": s('{"temperature": -1}')}, "'temperature' = -1 is out of range"),
    ({"text_input": s("a"), "sampling_parameters": s('{"stream_interval": 0}')},
     "'stream_interval' = 0 is out of range: allowed is an integer >= 1"),
    ({"text_input": s("a"), "sampling_parameters": s('{"top_p": 1.5}')}, "allowed is a number in (0, 1]"),
    ({"text_input": s("a"), "sampling_parameters": s('{"max_tokens": -3}')}, "'max_tokens' = -3"),
    ({"text_input": s("a"), "sampling_parameters": s('{"max_tokens": "lots"}')}, "not an integer"),
    ({"text_input": s("a"), "beam_width": np.array([4], np.int32)}, "'beam_width' = 4 is not supported"),
    ({"text_input": s("a"), "num_return_sequences": np.array([2], np.int32)}, "'num_return_sequences'"),
    ({"text_input": s("a"), "length_penalty": np.array([2.0], np.float32)}, "'length_penalty'"),
    ({"text_input": s("a"), "max_tokens": np.array([0], np.int32)}, "input 'max_tokens' = 0 is out of range"),
    ({"text_input": s("a"), "min_length": np.array([1], np.int32), "min_tokens": np.array([1], np.int32)}, "aliases"),
    ({"text_input": s("a"), "max_tokens": np.array([3], np.int32),
      "sampling_parameters": s('{"max_tokens": 4}')}, "given both"),
    ({"text_input": s("a"), "temperature": np.array([np.nan], np.float32)}, "'temperature'"),
    ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, "exactly one value"),
    # chat
    ({"text_input": s("a"), "messages": s('[{"role": "user", "content": "hi"}]')}, "not both"),
    ({"messages": s("[{bad")}, "input 'messages' is not valid JSON"),
    ({"messages": s('{"role": "user"}')}, "input 'messages' must be a JSON list"),
    ({"messages": s("[]")}, "'messages' is an empty list"),
    ({"messages": s('[{"role": "wizard", "content": "hi"}]')}, "'messages'[0] has role 'wizard'; allowed: system"),
    ({"messages": s('[{"role": "user", "content": 5}]')}, "'messages'[0] (user) needs 'content' as a string"),
    ({"messages": s('["hi"]')}, "'messages'[0] must be an object"),
    ({"messages": s('[{"role": "user", "content": "a", "tool_calls": []}]')}, "on assistant messages only"),
    ({"text_input": s("a"), "tools": s('{"name": "f"}')}, "input 'tools' must be a JSON list"),
    ({"text_input": s("a"), "tools": s('[{"type": "function"}]')}, "input 'tools'[0] must be"),
    ({"text_input": s("a"), "chat_template_kwargs": s("[1]")}, "'chat_template_kwargs' must be a JSON object"),
    # structured outputs, both forms
    ({"text_input": s("a"), "sampling_parameters": s('{"structured_outputs": {"json": {"type": "objectx"}}}')},
     "parameter 'structured_outputs': invalid json: Unsupported type \"objectx\""),
    ({"text_input": s("a"), "sampling_parameters": s('{"structured_outputs": {"regex": "a(b"}}')},
     "invalid regex: Regex parsing error at position 4: The parenthesis is not closed"),
    ({"text_input": s("a"), "sampling_parameters": s('{"structured_outputs": {"grammar": "root ::= "}}')},
     "invalid grammar: EBNF parser error"),
    ({"text_input": s("a"), "sampling_parameters": s('{"structured_outputs": {"choice": []}}')},
     "choice must be a non-empty list"),
    ({"text_input": s("a"), "sampling_parameters": s('{"structured_outputs": {"regex": "a", "choice": ["b"]}}')},
     "needs exactly one of json, regex, choice, grammar, json_object; got regex, choice"),
    ({"text_input": s("a"), "sampling_parameters": s('{"structured_outputs": {"lark": "x"}}')},
     "unknown key(s) lark"),
    ({"text_input": s("a"), "sampling_parameters": s('{"structured_outputs": "{oops"}')}, "not valid JSON"),
    ({"text_input": s("a"), "guided_decoding_guide_type": s("xml")},
     "'guided_decoding_guide_type' = 'xml' is not supported; allowed: json, json_schema, regex, ebnf_grammar"),
    ({"text_input": s("a"), "guided_decoding_guide_type": s("regex")}, "needs 'guided_decoding_guide'"),
    ({"text_input": s("a"), "guided_decoding_guide": s("[a-z]+")}, "needs 'guided_decoding_guide_type'"),
    ({"text_input": s("a"), "guided_decoding_guide_type": s("json_schema"), "guided_decoding_guide": s("{x")},
     "the JSON schema is not valid JSON"),
    ({"text_input": s("a"), "guided_decoding_guide_type": s("regex"), "guided_decoding_guide": s("[a-z]+"),
      "sampling_parameters": s('{"structured_outputs": {"regex": "b"}}')}, "given both"),
])
def test_bad_requests_name_the_problem(tensors, fragment):
    with pytest.raises(RequestError) as err:
        parse_request(tensors)
    assert fragment in str(err.value)


def test_finalize_applies_default_and_context():
    assert finalize_sampling({}, 10, LIMITS)["max_tokens"] == 20
    assert finalize_sampling({}, 95, LIMITS)["max_tokens"] == 5
    with pytest.raises(RequestError, match="allowed is 1..90"):
        finalize_sampling({"max_tokens": 91}, 10, LIMITS)
    with pytest.raises(RequestError, match="'text_input' is 100 tokens"):
        finalize_sampling({}, 100, LIMITS)
    with pytest.raises(RequestError, match="at most 16"):
        finalize_sampling({"stop": ["x"] * 17}, 1, LIMITS)


def test_structured_outputs_in_both_forms_reach_the_same_constraint():
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    as_object = parse_request({"text_input": s("a"), "sampling_parameters": s(json.dumps(
        {"structured_outputs": {"json": schema}}))})
    # Triton's OpenAI frontend sends the whole dataclass as a string: nulls and private keys ignored
    as_string = parse_request({"text_input": s("a"), "sampling_parameters": s(json.dumps(
        {"structured_outputs": json.dumps({"json": schema, "regex": None, "choice": None, "_backend": None})}))})
    trtllm = parse_request({"text_input": s("a"), "guided_decoding_guide_type": s("json_schema"),
                            "guided_decoding_guide": s(json.dumps(schema))})
    assert as_object.sampling["structured_outputs"] == as_string.sampling["structured_outputs"] == \
        trtllm.sampling["structured_outputs"] == {"json": schema}
    assert parse_request({"text_input": s("a"), "guided_decoding_guide_type": s("json")}).sampling[
        "structured_outputs"] == {"json_object": True}


def test_messages_replace_text_input():
    req = parse_request({"messages": s('[{"role": "system", "content": "Be brief."}, {"role": "user", '
                                       '"content": "hi"}]'), "chat_template_kwargs": s('{"enable_thinking": false}')})
    assert req.prompt == "" and [m["role"] for m in req.messages] == ["system", "user"]
    assert req.chat_template_kwargs == {"enable_thinking": False}

"""The ensemble through the real tritonserver + vLLM (one server per session)."""
from __future__ import annotations

import concurrent.futures
import json
import math

import numpy as np
import pytest

from served import CAPITAL, GREEDY, http_post, sse_events, stream_infer, text_request, texts

pytestmark = pytest.mark.served


def test_grpc_streaming_answers_paris(server):
    responses, error = stream_infer(server.grpc_url, "ensemble", text_request(CAPITAL, True, GREEDY))
    assert error is None
    assert len(responses) > 1
    assert "Paris" in "".join(texts(responses))


def test_stream_concatenation_equals_non_streamed_text(server):
    streamed, error = stream_infer(server.grpc_url, "ensemble", text_request(CAPITAL, True, GREEDY))
    assert error is None
    whole, error = stream_infer(server.grpc_url, "ensemble",
                                text_request(CAPITAL, False, GREEDY, exclude_input_in_output=True))
    assert error is None
    assert len(whole) == 1
    assert "".join(texts(streamed)) == texts(whole)[0]
    assert all(CAPITAL not in piece for piece in texts(streamed))


def test_stream_interval_sends_fewer_pieces_of_the_same_text(server):
    every_token, error = stream_infer(server.grpc_url, "ensemble", text_request(CAPITAL, True, GREEDY,
                                                                               return_num_output_tokens=True))
    assert error is None
    by_four, error = stream_infer(server.grpc_url, "ensemble",
                                  text_request(CAPITAL, True, {**GREEDY, "stream_interval": 4},
                                               return_num_output_tokens=True))
    assert error is None
    assert "".join(texts(by_four)) == "".join(texts(every_token))
    counts = [int(r["num_output_tokens"].reshape(-1)[0]) for r in by_four]
    total = sum(int(r["num_output_tokens"].reshape(-1)[0]) for r in every_token)
    # the first token at once, then four per response (the remainder with the
    # last; a final response of its own may follow)
    assert counts[0] == 1 and sum(counts) == total
    assert len(by_four) <= 2 + math.ceil((total - 1) / 4) < len(every_token)

def test_non_streamed_output_repeats_prompt_unless_excluded(server):
    whole, error = stream_infer(server.grpc_url, "ensemble",
                                text_request("The capital of France is", False, GREEDY, chat=False))
    assert error is None and len(whole) == 1
    assert texts(whole)[0].startswith("The capital of France is")


def test_http_generate_and_generate_stream(server):
    body = {"text_input": CAPITAL, "apply_chat_template": True, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(GREEDY)}
    status, raw = http_post(server.http_url, "/v2/models/ensemble/generate", body)
    assert status == 200, raw
    assert "Paris" in json.loads(raw)["text_output"]
    status, raw = http_post(server.http_url, "/v2/models/ensemble/generate_stream", dict(body, stream=True))
    assert status == 200, raw
    events = sse_events(raw)
    assert len(events) > 1
    assert "Paris" in "".join(e["text_output"] for e in events)


@pytest.mark.parametrize("prompt", ["用中文介绍一下北京。", "Reply with three emoji about a party 🎉🥳"])
def test_multibyte_streams_only_whole_characters(server, prompt):
    sampling = {"temperature": 0, "max_tokens": 48}
    streamed, error = stream_infer(server.grpc_url, "ensemble", text_request(prompt, True, sampling))
    assert error is None
    pieces = texts(streamed)
    whole, error = stream_infer(server.grpc_url, "ensemble",
                                text_request(prompt, False, sampling, exclude_input_in_output=True))
    assert error is None
    # a character split between pieces would leave U+FFFD in both and differ from the whole text; a
    # U+FFFD the whole text holds too is the model's own output of bytes that are not UTF-8
    assert "".join(pieces) == texts(whole)[0]
    assert sum(p.count("\ufffd") for p in pieces) == texts(whole)[0].count("\ufffd")


def test_vllm_backend_style_request_returns_requested_fields(server):
    inputs = {
        "text_input": "Count: one, two, three,",
        "stream": False,
        "sampling_parameters": json.dumps({"temperature": "0", "max_tokens": "5"}),
        "exclude_input_in_output": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
        "return_finish_reason": True,
    }
    responses, error = stream_infer(server.grpc_url, "ensemble", inputs)
    assert error is None and len(responses) == 1
    out = responses[0]
    assert out["finish_reason"].reshape(-1)[0] == b"length"
    assert int(out["num_output_tokens"].reshape(-1)[0]) == 5
    assert int(out["num_input_tokens"].reshape(-1)[0]) > 3


def test_trtllm_style_request_and_stop_words(server):
    inputs = {
        "text_input": CAPITAL,
        "apply_chat_template": True,
        "stream": True,
        "max_tokens": np.array([32], np.int32),
        "temperature": np.array([0.0], np.float32),
        "top_k": np.array([1], np.int32),
        "top_p": np.array([1.0], np.float32),
        "seed": np.array([7], np.uint64),
        "stop_words": ["Paris"],
        "return_finish_reason": True,
    }
    responses, error = stream_infer(server.grpc_url, "ensemble", inputs)
    assert error is None
    text = "".join(texts(responses))
    assert "Paris" not in text and "capital" in text
    assert responses[-1]["finish_reason"].reshape(-1)[0] == b"stop"


def test_outputs_are_sent_only_when_asked(server):
    responses, error = stream_infer(server.grpc_url, "ensemble", text_request(CAPITAL, False, GREEDY))
    assert error is None and set(responses[0]) == {"text_output"}


def test_logprobs_fields(server):
    inputs = text_request(CAPITAL, False, {"temperature": 0, "max_tokens": 4}, return_log_probs=True,
                          return_cumulative_logprob=True, return_logprobs=True, exclude_input_in_output=True)
    responses, error = stream_infer(server.grpc_url, "ensemble", inputs)
    assert error is None
    out = responses[0]
    per_token = out["output_log_probs"].reshape(-1)
    assert per_token.shape == (4,) and np.all(per_token <= 0)
    assert out["cum_log_probs"].reshape(-1)[0] == pytest.approx(per_token.sum(), abs=1e-3)
    assert len(json.loads(out["logprobs"].reshape(-1)[0])) == 4


def test_eight_concurrent_streams(server):
    prompts = [f"Write one sentence about the number {i}." for i in range(8)]
    sampling = {"temperature": 0, "max_tokens": 24}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(
            lambda p: stream_infer(server.grpc_url, "ensemble",
                                   text_request(p, True, sampling, return_finish_reason=True)), prompts))
    for prompt, (responses, error) in zip(prompts, results):
        assert error is None, prompt
        assert responses[-1]["finish_reason"].reshape(-1)[0] in (b"length", b"stop")
        assert "".join(texts(responses)).strip()
    # Same prompt alone gives the same greedy text: batching did not mix streams.
    alone, _ = stream_infer(server.grpc_url, "ensemble", text_request(prompts[3], True, sampling))
    assert "".join(texts(alone)) == "".join(texts(results[3][0]))


def test_token_level_model_alone(server, tokenizer):
    ids = np.array(tokenizer.encode("The capital of France is"), dtype=np.int32)
    inputs = {"input_ids": ids, "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": 8}),
              "stream": True}
    responses, error = stream_infer(server.grpc_url, "a3b_llm", inputs)
    assert error is None and len(responses) > 1
    generated = np.concatenate([r["token_ids"] for r in responses]).tolist()
    assert len(generated) == 8
    assert "Paris" in tokenizer.decode(generated)
    assert responses[-1]["finish_reason"].reshape(-1)[0] == b"length"


@pytest.mark.parametrize("inputs, fragment", [
    ({"stream": True}, "text_input"),
    ({"text_input": "hi", "sampling_parameters": "{not json"}, "'sampling_parameters' is not valid JSON"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"max_tokens": -1})}, "'max_tokens' = -1"),
    ({"text_input": "word " * 9000}, "max_model_len"),
])
def test_bad_requests_get_clear_errors_and_server_stays_ready(server, inputs, fragment):
    responses, error = stream_infer(server.grpc_url, "ensemble", inputs)
    assert error is not None and fragment in error, error
    assert server.is_ready()
    ok, error = stream_infer(server.grpc_url, "ensemble", text_request(CAPITAL, False, GREEDY))
    assert error is None and "Paris" in texts(ok)[0]

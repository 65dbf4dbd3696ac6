"""a3b_bls, the BLS entry point, and a3b_llm's stop input, on the real server: the ensemble's
contract holds on a3b_bls, and a cancellation there frees the engine during a prefill."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from served import (CAPITAL, GREEDY, engine_idle, http_post, metric, open_stream, scrape, sse_events, stream_infer,
                    text_request)

pytestmark = pytest.mark.served
I32 = np.int32
CHAT = [{"role": "user", "content": CAPITAL}]
# name -> a request; each is answered alike by `ensemble` and `a3b_bls`
SAME_ANSWER = {
    "streamed": text_request(CAPITAL, True, GREEDY),
    "not streamed, prompt echoed": text_request(CAPITAL, False, GREEDY, chat=False),
    "stop string": text_request(CAPITAL, True, {**GREEDY, "stop": ["France"]}, return_finish_reason=True),
    "logprobs and counts": text_request(CAPITAL, True, {"temperature": 0, "max_tokens": 6, "logprobs": 2},
                                        return_logprobs=True, return_cumulative_logprob=True,
                                        return_num_input_tokens=True, return_num_output_tokens=True),
    "TensorRT-LLM form": {"text_input": CAPITAL, "apply_chat_template": True, "max_tokens": np.array([12], I32),
                          "temperature": np.array([0.0], np.float32), "stop_words": ["Paris"],
                          "return_log_probs": True, "return_finish_reason": True},
    "chat messages": {"messages": json.dumps(CHAT), "sampling_parameters": json.dumps(GREEDY),
                      "exclude_input_in_output": True},
    "structured output": text_request(CAPITAL, False, {**GREEDY, "structured_outputs": {"regex": "[A-Z][a-z]{2,9}"}}),
    # the shape Triton's OpenAI frontend sends (tests/test_served_chat.py, frontend_request)
    "OpenAI frontend shape": {"text_input": CAPITAL, "stream": True, "exclude_input_in_output": True,
                              "return_num_input_tokens": True, "return_num_output_tokens": True,
                              "sampling_parameters": json.dumps({"frequency_penalty": 0.0, "logprobs": False, "n": 1,
                                                                 "presence_penalty": 0.0, "top_p": 1.0,
                                                                 "temperature": 0.0, "max_tokens": 24})},
}


def joined(responses: list[dict]) -> dict[str, object]:
    """A request's outputs whatever their split into responses (which follows engine timing): text,
    per-token logprobs and token counts summed over the responses, the rest as the last one has it."""
    whole: dict[str, object] = {}
    for response in responses:
        for name, array in response.items():
            values = array.reshape(-1).tolist()
            if name == "text_output":
                whole[name] = whole.get(name, b"") + b"".join(values)
            elif name == "logprobs":
                whole[name] = whole.get(name, []) + [entry for v in values for entry in json.loads(v)]
            elif name == "output_log_probs":
                whole[name] = whole.get(name, []) + np.round(values, 4).tolist()
            elif name == "num_output_tokens":
                whole[name] = whole.get(name, 0) + sum(values)
            else:
                whole[name] = np.round(values, 4).tolist() if array.dtype.kind == "f" else values
    return whole


@pytest.mark.parametrize("case", SAME_ANSWER)
def test_bls_answers_as_the_ensemble_does(server, case):
    ensemble, error = stream_infer(server.grpc_url, "ensemble", SAME_ANSWER[case])
    assert error is None, error
    bls, error = stream_infer(server.grpc_url, "a3b_bls", SAME_ANSWER[case])
    assert error is None, error
    assert joined(bls) == joined(ensemble)
    if not SAME_ANSWER[case].get("stream"):
        assert len(bls) == 1  # a non-streamed answer is one response


def test_bls_over_http_generate_and_generate_stream(server):
    body = {"text_input": CAPITAL, "apply_chat_template": True, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(GREEDY)}
    answers = {}
    for model in ("ensemble", "a3b_bls"):
        status, raw = http_post(server.http_url, f"/v2/models/{model}/generate", body)
        assert status == 200, raw
        status, raw_stream = http_post(server.http_url, f"/v2/models/{model}/generate_stream", {**body, "stream": True})
        assert status == 200, raw_stream
        answers[model] = (json.loads(raw)["text_output"], "".join(e["text_output"] for e in sse_events(raw_stream)))
    assert answers["a3b_bls"] == answers["ensemble"] and answers["a3b_bls"][0] == answers["a3b_bls"][1]


def test_a_prefill_cancelled_through_bls_frees_the_engine_at_once(server):
    """The ensemble cannot do this: its cancellation reaches no step while the prefill runs
    (docs/operations.md, Cancellation). Through a3b_bls it sends a3b_llm a stop within 0.5 s and
    vLLM drops the request at its next step: one 1,024-token chunk of the cpu profile."""
    client, results = open_stream(server.grpc_url, "a3b_bls",
                                   text_request("word " * 7000, True, {"max_tokens": 16, "ignore_eos": True},
                                                chat=False))
    time.sleep(3)  # well inside the ~30 s prefill
    assert results.empty()
    cancelled = time.monotonic()
    client.stop_stream(cancel_requests=True)
    client.close()
    responses, error = stream_infer(server.grpc_url, "a3b_bls", text_request(CAPITAL, False, {"max_tokens": 1}))
    assert error is None and responses
    # behind a prefill left running it would have waited ~25 s more
    # behind a prefill left running it would have waited ~25 s more
    assert time.monotonic() - cancelled < 8
    assert metric(scrape(server.metrics_port), "a3b_num_requests_running") == 0


def test_stop_input_ends_the_generation_sent_with_its_id(server):
    long_run = {"input_ids": np.arange(100, 140, dtype=I32), "stream": True,
                "sampling_parameters": json.dumps({"max_tokens": 2000, "ignore_eos": True})}
    client, results = open_stream(server.grpc_url, "a3b_llm", long_run, request_id="story-7")
    try:
        result, error = results.get(timeout=120)
        assert error is None  # generating
        responses, error = stream_infer(server.grpc_url, "a3b_llm", {"stop": True}, request_id="story-7")
        assert error is None and responses == []  # answered at once, nothing generated for it
        generated, deadline = 0, time.monotonic() + 60
        while True:
            result, error = results.get(timeout=max(deadline - time.monotonic(), 0.1))
            assert error is None
            generated += len(result.as_numpy("token_ids") if result.as_numpy("token_ids") is not None else [])
            if result.get_response().parameters.get("triton_final_response").bool_param:
                break
        assert generated < 1000  # stopped, not run to max_tokens
    finally:
        client.stop_stream()
        client.close()
    assert metric(engine_idle(server), "a3b_num_requests_running") == 0
    # a stop for a generation that finished, or never ran, does nothing and is no error
    for request_id in ("story-7", "never-sent"):
        assert stream_infer(server.grpc_url, "a3b_llm", {"stop": True}, request_id=request_id) == ([], None)


@pytest.mark.parametrize("request_id, fragment", [
    ("", "input 'stop' is true but the request has no id"),
    ("x" * 300, "is malformed: allowed is 1..256 printable characters"),
])
def test_a_stop_that_names_no_generation_is_refused(server, request_id, fragment):
    _, error = stream_infer(server.grpc_url, "a3b_llm", {"stop": True}, request_id=request_id)
    assert error is not None and fragment in error
    assert server.is_ready()


def test_many_concurrent_bls_streams_finish_and_the_server_stays_up(server):
    """Streams that end while the cancellation watch polls: it must never ask about a finished one
    (Triton 2.51 has freed it then, and asking crashes tritonserver)."""
    import concurrent.futures

    inputs = text_request(CAPITAL, True, {"max_tokens": 8, "ignore_eos": True})
    with concurrent.futures.ThreadPoolExecutor(48) as pool:
        results = list(pool.map(lambda _: stream_infer(server.grpc_url, "a3b_bls", inputs), range(96)))
    assert all(error is None and responses for responses, error in results)
    assert server.is_ready()

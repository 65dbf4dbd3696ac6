"""`bls` (the ensemble's contract in one decoupled model) through the real
tritonserver + vLLM: it answers what `ensemble` answers. Its refusals and
cancellation are tested beside the ensemble's in test_served_hardening.py."""
from __future__ import annotations

import concurrent.futures
import json

import numpy as np
import pytest

from served import CAPITAL, GREEDY, http_post, sse_events, stream_infer, text_request, texts

pytestmark = pytest.mark.served

# Requests both models get: streamed and whole, chat and plain, multibyte,
# TensorRT-LLM inputs with stop words, and every optional output.
SAME_ANSWER = [
    text_request(CAPITAL, True, GREEDY, return_finish_reason=True, return_num_output_tokens=True),
    text_request("The capital of France is", False, GREEDY, chat=False),
    text_request("用中文介绍一下北京。", True, {"temperature": 0, "max_tokens": 48}),
    {"text_input": CAPITAL, "apply_chat_template": True, "stream": True, "max_tokens": np.array([32], np.int32),
     "temperature": np.array([0.0], np.float32), "stop_words": ["Paris"], "return_finish_reason": True},
    text_request(CAPITAL, False, {"temperature": 0, "max_tokens": 4}, return_log_probs=True,
                 return_cumulative_logprob=True, return_logprobs=True, return_num_input_tokens=True,
                 exclude_input_in_output=True),
]


def _joined(responses: list[dict]) -> dict:
    """A stream as one answer: the concatenated text and the last response's other fields."""
    last = {name: value.tolist() for name, value in responses[-1].items() if name != "text_output"}
    return {"text_output": "".join(texts(responses)), **last}


@pytest.mark.parametrize("inputs", SAME_ANSWER, ids=range(len(SAME_ANSWER)))
def test_bls_answers_what_the_ensemble_answers(server, inputs):
    ensemble, error = stream_infer(server.grpc_url, "ensemble", inputs)
    assert error is None
    bls, error = stream_infer(server.grpc_url, "bls", inputs)
    assert error is None
    assert all("\ufffd" not in piece for piece in texts(bls))
    assert _joined(bls) == _joined(ensemble)
    assert {name for r in bls for name in r} == {name for r in ensemble for name in r}


def test_bls_http_generate_stream(server):
    body = {"text_input": CAPITAL, "apply_chat_template": True, "stream": True,
            "sampling_parameters": json.dumps(GREEDY)}
    status, raw = http_post(server.http_url, "/v2/models/bls/generate_stream", body)
    assert status == 200, raw
    events = sse_events(raw)
    assert len(events) > 1 and "Paris" in "".join(e["text_output"] for e in events)


def test_concurrent_bls_streams_equal_solo_runs(server):
    prompts = [f"Write one sentence about the number {i}." for i in range(8)]
    sampling = {"temperature": 0, "max_tokens": 24}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: stream_infer(server.grpc_url, "bls", text_request(p, True, sampling)),
                                prompts))
    assert all(error is None for _, error in results)
    alone, _ = stream_infer(server.grpc_url, "bls", text_request(prompts[3], True, sampling))
    assert "".join(texts(alone)) == "".join(texts(results[3][0]))


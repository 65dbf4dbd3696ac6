"""Bad input, cancellation, overload and metrics against the real server."""
from __future__ import annotations

import concurrent.futures
import json
import time

import numpy as np
import psutil
import pytest

from a3b_backend.bench import loadgen
from served import (CAPITAL, GREEDY, engine_idle, metric, open_stream, ready_script, scrape, stream_infer,
                    text_request, texts)

pytestmark = pytest.mark.served
F32, I32 = np.float32, np.int32


def j(**params) -> str:
    return json.dumps(params)


ENSEMBLE_CASES = [
    ({"stream": True}, "send exactly one of input 'text_input'"),
    ({"text_input": ""}, "'text_input' is empty"),
    ({"text_input": "  \n "}, "'text_input' is empty"),
    ({"text_input": b"caf\xe9 \xff"}, "'text_input' is not valid UTF-8"),
    ({"text_input": np.array([1], I32)}, "text_input"),
    ({"text_input": ["a", "b"]}, "text_input"),
    ({"text_input": "hi", "stream": "yes"}, "stream"),
    ({"text_input": "hi", "apply_chat_template": np.array([1], I32)}, "apply_chat_template"),
    ({"text_input": "hi", "sampling_parameters": "{oops"}, "'sampling_parameters' is not valid JSON"),
    ({"text_input": "hi", "sampling_parameters": "[1, 2]"}, "must be a JSON object, got list"),
    ({"text_input": "hi", "sampling_parameters": '"greedy"'}, "must be a JSON object, got str"),
    ({"text_input": "hi", "sampling_parameters": j(temp=0)}, "unknown sampling parameter 'temp'"),
    ({"text_input": "hi", "sampling_parameters": j(temperature=-1)}, "'temperature' = -1 is out of range"),
    ({"text_input": "hi", "sampling_parameters": j(temperature="hot")}, "'temperature' has value 'hot'"),
    ({"text_input": "hi", "sampling_parameters": j(top_p=1.5)}, "allowed is a number in (0, 1]"),
    ({"text_input": "hi", "sampling_parameters": j(top_p=0)}, "'top_p' = 0"),
    ({"text_input": "hi", "sampling_parameters": j(top_k=-5)}, "'top_k' = -5"),
    ({"text_input": "hi", "sampling_parameters": j(max_tokens=0)}, "'max_tokens' = 0"),
    ({"text_input": "hi", "sampling_parameters": j(max_tokens=-1)}, "'max_tokens' = -1"),
    ({"text_input": "hi", "sampling_parameters": j(max_tokens=100000)}, "allowed is 1.."),
    ({"text_input": "hi", "sampling_parameters": j(max_tokens=4, min_tokens=9)}, "'min_tokens' = 9 exceeds"),
    ({"text_input": "hi", "sampling_parameters": j(presence_penalty=3)}, "allowed is a number in [-2, 2]"),
    ({"text_input": "hi", "sampling_parameters": j(frequency_penalty=-3)}, "'frequency_penalty' = -3"),
    ({"text_input": "hi", "sampling_parameters": j(repetition_penalty=0)}, "'repetition_penalty' = 0"),
    ({"text_input": "hi", "sampling_parameters": j(logprobs=50)}, "allowed is an integer in [0, 20]"),
    ({"text_input": "hi", "sampling_parameters": j(n=2)}, "several sequences per request are not supported"),
    ({"text_input": "hi", "sampling_parameters": j(best_of=3)}, "best-of sampling is not supported"),
    ({"text_input": "hi", "sampling_parameters": j(use_beam_search=True)}, "beam search is not supported"),
    ({"text_input": "hi", "sampling_parameters": j(seed=-1)}, "'seed' = -1"),
    ({"text_input": "hi", "sampling_parameters": j(stop=123)}, "'stop' has value 123"),
    ({"text_input": "hi", "sampling_parameters": j(stop=["ok", ""])}, "list of non-empty strings"),
    ({"text_input": "hi", "sampling_parameters": j(stop_token_ids=["a"])}, "'stop_token_ids'"),
    ({"text_input": "hi", "beam_width": np.array([4], I32)}, "'beam_width' = 4 is not supported"),
    ({"text_input": "hi", "num_return_sequences": np.array([2], I32)}, "'num_return_sequences' = 2"),
    ({"text_input": "hi", "length_penalty": np.array([2.0], F32)}, "'length_penalty' = 2.0 is not supported"),
    ({"text_input": "hi", "max_tokens": np.array([0], I32)}, "input 'max_tokens' = 0 is out of range"),
    ({"text_input": "hi", "temperature": np.array([np.nan], F32)}, "input 'temperature'"),
    ({"text_input": "hi", "top_p": np.array([2.0], F32)}, "input 'top_p' = 2.0"),
    ({"text_input": "hi", "max_tokens": np.array([3, 4], I32)}, "max_tokens"),
    ({"text_input": "hi", "min_length": np.array([1], I32), "min_tokens": np.array([1], I32)}, "aliases"),
    ({"text_input": "hi", "max_tokens": np.array([5], I32), "sampling_parameters": j(max_tokens=6)}, "given both"),
    ({"text_input": "hi", "stop_words": ["x"] * 100}, "'stop' has 100 entries; allowed is at most 16"),
    ({"text_input": "hi", "stop_words": ["x" * 1000]}, "an entry of 1000 characters"),
    ({"text_input": "hi", "end_id": np.array([-1], I32)}, "'end_id' = -1"),
    ({"text_input": "word " * 9000}, "max_model_len"),
    ({"text_input": "x" * 3_000_000}, "allowed is at most 262144 bytes"),
]
LLM_CASES = [
    ({"stream": True}, "'input_ids' is required"),
    ({"input_ids": np.array([], I32)}, "'input_ids' is empty"),
    ({"input_ids": np.array([1.0, 2.0], F32)}, "input_ids"),
    ({"input_ids": np.array([1, 2], I32), "sampling_parameters": "{"}, "not valid JSON"),
    ({"input_ids": np.array([1, 2], I32), "sampling_parameters": j(max_tokens=0)}, "'max_tokens' = 0"),
    ({"input_ids": np.array([1, 10**9], I32)}, "token id 1000000000; allowed is 0..49151"),
    ({"input_ids": np.array([-3, 2], I32)}, "token id -3"),
    ({"input_ids": np.ones(9000, I32)}, "input 'input_ids' is 9000 tokens"),
]


def _background_streams(server, count: int):
    pool = concurrent.futures.ThreadPoolExecutor(count)
    sampling = {"temperature": 0, "max_tokens": 48}
    return pool, [pool.submit(stream_infer, server.grpc_url, "ensemble", text_request(CAPITAL, True, sampling))
                  for _ in range(count)]


def test_bad_inputs_get_named_errors_while_streams_run(server):
    reference, error = stream_infer(server.grpc_url, "ensemble",
                                    text_request(CAPITAL, True, {"temperature": 0, "max_tokens": 48}))
    assert error is None
    pool, running = _background_streams(server, 2)
    failures = []
    for model, cases in (("ensemble", ENSEMBLE_CASES), ("a3b_bls", ENSEMBLE_CASES), ("a3b_llm", LLM_CASES)):
        for inputs, fragment in cases:
            responses, err = stream_infer(server.grpc_url, model, inputs)
            if err is None or fragment not in err:
                failures.append(f"{model} {list(inputs)}: expected {fragment!r}, got {err!r}")
    assert len(ENSEMBLE_CASES) + len(LLM_CASES) >= 40
    assert not failures, "\n".join(failures)
    assert server.is_ready()
    for future in running:
        responses, err = future.result(timeout=300)
        assert err is None and "".join(texts(responses)) == "".join(texts(reference))
    pool.shutdown()


def _stub_rss(model: str) -> int:
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "triton_python_backend_stub" in cmd and f"/{model}/" in cmd:
            return proc.memory_info().rss
    raise LookupError(f"no python stub process for {model}")


def _cancel_after_first(url: str, inputs: dict, model: str = "a3b_llm") -> None:
    client, results = open_stream(url, model, inputs)
    result, error = results.get(timeout=120)
    assert error is None
    client.stop_stream(cancel_requests=True)
    client.close()


CANCELLED_STREAMS = 200
RSS_GROWTH_BOUND = 200 * 2**20


def test_cancelled_streams_are_aborted_in_the_engine(server):
    rss_before = _stub_rss("a3b_llm")
    inputs = {"input_ids": np.arange(100, 140, dtype=I32), "stream": True,
              "sampling_parameters": j(max_tokens=2000, ignore_eos=True)}
    before = metric(scrape(server.metrics_port), "a3b_generation_tokens_total")
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda _: _cancel_after_first(server.grpc_url, inputs), range(CANCELLED_STREAMS)))
    values = engine_idle(server)
    assert metric(values, "a3b_num_requests_running") == 0
    assert metric(values, "a3b_num_requests_waiting") == 0
    # Had they run to max_tokens, 200 x 2000 tokens would have been generated.
    assert metric(values, "a3b_generation_tokens_total") - before < CANCELLED_STREAMS * 2000 / 10
    assert _stub_rss("a3b_llm") - rss_before < RSS_GROWTH_BOUND
    assert server.is_ready()


def test_cancelled_ensemble_streams_abort_the_engine(server):
    """Triton 2.51 does not pass an ensemble client's cancellation to a3b_llm;
    postprocessing sees it and asks a3b_llm to abort."""
    inputs = text_request("Tell me a long story.", True, {"max_tokens": 2000, "ignore_eos": True})
    before = metric(scrape(server.metrics_port), "a3b_generation_tokens_total")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: _cancel_after_first(server.grpc_url, inputs, "ensemble"), range(20)))
    values = engine_idle(server)
    assert metric(values, "a3b_num_requests_running") == 0
    assert metric(values, "a3b_generation_tokens_total") - before < 20 * 2000 / 10


def test_a_stream_cancelled_during_its_prefill_is_aborted_then(server):
    """A long prompt sends nothing until its prefill ends (seconds here, minutes at 128K):
    its cancellation is noticed without an engine output, and the engine drops the
    request at its next step instead of prefilling on."""
    inputs = {"input_ids": np.arange(1000, 1000 + 7000, dtype=I32), "stream": True,
              "sampling_parameters": j(max_tokens=16, ignore_eos=True)}
    client, results = open_stream(server.grpc_url, "a3b_llm", inputs)
    time.sleep(3)  # well inside the ~30 s prefill
    assert results.empty()
    cancelled = time.monotonic()
    client.stop_stream(cancel_requests=True)
    client.close()
    time.sleep(1)  # the watch notices within its 0.5 s poll
    _, error = stream_infer(server.grpc_url, "a3b_llm", {"input_ids": np.array([1, 2, 3], I32),
                                                          "sampling_parameters": j(max_tokens=1)})
    assert error is None
    # behind a prefill left running it would have waited ~25 s more
    assert time.monotonic() - cancelled < 10
    assert metric(engine_idle(server), "a3b_num_requests_running") == 0


@pytest.mark.parametrize("model", ["ensemble", "a3b_bls"])
def test_dropped_http_stream_stops_the_generation(server, model):
    import http.client

    body = json.dumps({"text_input": "Tell me a long story.", "stream": True,
                       "sampling_parameters": j(max_tokens=2000, ignore_eos=True)})
    before = metric(scrape(server.metrics_port), "a3b_generation_tokens_total")
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    conn.request("POST", f"/v2/models/{model}/generate_stream", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    response.readline()  # the first event arrived: generation is under way
    response.close()  # the client goes away without a word
    conn.close()
    values = engine_idle(server)
    assert metric(values, "a3b_num_requests_running") == 0
    assert metric(values, "a3b_generation_tokens_total") - before < 2000 / 4


def test_overload_gets_server_busy_not_unbounded_latency(server):
    """96 streams opened first, then all sent at once: past the limit of 64 in
    flight the rest are refused at once, the admitted ones all finish."""
    inputs = {"input_ids": np.arange(100, 120, dtype=I32), "stream": True,
              "sampling_parameters": j(max_tokens=32, ignore_eos=True)}
    clients = [loadgen.StreamClient(server.grpc_url) for _ in range(96)]
    try:
        with concurrent.futures.ThreadPoolExecutor(96) as pool:
            records = list(pool.map(lambda c: c.request("a3b_llm", inputs, 300, output="token_ids"), clients))
    finally:
        for c in clients:
            c.close()
    busy = [r.error for r in records if r.error and "server busy" in r.error]
    done = [r for r in records if r.error is None]
    assert busy and "retry later" in busy[0] and "limit is 64" in busy[0]
    assert len(busy) + len(done) == 96 and len(done) >= 16
    assert all(sum(len(t.split()) for t in r.texts) == 32 for r in done)
    assert metric(scrape(server.metrics_port), "a3b_request_rejected_total") >= len(busy)


def test_engine_metrics_are_exported(server):
    stream_infer(server.grpc_url, "ensemble", text_request(CAPITAL, True, GREEDY))
    values = scrape(server.metrics_port)
    assert metric(values, "a3b_prompt_tokens_total") > 0
    assert metric(values, "a3b_generation_tokens_total") > 0
    assert metric(values, "a3b_request_success_total") > 0
    assert values['a3b_time_to_first_token_seconds_count{model="a3b_llm",version="1"}'] > 0
    assert values['a3b_time_per_output_token_seconds_count{model="a3b_llm",version="1"}'] > 0
    assert 0 <= metric(values, "a3b_kv_cache_usage_perc") <= 1


def _engine_core(stub_model: str = "a3b_llm") -> psutil.Process:
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "triton_python_backend_stub" in cmd and f"/{stub_model}/" in cmd:
            cores = [c for c in proc.children(recursive=True) if "EngineCore" in " ".join(c.cmdline()) + c.name()]
            if cores:
                return cores[0]
    raise LookupError("no vLLM EngineCore process under the a3b_llm stub")


def _ready(server, model: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{model}/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_engine_death_fails_in_flight_requests_fast_and_recovers(server):
    """Runs last: it kills the engine process and waits for a3b_llm to start a new one."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    long = pool.submit(stream_infer, server.grpc_url, "ensemble",
                       text_request("Tell me a long story.", True, {"max_tokens": 2000, "ignore_eos": True}))
    time.sleep(3)
    _engine_core().kill()
    killed_at = time.monotonic()
    responses, error = long.result(timeout=60)
    assert error is not None and "engine failed" in error
    assert time.monotonic() - killed_at < 30
    assert _ready(server, "ensemble")  # the ensemble stays loaded while a3b_llm restarts its engine
    probe = ready_script(server)
    assert probe.returncode == 1 and "engine is down or restarting" in probe.stdout
    _, error = stream_infer(server.grpc_url, "ensemble", text_request(CAPITAL, False, GREEDY))
    assert error is not None and ("restarting" in error or "engine failed" in error)
    deadline = time.monotonic() + 300
    while metric(scrape(server.metrics_port), "a3b_engine_up") != 1:
        assert time.monotonic() < deadline, "engine did not come back"
        time.sleep(2)
    assert metric(scrape(server.metrics_port), "a3b_engine_restarts_total") >= 1
    assert ready_script(server).returncode == 0
    ok, error = stream_infer(server.grpc_url, "ensemble", text_request(CAPITAL, False, GREEDY))
    assert error is None and "Paris" in texts(ok)[0]
    pool.shutdown()


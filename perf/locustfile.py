"""locust scenarios against Triton's HTTP generate endpoints of `ensemble`.

    make locust                      # 4 users, 60 s, headless, against localhost:8000
    make locust-rag                  # the RAG mix at a fixed rate (RagUser)
    .venv-genai/bin/locust -f perf/locustfile.py EnsembleUser --host http://localhost:8000   # web UI on :8089

EnsembleUser streams a chat question over `generate_stream` (server-sent
events); one request in five is a non-streamed `generate`. RagUser sends the
RAG mix of a perf_analyzer input file (LOCUST_RAG_INPUT: one shared document,
a question of its own per request) over `generate_stream`, one request every
LOCUST_RAG_INTERVAL_S seconds per user; before the users start, one request
puts the document in the prefix cache (reported as its own entry).
locust times a streamed body only to its first bytes, so the scenarios report
three entries of their own: "TTFT" (first event with text), "inter-token" (mean
gap between later events) and "stream end-to-end" (request to last event).
A "server busy" answer is reported as a failure with its message.
LOCUST_MAX_TOKENS (default 32) sets EnsembleUser's answer length.
"""
from __future__ import annotations

import json
import os
import random
import time

from gevent.lock import Semaphore
from locust import HttpUser, between, constant_pacing, task

QUESTIONS = (
    "What is the capital of France?",
    "Explain in two sentences what a hash table is.",
    "Write a haiku about autumn.",
    "Give three tips for writing clear error messages.",
)
MAX_TOKENS = int(os.environ.get("LOCUST_MAX_TOKENS", "32"))


def stream_timed(user: HttpUser, body: dict, name: str = "generate_stream") -> None:
    """One generate_stream request, its TTFT / inter-token / end-to-end reported as entries."""
    start = time.perf_counter()
    stamps: list[float] = []
    with user.client.post("/v2/models/ensemble/generate_stream", json=body, stream=True,
                          catch_response=True, name=name) as response:
        if response.status_code != 200:
            response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
            return
        for line in response.iter_lines():
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[len(b"data: "):])
            if "error" in event:
                response.failure(event["error"])
                return
            if event.get("text_output"):
                stamps.append(time.perf_counter())
        if not stamps:
            response.failure("stream ended without text")
            return
        response.success()
    fire = user.environment.events.request.fire
    fire(request_type="SSE", name="TTFT", response_time=(stamps[0] - start) * 1000, response_length=0,
         exception=None, context={})
    fire(request_type="SSE", name="stream end-to-end", response_time=(stamps[-1] - start) * 1000,
         response_length=len(stamps), exception=None, context={})
    if len(stamps) > 1:
        fire(request_type="SSE", name="inter-token", response_length=0, exception=None, context={},
             response_time=(stamps[-1] - stamps[0]) * 1000 / (len(stamps) - 1))


class EnsembleUser(HttpUser):
    wait_time = between(0.5, 1.5)

    def _body(self, stream: bool) -> dict:
        return {"text_input": random.choice(QUESTIONS), "apply_chat_template": True, "stream": stream,
                "exclude_input_in_output": True,
                "sampling_parameters": json.dumps({"temperature": 0.7, "max_tokens": MAX_TOKENS})}

    @task(4)
    def stream(self) -> None:
        stream_timed(self, self._body(True))

    @task(1)
    def generate(self) -> None:
        with self.client.post("/v2/models/ensemble/generate", json=self._body(False), catch_response=True,
                              name="generate") as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
            elif not response.json().get("text_output"):
                response.failure("empty text_output")
            else:
                response.success()


RAG_INTERVAL_S = float(os.environ.get("LOCUST_RAG_INTERVAL_S", "10"))
_document_cached = Semaphore()
_warmed: list[bool] = []


def rag_bodies() -> list[dict]:
    """The perf_analyzer input file's requests as generate_stream bodies (each value is a one-element list)."""
    with open(os.environ["LOCUST_RAG_INPUT"]) as f:
        entries = json.load(f)["data"]
    return [{name: values[0] for name, values in entry.items()} for entry in entries]


class RagUser(HttpUser):
    wait_time = constant_pacing(RAG_INTERVAL_S)

    def on_start(self) -> None:
        self.bodies = rag_bodies()
        with _document_cached:  # the first user prefills the document once; the others wait for it
            if not _warmed:
                stream_timed(self, dict(self.bodies[0], stream=True), name="warm-up (document into the prefix cache)")
                _warmed.append(True)

    @task
    def rag(self) -> None:
        stream_timed(self, dict(random.choice(self.bodies[1:]), stream=True), name="rag generate_stream")

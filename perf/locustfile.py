"""locust scenario against Triton's HTTP generate endpoints of `ensemble`.

    make locust                      # 4 users, 60 s, headless, against localhost:8000
    .venv-genai/bin/locust -f perf/locustfile.py --host http://localhost:8000   # web UI on :8089

Each user streams a chat question over `generate_stream` (server-sent events).
locust times a streamed body only to its first bytes, so the scenario reports
three entries of its own: "TTFT" (first event with text), "inter-token" (mean
gap between later events) and "stream end-to-end" (request to last event).
One request in five is a non-streamed `generate`.
A "server busy" answer is reported as a failure with its message.
LOCUST_MAX_TOKENS (default 32) sets the answer length.
"""
from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, task

QUESTIONS = (
    "What is the capital of France?",
    "Explain in two sentences what a hash table is.",
    "Write a haiku about autumn.",
    "Give three tips for writing clear error messages.",
)
MAX_TOKENS = int(os.environ.get("LOCUST_MAX_TOKENS", "32"))


class EnsembleUser(HttpUser):
    wait_time = between(0.5, 1.5)

    def _body(self, stream: bool) -> dict:
        return {"text_input": random.choice(QUESTIONS), "apply_chat_template": True, "stream": stream,
                "exclude_input_in_output": True,
                "sampling_parameters": json.dumps({"temperature": 0.7, "max_tokens": MAX_TOKENS})}

    @task(4)
    def stream(self) -> None:
        start = time.perf_counter()
        stamps: list[float] = []
        with self.client.post("/v2/models/ensemble/generate_stream", json=self._body(True), stream=True,
                              catch_response=True, name="generate_stream") as response:
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
        fire = self.environment.events.request.fire
        fire(request_type="SSE", name="TTFT", response_time=(stamps[0] - start) * 1000, response_length=0,
             exception=None, context={})
        fire(request_type="SSE", name="stream end-to-end", response_time=(stamps[-1] - start) * 1000,
             response_length=len(stamps), exception=None, context={})
        if len(stamps) > 1:
            fire(request_type="SSE", name="inter-token", response_length=0, exception=None, context={},
                 response_time=(stamps[-1] - stamps[0]) * 1000 / (len(stamps) - 1))

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

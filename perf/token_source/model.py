"""Benchmark only (`make bench-serving-path`): stands in for a3b_llm in a copy of
the model repository, so the serving path (preprocessing -> ensemble ->
postprocessing -> client) is measured without an engine.

It behaves like an engine producing one token per step for every running
stream: a step every $A3B_TOKEN_SOURCE_INTERVAL_MS (12.5 ms: 80 tokens/s per
stream), token ids of the text file $A3B_TOKEN_SOURCE_TEXT, each stream a
passage of its own, sent with the context window a3b_llm sends. Steps keep
an absolute schedule: when sending falls behind, the steps due meanwhile keep
their scheduled times, so a backlog shows as lateness.
$A3B_TOKEN_SOURCE_SENDING says how a stream's tokens go out:
- paced (as a3b_llm sends): a stream waits the profile's pacing gap between
  its responses (a3b_backend/serving/pacing.py), and its tokens due meanwhile go out
  in one response, as vLLM's RequestOutputCollector merges them for a3b_llm;
- coalesced: no gap; only the tokens due while sending fell behind are merged;
- per-token: one response per token even when behind.
Each response's `cumulative_logprob` carries its first token's scheduled time
in seconds after $A3B_TOKEN_SOURCE_EPOCH_NS (wall clock, as perf_analyzer
stamps responses; client and server share the machine's clock)."""
from a3b_backend.serving import triton

triton.use_utf8_locale()

import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import get_args  # noqa: E402

import triton_python_backend_utils as pb_utils  # noqa: E402

from a3b_backend import contract  # noqa: E402
from a3b_backend.bench.token_source import SENDING_ENV, Sending  # noqa: E402
from a3b_backend.serving.detokenize import DecodeRule  # noqa: E402
from a3b_backend.serving.pacing import ResponsePacing  # noqa: E402
from a3b_backend.serving.llm import Step, request_arrays, step_arrays  # noqa: E402
from a3b_backend.profiles import get_profile  # noqa: E402
from a3b_backend.serving.tensors import string_value  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
INPUT_NAMES = contract.names(contract.LLM_INPUTS)
# tokens between the starts of successive streams' passages (prime, so passages rarely repeat)
PASSAGE_STRIDE = 997


@dataclass
class Stream:
    sender: object
    token_ids: list[int]
    context_tokens: int
    prompt_tokens: int
    request_id: str
    per_request: dict
    sent: int = 0
    next_due_ns: int | None = None  # its next token's step; set by the first step after it joined
    last_sent_s: float | None = None  # monotonic time of its last response


class TritonPythonModel:
    def initialize(self, args):
        tokenizer = triton.load_tokenizer(args)
        self.text_ids = tokenizer(Path(os.environ["A3B_TOKEN_SOURCE_TEXT"]).read_text())["input_ids"]
        self.interval_ns = int(float(os.environ.get("A3B_TOKEN_SOURCE_INTERVAL_MS", "12.5")) * 1e6)
        self.sending = os.environ.get(SENDING_ENV, "paced")
        if self.sending not in get_args(Sending):
            raise ValueError(f"{SENDING_ENV}={self.sending!r}; allowed: {', '.join(get_args(Sending))}")
        self.pacing = ResponsePacing(get_profile().stream_responses_per_s)
        self.epoch_ns = int(os.environ.get("A3B_TOKEN_SOURCE_EPOCH_NS", time.time_ns()))
        # steps are scheduled on the monotonic clock and reported on the wall clock
        self.wall_minus_monotonic_ns = time.time_ns() - time.monotonic_ns()
        self.next_offset = 0
        self.streams: list[Stream] = []
        self.cancel_polls = triton.PollSchedule()
        self.loop = asyncio.new_event_loop()
        self.joined = asyncio.Event()
        threading.Thread(target=self.loop.run_forever, name="token-source", daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._steps(), self.loop)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            tensors = triton.read_inputs(request, INPUT_NAMES)
            if contract.ABORT_REQUEST_ID in tensors:
                sender.send(flags=FINAL)
                continue
            sampling = json.loads(string_value(tensors, "sampling_parameters") or "{}")
            count = int(sampling.get("max_tokens", 16))
            start = self.next_offset % (len(self.text_ids) - count)
            self.next_offset += PASSAGE_STRIDE
            request_id = uuid.uuid4().hex
            stream = Stream(sender, self.text_ids[start:start + count], DecodeRule.from_params(sampling).context_tokens,
                            int(tensors["input_ids"].size), request_id,
                            request_arrays(string_value(tensors, contract.POSTPROCESS_CONFIG), request_id))
            self.loop.call_soon_threadsafe(self._join, stream)
        return None

    def _join(self, stream: Stream) -> None:
        self.streams.append(stream)
        self.joined.set()

    async def _steps(self) -> None:
        while True:
            if not self.streams:
                self.joined.clear()
                await self.joined.wait()
                due = time.monotonic_ns()
            delay = (due - time.monotonic_ns()) / 1e9
            if delay > 0:
                await asyncio.sleep(delay)
            if self.sending != "per-token":  # every step due by now
                due += (time.monotonic_ns() - due) // self.interval_ns * self.interval_ns
            self.streams = [s for s in self.streams if self._emit(s, due)]
            due += self.interval_ns

    def _emit(self, stream: Stream, last_due_ns: int) -> bool:
        """Sends the stream's tokens due up to `last_due_ns`; False once it has sent its last."""
        # as a3b_llm asks
        if self.cancel_polls.due(stream.request_id, time.monotonic()) and stream.sender.is_cancelled():
            stream.sender.send(flags=FINAL)
            return False
        if stream.next_due_ns is None:
            stream.next_due_ns = last_due_ns
        now_s = time.monotonic()
        if (self.sending == "paced" and stream.last_sent_s is not None
                and self.pacing.wait_s(len(self.streams), stream.last_sent_s, now_s) > 0):
            return True
        k = stream.sent
        count = min((last_due_ns - stream.next_due_ns) // self.interval_ns + 1, len(stream.token_ids) - k)
        final = k + count == len(stream.token_ids)
        step = Step(token_ids=stream.token_ids[k:k + count],
                    context_ids=stream.token_ids[max(0, k - stream.context_tokens):k],
                    finish_reason="length" if final else "", stop_reason="",
                    cumulative_logprob=(stream.next_due_ns + self.wall_minus_monotonic_ns - self.epoch_ns) / 1e9,
                    token_logprobs=[], logprobs_json="",
                    num_input_tokens=stream.prompt_tokens, num_output_tokens=count)
        stream.sender.send(triton.response(pb_utils, step_arrays(step, stream.per_request)),
                           flags=FINAL if final else 0)
        stream.sent += count
        stream.last_sent_s = now_s
        stream.next_due_ns += count * self.interval_ns
        return not final

"""a3b_bls: the ensemble's whole contract in one decoupled Python model. It prepares the request
and detokenizes the steps in-process (the preprocessing and postprocessing models' own functions)
and calls a3b_llm by BLS, under an id of its own; a client's cancellation, polled every `poll_s`,
sends a3b_llm a `stop` for that id, so the engine drops the request at its next step, during a
prefill too. The ensemble cannot: Triton 2.51 shows a client's cancellation only to composing
requests created after it (docs/operations.md, Cancellation).

`pb_utils` is passed in: it exists only inside the Triton stub process."""
from __future__ import annotations

import threading
import uuid
from typing import Any

import numpy as np

from a3b_backend import contract
from a3b_backend.serving import triton
from a3b_backend.serving.postprocess import step_outputs
from a3b_backend.serving.preprocess import prepare, prepared_arrays
from a3b_backend.serving.sampling import Limits
from a3b_backend.serving.tensors import RequestError

TEXT_INPUT_NAMES = contract.names(contract.TEXT_INPUTS)
LLM_OUTPUT_NAMES = list(contract.names(contract.LLM_OUTPUTS))


class CancelWatch:
    """One thread that asks Triton, every `poll_s`, whether each in-flight client request was
    cancelled and sends a3b_llm a stop for its generation (once). A prefill sends nothing for
    minutes at 128K, so the serving thread, waiting on a3b_llm's next response, cannot ask.
    A request is asked about only under the lock and only until `discard`: the serving thread
    discards it before its final response, after which Triton 2.51 has freed what `is_cancelled`
    reads and asking crashes tritonserver (tests/test_stops.py keeps the order)."""

    def __init__(self, send_stop, poll_s: float = 0.5):
        self._send_stop, self._poll_s = send_stop, poll_s
        self._lock = threading.Lock()
        self._watched: dict[str, Any] = {}
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="a3b-bls-cancel-watch", daemon=True)
        self._thread.start()

    def add(self, generation_id: str, request: Any) -> None:
        with self._lock:
            self._watched[generation_id] = request

    def discard(self, generation_id: str) -> None:
        """Stop asking about it (it is about to send its final response)."""
        with self._lock:
            self._watched.pop(generation_id, None)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._closed.wait(self._poll_s):
            with self._lock:
                cancelled = [generation_id for generation_id, request in self._watched.items()
                             if request.is_cancelled()]
                for generation_id in cancelled:
                    del self._watched[generation_id]
            for generation_id in cancelled:
                self._send_stop(generation_id)


class BlsPipeline:
    """Serves each client request on a thread of its own: prepare, a3b_llm by BLS, detokenize, send."""

    def __init__(self, pb_utils: Any, tokenizer: Any, limits: Limits, poll_s: float = 0.5):
        self._pb, self._tokenizer, self._limits = pb_utils, tokenizer, limits
        self.watch = CancelWatch(self._send_stop, poll_s)

    def start(self, request: Any) -> None:
        threading.Thread(target=self._serve, args=(request,), name="a3b-bls-request", daemon=True).start()

    def _send_stop(self, generation_id: str) -> None:
        triton.send_control(self._pb, {contract.STOP: np.array([True])}, request_id=generation_id)

    def _serve(self, request: Any) -> None:
        sender = request.get_response_sender()
        final = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            prepared = prepare(triton.read_inputs(request, TEXT_INPUT_NAMES), self._tokenizer, self._limits)
        except RequestError as exc:
            sender.send(triton.error_response(self._pb, str(exc)), flags=final)
            return
        except Exception as exc:  # a bug answers this request, not the others
            sender.send(triton.error_response(self._pb, f"preprocessing failed: {exc!r}", invalid_argument=False),
                        flags=final)
            return
        generation_id = uuid.uuid4().hex
        generation = self._pb.InferenceRequest(
            model_name=contract.LLM_MODEL, request_id=generation_id, requested_output_names=LLM_OUTPUT_NAMES,
            inputs=[self._pb.Tensor(name, array) for name, array in prepared_arrays(prepared).items()])
        self.watch.add(generation_id, request)
        try:
            self._relay(generation, sender, generation_id)
        finally:
            self.watch.discard(generation_id)

    def _relay(self, generation: Any, sender: Any, generation_id: str) -> None:
        """a3b_llm's steps as text responses, each sent as it arrives; the one with a finish reason, the
        last, carries the final flag (a non-streamed request is one response, as HTTP generate needs).
        The watch forgets the request before any final flag."""
        final = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        last, finished = None, False
        try:
            for step in generation.exec(decoupled=True):  # read to its end, whatever was sent
                if finished:
                    continue
                if step.has_error():
                    last = self._pb.InferenceResponse(error=step.error())
                    break
                tensors = {t.name(): t.as_numpy() for t in step.output_tensors()}
                if not tensors:  # the flag-only end of a stream that had no finish reason (a stop)
                    continue
                response = triton.response(self._pb, step_outputs(tensors, self._tokenizer))
                finished = "finish_reason" in tensors
                if finished:
                    self.watch.discard(generation_id)
                sender.send(response, flags=final if finished else 0)
        except Exception as exc:  # a bug answers this request, not the others
            last = triton.error_response(self._pb, f"postprocessing failed: {exc!r}", invalid_argument=False)
        if finished:
            return
        self.watch.discard(generation_id)
        if last is None:
            sender.send(flags=final)
        else:
            sender.send(last, flags=final)

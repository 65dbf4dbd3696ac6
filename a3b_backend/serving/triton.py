"""Everything that touches Triton's python backend (`pb_utils`, passed in: it
exists only inside the Triton stub process): responses, per-request error
handling, the tokenizer the models load, and forwarding client cancellation.
"""
from __future__ import annotations

import asyncio
import locale
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Mapping

import numpy as np

from a3b_backend import contract
from a3b_backend.profiles import get_profile
from a3b_backend.serving.tensors import RequestError, string_tensor, string_value


def use_utf8_locale() -> None:
    # The stub starts with an ASCII default encoding; torch/vLLM imports then
    # fail on non-ASCII source files.
    locale.setlocale(locale.LC_ALL, "C.UTF-8")


def project_root(args: Mapping[str, str]) -> Path:
    """args['model_repository'] is this model's directory inside the repository."""
    return Path(args["model_repository"]).resolve().parent.parent


def read_inputs(request: Any, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The request's inputs among `names`, in one pass (pb_utils.get_input_tensor_by_name scans them all per name)."""
    wanted = set(names)
    return {tensor.name(): tensor.as_numpy() for tensor in request.inputs() if tensor.name() in wanted}


def response(pb_utils: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in arrays.items()])


def error_response(pb_utils: Any, message: str, invalid_argument: bool = True) -> Any:
    code = pb_utils.TritonError.INVALID_ARG if invalid_argument else pb_utils.TritonError.INTERNAL
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def load_tokenizer(args: Mapping[str, str]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(get_profile().resolve_model_dir(project_root(args)))


def respond_each(pb_utils: Any, requests: Iterable[Any], input_names: Iterable[str],
                 handle: Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]], stage: str,
                 cancellation: CancellationForwarder | None = None) -> list[Any]:
    """One response per request; a failure answers that request and no other.
    With `cancellation`, client cancellation is forwarded upstream."""
    names = tuple(input_names)
    responses = []
    for request in requests:
        try:
            tensors = read_inputs(request, names)
            if cancellation is not None:
                # Answered as usual even when cancelled: an error response here
                # leaves Triton 2.51's ensemble request in flight for good.
                cancellation.check(request, tensors)
            responses.append(response(pb_utils, handle(tensors)))
        except RequestError as exc:
            responses.append(error_response(pb_utils, str(exc)))
        except Exception as exc:  # a bug must answer this request, not kill the model
            responses.append(error_response(pb_utils, f"{stage} failed: {exc!r}", invalid_argument=False))
    return responses


def unavailable_response(pb_utils: Any, message: str) -> Any:
    """A retryable refusal (gRPC UNAVAILABLE)."""
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.UNAVAILABLE))


class PollSchedule:
    """When to ask Triton again whether a stream was cancelled: each ask is a
    round trip to the server and a stream's steps come every few
    milliseconds, so a stream is asked about at most every `poll_s`."""

    def __init__(self, poll_s: float = 0.1, remembered: int = 4096):
        self._poll_s, self._remembered = poll_s, remembered
        self._next_poll: OrderedDict[str, float] = OrderedDict()

    def due(self, stream_id: str, now: float) -> bool:
        if self._next_poll.get(stream_id, 0.0) > now:
            return False
        self._next_poll[stream_id] = now + self._poll_s
        self._next_poll.move_to_end(stream_id)
        if len(self._next_poll) > self._remembered:
            self._next_poll.popitem(last=False)
        return True


class QuietStreamWatch:
    """Notices a client's cancellation while a stream sends nothing: during a
    long prefill (minutes at 128K on a CPU) no engine output arrives, so the
    check made at each output never runs. Every `poll_s` without an output, it
    asks Triton whether the request was cancelled and, if so, aborts it; the
    engine then drops it at its next step (one prefill chunk)."""

    def __init__(self, is_cancelled: Callable[[], bool], abort: Callable[[], Awaitable[None]], poll_s: float = 0.5):
        self._is_cancelled, self._abort, self._poll_s = is_cancelled, abort, poll_s
        self._last_output = time.monotonic()

    def output(self) -> None:
        """The stream sent something: it is not quiet."""
        self._last_output = time.monotonic()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            if time.monotonic() - self._last_output >= self._poll_s and self._is_cancelled():
                await self._abort()
                return


def send_control(pb_utils: Any, inputs: Mapping[str, np.ndarray], request_id: str = "") -> None:
    """A control request to a3b_llm (an abort or a stop, by BLS), waited for: it answers at once, with nothing."""
    control = pb_utils.InferenceRequest(model_name=contract.LLM_MODEL, request_id=request_id,
                                        requested_output_names=[],
                                        inputs=[pb_utils.Tensor(name, array) for name, array in inputs.items()])
    for _ in control.exec(decoupled=True):
        pass


class CancellationForwarder:
    """Asks a3b_llm to abort the generation behind a cancelled ensemble stream
    (once), since Triton 2.51 does not pass the cancellation on."""

    def __init__(self, pb_utils: Any, remembered: int = 4096):
        self._pb_utils, self._polls = pb_utils, PollSchedule(remembered=remembered)
        self._aborted: deque = deque(maxlen=remembered)

    def check(self, request: Any, tensors: Mapping[str, np.ndarray]) -> None:
        request_id = string_value(tensors, contract.REQUEST_ID)
        if (not request_id or request_id in self._aborted or not self._polls.due(request_id, time.monotonic())
                or not request.is_cancelled()):
            return
        self._aborted.append(request_id)
        send_control(self._pb_utils, {contract.ABORT_REQUEST_ID: string_tensor(request_id)})

"""The BLS front model: preprocessing, a3b_llm and postprocessing in one decoupled model.

`ensemble` turns every engine step into a new Triton request to
`postprocessing` (the ensemble scheduler, a request, a round trip to that
stub). Here one stub prepares the request, streams a3b_llm's steps through a
BLS call and detokenizes each in-process, with the same functions and
contract as the three-model ensemble, so clients see the same responses.
It also sees its client's cancellation itself and forwards it to a3b_llm.

Triton 2.51's BLS response iterator blocks, so each stream is served on a
thread of its own (`serve`), waiting outside the lock that lets one thread at
a time call into the stub.
"""
from __future__ import annotations

import threading
from typing import Any

from a3b_backend import contract, triton_io
from a3b_backend.postprocess import step_outputs
from a3b_backend.preprocess import prepare, prepared_arrays
from a3b_backend.request import Limits

INPUT_NAMES = contract.names(contract.TEXT_INPUTS)
LLM_OUTPUT_NAMES = list(contract.names(contract.LLM_OUTPUTS))
# The stream threads call into the Python backend's stub one at a time.
STUB_CALLS = threading.Lock()


def llm_request(pb_utils: Any, tensors: dict, tokenizer: Any, limits: Limits) -> Any:
    """The a3b_llm request for a client request (RequestError when it is refused)."""
    arrays = prepared_arrays(prepare(tensors, tokenizer, limits))
    return pb_utils.InferenceRequest(model_name=contract.LLM_MODEL, requested_output_names=LLM_OUTPUT_NAMES,
                                     inputs=[pb_utils.Tensor(name, value) for name, value in arrays.items()])


def _forward(pb_utils: Any, request: Any, sender: Any, step: Any, tokenizer: Any,
             cancellation: triton_io.CancellationForwarder) -> bool:
    """Sends the client what one a3b_llm response holds; True once that was the final one."""
    final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    if step.has_error():  # a3b_llm's refusals and failures, with their codes
        sender.send(pb_utils.InferenceResponse(error=step.error()), flags=final)
        return True
    tensors = {t.name(): t.as_numpy() for t in step.output_tensors()}
    if not tensors:  # a3b_llm's bare final flag
        return False
    cancellation.check(request, tensors)
    is_final = bool(triton_io.string_value(tensors, "finish_reason"))
    sender.send(triton_io.response(pb_utils, step_outputs(tensors, tokenizer)), flags=final if is_final else 0)
    return is_final


def _start(pb_utils: Any, request: Any, sender: Any, tokenizer: Any, limits: Limits) -> Any:
    """The a3b_llm response iterator for a client request, or None when the request was refused."""
    final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    try:
        return llm_request(pb_utils, triton_io.read_inputs(request, INPUT_NAMES), tokenizer, limits).exec(
            decoupled=True)
    except triton_io.RequestError as exc:
        sender.send(triton_io.error_response(pb_utils, str(exc)), flags=final)
    except Exception as exc:  # a bug must answer this request, not kill the model
        sender.send(triton_io.error_response(pb_utils, f"preprocessing failed: {exc!r}", invalid_argument=False),
                    flags=final)
    return None


def serve(pb_utils: Any, request: Any, tokenizer: Any, limits: Limits,
          cancellation: triton_io.CancellationForwarder) -> None:
    """One client stream from request to its final response; every failure answers it."""
    final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    with STUB_CALLS:
        sender = request.get_response_sender()
        steps = _start(pb_utils, request, sender, tokenizer, limits)
    if steps is None:
        return
    sent_final = False
    try:
        while not sent_final:
            step = next(steps, None)  # waits for a3b_llm, outside the lock
            if step is None:
                break
            with STUB_CALLS:
                sent_final = _forward(pb_utils, request, sender, step, tokenizer, cancellation)
    except Exception as exc:
        with STUB_CALLS:
            sender.send(triton_io.error_response(pb_utils, f"postprocessing failed: {exc!r}",
                                                 invalid_argument=False), flags=final)
        sent_final = True
    finally:
        if not sent_final:
            with STUB_CALLS:
                sender.send(flags=final)

"""The BLS front model: preprocessing, a3b_llm and postprocessing in one decoupled model.

`ensemble` turns every engine step into a new Triton request to
`postprocessing` (the ensemble scheduler, a request, a round trip to that
stub). Here one stub prepares the request, streams a3b_llm's steps through a
BLS call and detokenizes each in-process, with the same functions and
contract as the three-model ensemble, so clients see the same responses.
It also sees its client's cancellation itself and forwards it to a3b_llm.

Triton 2.51's BLS response iterator blocks, so each stream is served on a
thread of its own (`serve`): its waits release the GIL.
"""
from __future__ import annotations

from typing import Any

from a3b_backend import contract, triton_io
from a3b_backend.postprocess import step_outputs
from a3b_backend.preprocess import prepare, prepared_arrays
from a3b_backend.request import Limits

INPUT_NAMES = contract.names(contract.TEXT_INPUTS)
LLM_OUTPUT_NAMES = list(contract.names(contract.LLM_OUTPUTS))


def llm_request(pb_utils: Any, tensors: dict, tokenizer: Any, limits: Limits) -> Any:
    """The a3b_llm request for a client request (RequestError when it is refused)."""
    arrays = prepared_arrays(prepare(tensors, tokenizer, limits))
    return pb_utils.InferenceRequest(model_name=contract.LLM_MODEL, requested_output_names=LLM_OUTPUT_NAMES,
                                     inputs=[pb_utils.Tensor(name, value) for name, value in arrays.items()])


def serve(pb_utils: Any, request: Any, tokenizer: Any, limits: Limits,
          cancellation: triton_io.CancellationForwarder) -> None:
    """One client stream from request to its final response; every failure answers it."""
    final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    sender = request.get_response_sender()
    try:
        upstream = llm_request(pb_utils, triton_io.read_inputs(request, INPUT_NAMES), tokenizer, limits)
    except triton_io.RequestError as exc:
        sender.send(triton_io.error_response(pb_utils, str(exc)), flags=final)
        return
    except Exception as exc:  # a bug must answer this request, not kill the model
        sender.send(triton_io.error_response(pb_utils, f"preprocessing failed: {exc!r}", invalid_argument=False),
                    flags=final)
        return
    sent_final = False
    try:
        for step in upstream.exec(decoupled=True):
            if step.has_error():  # a3b_llm's refusals and failures, with their codes
                sender.send(pb_utils.InferenceResponse(error=step.error()), flags=final)
                sent_final = True
                break
            tensors = {t.name(): t.as_numpy() for t in step.output_tensors()}
            if not tensors:  # a3b_llm's bare final flag
                continue
            cancellation.check(request, tensors)
            outputs = step_outputs(tensors, tokenizer)
            is_final = bool(triton_io.string_value(tensors, "finish_reason"))
            sender.send(triton_io.response(pb_utils, outputs), flags=final if is_final else 0)
            sent_final = is_final
    except Exception as exc:
        if not sent_final:
            sender.send(triton_io.error_response(pb_utils, f"postprocessing failed: {exc!r}", invalid_argument=False),
                        flags=final)
            sent_final = True
    finally:
        if not sent_final:
            sender.send(flags=final)

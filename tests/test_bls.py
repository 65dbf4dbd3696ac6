"""The BLS front model's stream loop (a3b_backend/bls.py) against a stand-in for
Triton's python-backend objects: what it asks a3b_llm and what its client gets.
The real model is served in tests/test_served_ensemble.py."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np

from a3b_backend import bls, contract
from a3b_backend.generation import Step, request_arrays, step_arrays
from a3b_backend.postprocess import step_outputs
from a3b_backend.request import Limits
from a3b_backend.triton_io import CancellationForwarder

FINAL = 1
LIMITS = Limits(max_model_len=256, default_max_tokens=16)


class _Tensor:
    def __init__(self, name, value):
        self._name, self._value = name, value

    def name(self):
        return self._name

    def as_numpy(self):
        return self._value


class _Response:
    def __init__(self, output_tensors=(), error=None):
        self._outputs, self._error = list(output_tensors), error

    def output_tensors(self):
        return self._outputs

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error


class _TritonError:
    INVALID_ARG, INTERNAL, UNAVAILABLE = 3, 13, 14

    def __init__(self, message, code):
        self._message, self._code = message, code

    def message(self):
        return self._message

    def code(self):
        return self._code


class _Sender:
    def __init__(self):
        self.sent: list[tuple[_Response | None, int]] = []

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))


class _ClientRequest:
    def __init__(self, inputs: dict):
        self._inputs, self.sender = [_Tensor(k, v) for k, v in inputs.items()], _Sender()

    def inputs(self):
        return self._inputs

    def get_response_sender(self):
        return self.sender

    def is_cancelled(self):
        return False


def _pb_utils(upstream: list[_Response], asked: list):
    class InferenceRequest:
        def __init__(self, model_name, requested_output_names, inputs):
            asked.append(SimpleNamespace(model=model_name, outputs=requested_output_names,
                                         inputs={t.name(): t.as_numpy() for t in inputs}))

        def exec(self, decoupled):
            assert decoupled
            return iter(upstream)

    return SimpleNamespace(
        InferenceRequest=InferenceRequest, Tensor=_Tensor, InferenceResponse=_Response,
        TritonError=_TritonError,
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL,
    )




def _client(prompt="Say hi.", **sampling):
    return _ClientRequest({"text_input": np.array([prompt.encode()], object),
                           "stream": np.array([True]),
                           "sampling_parameters": np.array([json.dumps(sampling).encode()], object)})


def _steps(tokenizer, text: str, request_id="r1") -> list[dict]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    per_request = request_arrays(json.dumps({"returns": {}}), request_id)
    return [step_arrays(Step(ids[k:k + 1], ids[max(0, k - 8):k], "length" if k == len(ids) - 1 else "", "",
                             math.nan, [], "", 3, k + 1), per_request) for k in range(len(ids))]


def _serve(tokenizer, client, upstream):
    asked = []
    pb_utils = _pb_utils(upstream, asked)
    bls.serve(pb_utils, client, tokenizer, LIMITS, CancellationForwarder(pb_utils))
    return asked, client.sender.sent


def test_a_stream_gets_what_the_ensemble_sends(tokenizer):
    steps = _steps(tokenizer, " Paris is big.")
    upstream = [_Response([_Tensor(k, v) for k, v in s.items()]) for s in steps]
    asked, sent = _serve(tokenizer, _client(max_tokens=8), upstream)
    [llm] = asked
    assert llm.model == contract.LLM_MODEL and llm.outputs == list(contract.names(contract.LLM_OUTPUTS))
    assert json.loads(llm.inputs["sampling_parameters"][0])["max_tokens"] == 8
    assert [flags for _, flags in sent] == [0] * (len(steps) - 1) + [FINAL]
    pieces = [{t.name(): t.as_numpy() for t in r.output_tensors()}["text_output"][0].decode() for r, _ in sent]
    assert pieces == [step_outputs(s, tokenizer)["text_output"][0].decode() for s in steps]
    assert "".join(pieces) == " Paris is big."


def test_an_aborted_generation_ends_with_a_bare_final_flag(tokenizer):
    steps = _steps(tokenizer, " Paris is big.")[:2]
    upstream = [_Response([_Tensor(k, v) for k, v in s.items()]) for s in steps] + [_Response()]
    _, sent = _serve(tokenizer, _client(), upstream)
    assert [flags for _, flags in sent] == [0, 0, FINAL] and sent[-1][0] is None


def test_a3b_llm_errors_reach_the_client_with_their_code(tokenizer):
    refusal = _TritonError("server shutting down", _TritonError.UNAVAILABLE)
    _, sent = _serve(tokenizer, _client(), [_Response(error=refusal)])
    [(response, flags)] = sent
    assert flags == FINAL and response.error() is refusal


def test_bad_input_is_refused_without_calling_a3b_llm(tokenizer):
    asked, sent = _serve(tokenizer, _client(temperature=-1), [])
    [(response, flags)] = sent
    assert not asked and flags == FINAL
    assert response.error().code() == _TritonError.INVALID_ARG and "'temperature' = -1" in response.error().message()

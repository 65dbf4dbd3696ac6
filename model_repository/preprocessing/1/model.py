"""preprocessing: text request (vllm_backend or TensorRT-LLM form) -> token ids + engine request."""
from a3b_backend import triton_io

triton_io.use_utf8_locale()

import triton_python_backend_utils as pb_utils  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from a3b_backend.contract import TEXT_INPUTS  # noqa: E402
from a3b_backend.preprocess import prepare, prepared_arrays  # noqa: E402
from a3b_backend.profiles import get_profile, request_limits  # noqa: E402
from a3b_backend.request import RequestError  # noqa: E402

INPUT_NAMES = tuple(t.name for t in TEXT_INPUTS)


class TritonPythonModel:
    def initialize(self, args):
        profile = get_profile()
        self.limits = request_limits(profile)
        self.tokenizer = AutoTokenizer.from_pretrained(profile.resolve_model_dir(triton_io.project_root(args)))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                tensors = triton_io.read_inputs(pb_utils, request, INPUT_NAMES)
                prepared = prepare(tensors, self.tokenizer, self.limits)
                responses.append(triton_io.response(pb_utils, prepared_arrays(prepared)))
            except RequestError as exc:
                responses.append(triton_io.error_response(pb_utils, str(exc)))
            except Exception as exc:  # a bug must answer this request, not kill the model
                responses.append(triton_io.error_response(pb_utils, f"preprocessing failed: {exc!r}", False))
        return responses

"""postprocessing: one a3b_llm step -> text (UTF-8 safe, stateless) and the requested fields."""
from a3b_backend import triton_io

triton_io.use_utf8_locale()

import triton_python_backend_utils as pb_utils  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from a3b_backend.contract import POSTPROCESS_INPUTS  # noqa: E402
from a3b_backend.postprocess import step_outputs  # noqa: E402
from a3b_backend.profiles import get_profile  # noqa: E402

INPUT_NAMES = tuple(t.name for t in POSTPROCESS_INPUTS)


class TritonPythonModel:
    def initialize(self, args):
        profile = get_profile()
        self.tokenizer = AutoTokenizer.from_pretrained(profile.resolve_model_dir(triton_io.project_root(args)))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                tensors = triton_io.read_inputs(pb_utils, request, INPUT_NAMES)
                responses.append(triton_io.response(pb_utils, step_outputs(tensors, self.tokenizer)))
            except Exception as exc:  # a bug must answer this request, not kill the model
                responses.append(triton_io.error_response(pb_utils, f"postprocessing failed: {exc!r}", False))
        return responses

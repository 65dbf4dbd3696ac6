"""preprocessing: text request (vllm_backend or TensorRT-LLM form) -> token ids + engine request."""
from a3b_backend import triton_io

triton_io.use_utf8_locale()

import triton_python_backend_utils as pb_utils  # noqa: E402

from a3b_backend.contract import TEXT_INPUTS, names  # noqa: E402
from a3b_backend.preprocess import prepare, prepared_arrays  # noqa: E402
from a3b_backend.profiles import get_profile, request_limits  # noqa: E402

INPUT_NAMES = names(TEXT_INPUTS)


class TritonPythonModel:
    def initialize(self, args):
        self.limits = request_limits(get_profile())
        self.tokenizer = triton_io.load_tokenizer(args)

    def execute(self, requests):
        return triton_io.respond_each(
            pb_utils, requests, INPUT_NAMES,
            lambda tensors: prepared_arrays(prepare(tensors, self.tokenizer, self.limits)), "preprocessing",
        )

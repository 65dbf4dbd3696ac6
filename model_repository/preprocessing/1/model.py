"""preprocessing: text request (vllm_backend or TensorRT-LLM form) -> token ids + engine request."""
from a3b_backend.serving import triton

triton.use_utf8_locale()

import triton_python_backend_utils as pb_utils  # noqa: E402

from a3b_backend.contract import TEXT_INPUTS, names  # noqa: E402
from a3b_backend.serving.preprocess import prepare, prepared_arrays  # noqa: E402
from a3b_backend.profiles import get_profile  # noqa: E402
from a3b_backend.serving.sampling import Limits  # noqa: E402

INPUT_NAMES = names(TEXT_INPUTS)


class TritonPythonModel:
    def initialize(self, args):
        self.limits = Limits.from_profile(get_profile())
        self.tokenizer = triton.load_tokenizer(args)

    def execute(self, requests):
        return triton.respond_each(
            pb_utils, requests, INPUT_NAMES,
            lambda tensors: prepared_arrays(prepare(tensors, self.tokenizer, self.limits)), "preprocessing",
        )

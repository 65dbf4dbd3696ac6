"""postprocessing: one a3b_llm step -> text (UTF-8 safe, stateless) and the requested fields."""
from a3b_backend import triton_io

triton_io.use_utf8_locale()

import triton_python_backend_utils as pb_utils  # noqa: E402

from a3b_backend.contract import POSTPROCESS_INPUTS, names  # noqa: E402
from a3b_backend.postprocess import step_outputs  # noqa: E402

INPUT_NAMES = names(POSTPROCESS_INPUTS)


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = triton_io.load_tokenizer(args)
        self.cancellation = triton_io.CancellationForwarder(pb_utils)

    def execute(self, requests):
        return triton_io.respond_each(
            pb_utils, requests, INPUT_NAMES, lambda tensors: step_outputs(tensors, self.tokenizer), "postprocessing",
            cancellation=self.cancellation,
        )

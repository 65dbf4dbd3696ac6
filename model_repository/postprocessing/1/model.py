"""postprocessing: one a3b_llm step -> text (UTF-8 safe, stateless) and the requested fields."""
from a3b_backend.serving import triton

triton.use_utf8_locale()

import triton_python_backend_utils as pb_utils  # noqa: E402

from a3b_backend.contract import POSTPROCESS_INPUTS, names  # noqa: E402
from a3b_backend.serving.postprocess import step_outputs  # noqa: E402

INPUT_NAMES = names(POSTPROCESS_INPUTS)


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = triton.load_tokenizer(args)
        self.cancellation = triton.CancellationForwarder(pb_utils)

    def execute(self, requests):
        return triton.respond_each(
            pb_utils, requests, INPUT_NAMES, lambda tensors: step_outputs(tensors, self.tokenizer), "postprocessing",
            cancellation=self.cancellation,
        )

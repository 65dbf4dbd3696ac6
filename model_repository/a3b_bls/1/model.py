"""a3b_bls: the ensemble's contract, calling a3b_llm by BLS so that a cancellation stops the engine at once."""
from a3b_backend.serving import triton

triton.use_utf8_locale()

import triton_python_backend_utils as pb_utils  # noqa: E402

from a3b_backend.profiles import get_profile  # noqa: E402
from a3b_backend.serving.bls import BlsPipeline  # noqa: E402
from a3b_backend.serving.sampling import Limits  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        self.pipeline = BlsPipeline(pb_utils, triton.load_tokenizer(args), Limits.from_profile(get_profile()))

    def execute(self, requests):
        for request in requests:
            self.pipeline.start(request)
        return None

    def finalize(self):
        self.pipeline.watch.close()

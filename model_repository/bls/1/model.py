"""bls: the ensemble's contract in one decoupled model (a3b_backend/bls.py): text in, a3b_llm via BLS, text out."""
from a3b_backend import triton_io

triton_io.use_utf8_locale()

import threading  # noqa: E402

import triton_python_backend_utils as pb_utils  # noqa: E402

from a3b_backend import bls  # noqa: E402
from a3b_backend.profiles import get_profile, request_limits  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        self.limits = request_limits(get_profile())
        self.tokenizer = triton_io.load_tokenizer(args)
        self.cancellation = triton_io.CancellationForwarder(pb_utils)

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=bls.serve, args=(pb_utils, request, self.tokenizer, self.limits,
                                                     self.cancellation), daemon=True).start()
        return None

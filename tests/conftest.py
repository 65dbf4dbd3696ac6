"""Shared fixtures. The served tests start ONE real tritonserver per session."""
from __future__ import annotations


import pytest

from a3b_backend.bench import server_process
from a3b_backend.profiles import PROJECT_ROOT

MODEL_DIR = PROJECT_ROOT / "models" / "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    if not (MODEL_DIR / "tokenizer.json").exists():
        pytest.fail(f"default model missing at {MODEL_DIR}: run `make model`")
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> server_process.Server:
    """The real tritonserver on ports of its own, so a running `make serve` is untouched."""
    try:
        srv = server_process.start(tmp_path_factory.mktemp("server") / "tritonserver.log")
    except RuntimeError as err:
        pytest.fail(str(err))
    yield srv
    srv.stop()

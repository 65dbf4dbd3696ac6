"""The `vllm.general_plugins` entry point: vLLM calls `register` in every one of
its processes (the EngineCore and its workers included) before it builds a model
or a message queue."""
from __future__ import annotations

from vllm.model_executor.layers.linear import register_weight_loader_v2_supported_method
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config

from a3b_backend.engine import busy_wait
from a3b_backend.engine.a3b_method import NAME, A3BLinearMethod, A3BQuantConfig


def register() -> None:
    """Bound vLLM's busy-wait where the profile asks, and make the "a3b" quantization method known."""
    busy_wait.bound_busy_wait()
    if NAME not in QUANTIZATION_METHODS:
        register_quantization_config(NAME)(A3BQuantConfig)
        register_weight_loader_v2_supported_method(A3BLinearMethod)

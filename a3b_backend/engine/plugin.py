"""The `vllm.general_plugins` entry point: vLLM calls `register` in every one of
its processes (the EngineCore and its workers included) before it builds a model
or a message queue."""
from __future__ import annotations

from vllm.model_executor.layers.linear import register_weight_loader_v2_supported_method
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config

from a3b_backend.engine import busy_wait
from a3b_backend.engine.a3b_method import NAME, A3BLinearMethod, A3BQuantConfig


def register() -> None:
    """Bound vLLM's busy-wait where the profile asks, make the "a3b" quantization method known, and
    let Qwen3.5/3.6's shared expert be replicated where a TP split would cut A3B blocks."""
    busy_wait.bound_busy_wait()
    if NAME not in QUANTIZATION_METHODS:
        register_quantization_config(NAME)(A3BQuantConfig)
        register_weight_loader_v2_supported_method(A3BLinearMethod)
        _replicate_misaligned_shared_experts()


def _replicate_misaligned_shared_experts() -> None:
    """vLLM's Qwen3-Next/3.5 MoE block replicates the shared expert (`disable_tp`) when a TP split
    would cut its quantization groups under expert or sequence parallelism, asking
    `get_quark_ocp_mx_group_size` for the group, which knows Quark's alone: it answers A3B's
    block columns for an A3B checkpoint. At TP 8, the shared expert's down_proj would get 512 / 8
    = 64 input columns of 128-column blocks (engine/partition.py)."""
    from vllm.model_executor.models import qwen3_next

    vllm_group_size = qwen3_next.get_quark_ocp_mx_group_size

    def group_size(quant_config, layer_name: str):
        if isinstance(quant_config, A3BQuantConfig):
            return quant_config.block[1]
        return vllm_group_size(quant_config, layer_name)

    qwen3_next.get_quark_ocp_mx_group_size = group_size

"""What an engine's model holds and runs, read inside vLLM's worker through
`LLM.apply_model` (the benchmarks' probes; the served path never calls them)."""
from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import LinearBase


def linear_weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes the linear layers' parameters occupy in this process, and their weights' element count
    (run in the engine's worker through LLM.apply_model)."""
    resident = elements = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            resident += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
            elements += module.input_size * module.output_size
    return {"resident": resident, "elements": elements}


def linear_kernels(model: torch.nn.Module) -> list[str]:
    """The kernels the linear layers run (through LLM.apply_model in the engine's worker): ours, or
    which of vLLM's two CPU kernels its mixed-precision layers picked at load."""
    kernels = set()
    for module in model.modules():
        if getattr(module, "a3b", None) is not None:
            kernels.add("A3B plugin")
        elif hasattr(module, "use_w4a8"):
            kernels.add("int4_scaled_mm_cpu (W4A8)" if module.use_w4a8 else f"cpu_gemm_wna16 ({module.isa_hint})")
    return sorted(kernels) or ["vLLM's bf16 GEMM"]

"""A3B linear on the CPU through the C++ kernel in a3b_cpu.cpp (built by torch's
extension tooling on first use, cached under ~/.cache/torch_extensions).

Two strategies keep the weight packed in memory (docs/a3b_format.md):
  fused    codes read in place by `a3b_linear` for up to FUSED_MAX_ROWS rows of
           x (decode), one dequantize + float32 GEMM above that (prefill);
  dequant  dequantize the whole weight on every call, then the GEMM.
perf/a3b_cpu_linear.py measures both; the figures chose the default.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("a3b_cpu.cpp")
STRATEGIES = ("fused", "dequant")
FUSED_MAX_ROWS = 8


@functools.cache
def ops():
    from torch.utils.cpp_extension import load

    return load(name="a3b_cpu", sources=[str(SOURCE)], extra_cflags=["-O3", "-march=native", "-fopenmp-simd"])


def dequantize(t: dict[str, torch.Tensor], in_features: int, block: tuple[int, int]) -> torch.Tensor:
    """float32 W[out, in] from the packed tensors (keys as in A3BWeight)."""
    return ops().a3b_dequantize(t["packed"], t["lo"], t["step"], t["delta"], t["lo_scale"], t["step_scale"],
                                in_features, *block)


def linear(x: torch.Tensor, t: dict[str, torch.Tensor], in_features: int, block: tuple[int, int],
           strategy: str = "fused") -> torch.Tensor:
    """float32 y[M, out] = x[M, in] @ W^T."""
    if strategy == "fused" and x.shape[0] <= FUSED_MAX_ROWS:
        return ops().a3b_linear(x, t["packed"], t["lo"], t["step"], t["delta"], t["lo_scale"], t["step_scale"],
                                *block)
    return torch.nn.functional.linear(x.float(), dequantize(t, in_features, block))

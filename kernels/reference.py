"""Torch references the Triton and CUDA kernels are checked against."""
from __future__ import annotations

import torch

from a3b_backend.quant.format import A3BConfig, A3BWeight, dequantize


def a3b_matmul(x: torch.Tensor, q: A3BWeight, config: A3BConfig) -> torch.Tensor:
    """float32 y[M, N] = x[M, K] @ W^T, W dequantized by the format's own reference."""
    return x.float() @ dequantize(q, config).T

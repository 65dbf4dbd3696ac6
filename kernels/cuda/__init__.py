"""CUDA C++ A3B kernels, built on first use with torch's extension tooling
(needs torch with CUDA; `nvcc -arch=sm_90a -c` compile-checks the sources
anywhere, see tests/test_kernels_cuda.py)."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from a3b_backend.quant.format import A3BConfig, A3BWeight

HERE = Path(__file__).parent
SOURCES = [HERE / "a3b_ops.cpp", HERE / "a3b_gemv.cu"]


@functools.cache
def ops():
    if not torch.cuda.is_available():
        raise RuntimeError("the CUDA A3B kernels need torch with CUDA and a GPU")
    from torch.utils.cpp_extension import load

    return load(name="a3b_cuda", sources=[str(s) for s in SOURCES], extra_cuda_cflags=["-O3"])


def a3b_gemv(x: torch.Tensor, q: A3BWeight, config: A3BConfig) -> torch.Tensor:
    """float32 y[M, N] for M <= 16 rows of bf16 x."""
    return ops().a3b_gemv(x, q.packed, q.lo, q.step, q.delta, q.lo_scale, q.step_scale, config.block_cols)

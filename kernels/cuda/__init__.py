"""CUDA C++ A3B kernels, built on first use with torch's extension tooling
(needs torch with CUDA; `nvcc -arch=sm_90a -c` compile-checks the sources
anywhere, see tests/test_kernels_cuda.py)."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from a3b_backend.quant.format import A3BConfig, A3BWeight, ceil_div
from a3b_kernels.kv_cache import PagedA3B, merge_splits, rotate
from a3b_kernels.occupancy import splits_to_fill

HERE = Path(__file__).parent
SOURCES = [HERE / "a3b_ops.cpp", HERE / "a3b_gemv.cu", HERE / "a3b_paged_attention.cu"]


@functools.cache
def ops():
    if not torch.cuda.is_available():
        raise RuntimeError("the CUDA A3B kernels need torch with CUDA and a GPU")
    from torch.utils.cpp_extension import load

    return load(name="a3b_cuda", sources=[str(s) for s in SOURCES], extra_cuda_cflags=["-O3"])


def a3b_gemv(x: torch.Tensor, q: A3BWeight, config: A3BConfig) -> torch.Tensor:
    """float32 y[M, N] for M <= 16 rows of bf16 x."""
    return ops().a3b_gemv(x, *q.kernel_tensors(), config.block_cols)


def paged_decode_attention(q: torch.Tensor, k: PagedA3B, v: PagedA3B, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float | None = None,
                           pages_per_split: int | None = None) -> torch.Tensor:
    """float32 out[batch, heads, head_dim]; same contract as the Triton kernel."""
    batch, heads, dim = q.shape
    kv_heads = k.codes.shape[2]
    if pages_per_split is None:  # as many splits as the Triton kernel takes
        splits = splits_to_fill(batch * kv_heads, block_tables.shape[1], per_sm=4)
        pages_per_split = ceil_div(block_tables.shape[1], splits)
    m, l, acc = ops().a3b_paged_decode(rotate(q), k.codes, k.meta, v.codes, v.meta, block_tables, seq_lens,
                                       pages_per_split, dim ** -0.5 if scale is None else scale)
    return rotate(merge_splits(m, l, acc).reshape(batch, heads, dim))

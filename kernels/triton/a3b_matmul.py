"""A3B weight-only matmul in the Triton language: y[M, N] = x[M, K] @ W^T with
W read as packed 4-bit codes (two per byte, low nibble = even column) and
per-block (1 x BLOCK_COLS) metadata, dequantized in registers:
w = lo + (code >> 1) * step + (code & 1 ? +d : -d), the 16-entry table of
docs/a3b_format.md computed rather than gathered.

Even and odd columns are handled as two half-width tiles (one per nibble), so
the codes are never interleaved in registers: acc += x_even @ w_even^T +
x_odd @ w_odd^T. Decode (M = 1..16) and prefill use the same kernel; M is
tiled by BLOCK_M >= 16 for tl.dot (fp32 for decode, fp16 tensor cores with
fp32 accumulation for prefill).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from a3b_backend.quant.format import A3BConfig, A3BWeight
from a3b_kernels.occupancy import splits_to_fill

DECODE_ROWS = 16  # up to this many rows a call is bound by reading the weight
FP16_MAX = tl.constexpr(65504.0)


@triton.jit
def table_value(code, lo, step, d):
    """Table entries of 4-bit codes (int32): lo + (code >> 1) * step, plus d
    when the sign bit (code & 1) is set, else minus d."""
    return lo + (code >> 1).to(tl.float32) * step + ((code & 1) * 2 - 1).to(tl.float32) * d


@triton.jit
def dequant_tile(packed_ptr, lo_ptr, step_ptr, delta_ptr, lo_scale, step_scale, cols, col_ok, kb, K, n_kblocks,
                 GROUP: tl.constexpr):
    """Block kb of rows `cols` as two float32 [BLOCK_N, GROUP/2] tiles: even and odd
    columns. The pointers are one weight's (an expert's) tensors; lo_scale and
    step_scale the rows' already loaded bf16 row scales."""
    half = tl.arange(0, GROUP // 2)
    k_even = kb * GROUP + 2 * half
    meta = cols * n_kblocks + kb
    lo = tl.load(lo_ptr + meta, mask=col_ok, other=0).to(tl.float32) * lo_scale
    step = tl.load(step_ptr + meta, mask=col_ok, other=0).to(tl.float32) * step_scale
    d = step * tl.load(delta_ptr + meta, mask=col_ok, other=0).to(tl.float32) / 255.0
    byte = tl.load(packed_ptr + cols[:, None] * ((K + 1) // 2) + (k_even // 2)[None, :],
                   mask=col_ok[:, None] & (k_even < K)[None, :], other=0).to(tl.int32)
    return (table_value(byte & 0xF, lo[:, None], step[:, None], d[:, None]),
            table_value(byte >> 4, lo[:, None], step[:, None], d[:, None]))


@triton.jit
def a3b_accumulate(x_ptr, x_rows, row_ok, packed_ptr, lo_ptr, step_ptr, delta_ptr, lo_scale_ptr, step_scale_ptr,
                   cols, col_ok, K, n_kblocks, kb_start, kb_end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   GROUP: tl.constexpr, DOT_FP16: tl.constexpr):
    """float32 [BLOCK_M, BLOCK_N] = x[x_rows, :] @ W[cols, :]^T over K blocks kb_start..kb_end-1.
    DOT_FP16: x and the dequantized tile go to the tensor cores as fp16 (x
    clamped to fp16's range), fp32 accumulation; otherwise an fp32 dot. fp16
    rather than bf16: more mantissa for the table values, and Triton's
    interpreter, which CI runs these kernels in, computes bf16 dots wrongly."""
    half = tl.arange(0, GROUP // 2)
    lo_scale = tl.load(lo_scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    step_scale = tl.load(step_scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_start, kb_end):
        w_even, w_odd = dequant_tile(packed_ptr, lo_ptr, step_ptr, delta_ptr, lo_scale, step_scale, cols, col_ok,
                                     kb, K, n_kblocks, GROUP)
        k_even = kb * GROUP + 2 * half
        x_even = tl.load(x_ptr + x_rows[:, None] * K + k_even[None, :],
                         mask=row_ok[:, None] & (k_even < K)[None, :], other=0.0).to(tl.float32)
        x_odd = tl.load(x_ptr + x_rows[:, None] * K + (k_even + 1)[None, :],
                        mask=row_ok[:, None] & (k_even + 1 < K)[None, :], other=0.0).to(tl.float32)
        if DOT_FP16:
            x_even = tl.clamp(x_even, -FP16_MAX, FP16_MAX).to(tl.float16)
            x_odd = tl.clamp(x_odd, -FP16_MAX, FP16_MAX).to(tl.float16)
            acc += tl.dot(x_even, tl.trans(w_even.to(tl.float16)))
            acc += tl.dot(x_odd, tl.trans(w_odd.to(tl.float16)))
        else:
            acc += tl.dot(x_even, tl.trans(w_even), input_precision="ieee")
            acc += tl.dot(x_odd, tl.trans(w_odd), input_precision="ieee")
    return acc


@triton.jit
def _a3b_matmul_kernel(x_ptr, packed_ptr, lo_ptr, step_ptr, delta_ptr, lo_scale_ptr, step_scale_ptr, y_ptr,
                       M, N, K, n_kblocks,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, SPLIT_K: tl.constexpr,
                       DOT_FP16: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    per_split = tl.cdiv(n_kblocks, SPLIT_K)
    kb_start = tl.program_id(2) * per_split
    kb_end = tl.minimum(kb_start + per_split, n_kblocks)
    acc = a3b_accumulate(x_ptr, rows, row_ok, packed_ptr, lo_ptr, step_ptr, delta_ptr, lo_scale_ptr,
                         step_scale_ptr, cols, col_ok, K, n_kblocks, kb_start, kb_end, BLOCK_M, BLOCK_N, GROUP,
                         DOT_FP16)
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc, mask=mask)
    else:
        tl.atomic_add(y_ptr + rows[:, None] * N + cols[None, :], acc, mask=mask)


def a3b_matmul(x: torch.Tensor, q: A3BWeight, config: A3BConfig, out: torch.Tensor | None = None,
               block_m: int = 16, block_n: int = 32, split_k: int | None = None,
               dot_fp16: bool | None = None) -> torch.Tensor:
    """float32 y[M, N] (into `out` when given). Needs 1 x C blocks (the format's
    default), C a power of two. Decode-sized calls (M <= 16) are bound by
    reading the weight: by default they split K over more programs (partial
    sums added atomically) and keep an fp32 dot. Larger M is bound by compute:
    the dequantized tiles go through fp16 tensor-core dots. `split_k` and
    `dot_fp16` override."""
    if config.block_rows != 1:
        raise ValueError(f"the Triton A3B kernel reads 1xC blocks, not {config.block_rows}x{config.block_cols}")
    N, K = q.shape.tolist()
    M = x.shape[0]
    n_kblocks = q.lo.shape[1]
    x = x.contiguous()
    grid_mn = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    if split_k is None:
        split_k = splits_to_fill(grid_mn[0] * grid_mn[1], n_kblocks, per_sm=2) if M <= DECODE_ROWS else 1
    if dot_fp16 is None:
        dot_fp16 = M > DECODE_ROWS
    y = torch.empty(M, N, dtype=torch.float32, device=x.device) if out is None else out
    if split_k > 1:
        y.zero_()
    _a3b_matmul_kernel[(*grid_mn, split_k)](x, *q.kernel_tensors(), y,
                                            M, N, K, n_kblocks, BLOCK_M=block_m, BLOCK_N=block_n,
                                            GROUP=config.block_cols, SPLIT_K=split_k, DOT_FP16=dot_fp16)
    return y

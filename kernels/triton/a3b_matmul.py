"""A3B weight-only matmul in the Triton language: y[M, N] = x[M, K] @ W^T with
W read as packed 4-bit codes (two per byte, low nibble = even column) and
per-block (1 x BLOCK_COLS) metadata, dequantized in registers:
w = lo + (code >> 1) * step + (code & 1 ? +d : -d), the 16-entry table of
docs/a3b_format.md computed rather than gathered (`nibble_values`).

Even and odd columns are handled as two half-width tiles (one per nibble), so
the codes are never interleaved in registers: acc += x_even @ w_even^T +
x_odd @ w_odd^T. One row of x (BLOCK_M = 1, a decode step of one sequence)
multiplies the float32 table values on the CUDA cores and reduces once at the
end; more rows go through fp16 tensor-core dots (BLOCK_M >= 16, x clamped to
fp16's range) with fp32 accumulation. Both read the codes and x in 16-byte
vectors: row strides are passed as arguments so Triton sees that they divide
by 16.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from a3b_backend.quant.format import A3BConfig, A3BWeight
from a3b_kernels.occupancy import splits_to_fill

DECODE_ROWS = 16  # up to this many rows a call is bound by reading the weight
FP16_MAX = tl.constexpr(65504.0)
FLOAT_2_23 = tl.constexpr(0x4B000000)  # the bits of float32 2**23: its mantissa's last bit is worth 1


@dataclasses.dataclass(frozen=True)
class Launch:
    """Tiles and occupancy of one a3b_matmul launch. per_sm: K is split until
    the launch has about this many programs per SM (0: K is not split, for
    calls with enough output tiles of their own)."""
    block_m: int
    block_n: int
    per_sm: int = 2
    num_warps: int = 4
    num_stages: int = 3


def launch_for(m: int) -> Launch:
    """The launch a call with m rows of x gets by default."""
    if m == 1:
        return Launch(1, 64)
    return Launch(16, 64) if m <= DECODE_ROWS else Launch(64, 64, per_sm=0)


@triton.jit
def exact_float(bits):
    """float32 of int32 values in [0, 2**23) without an int-to-float conversion
    (a quarter-rate instruction): the bits go into the mantissa of 2**23, then
    2**23 is subtracted, exactly."""
    return (bits | FLOAT_2_23).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def nibble_values(byte, lo, step, d):
    """Table values of both nibbles of int32 `byte`s: (low = even column, high
    = odd column). lo + (code >> 1) * step + (2 * (code & 1) - 1) * d is
    (lo - d) + code * step / 2 + (code & 1) * (2 d - step / 2); the high
    nibble is read in place, 16 times larger, so each value costs two masks,
    two subtractions and two multiply-adds."""
    a = lo - d
    b = step * 0.5
    c = 2.0 * d - b
    even = a + exact_float(byte & 0xF) * b + exact_float(byte & 0x1) * c
    odd = a + exact_float(byte & 0xF0) * (b * 0.0625) + exact_float(byte & 0x10) * (c * 0.0625)
    return even, odd


@triton.jit
def a3b_accumulate(x_ptr, x_rows, row_ok, packed_ptr, code_stride, row_bytes, lo_ptr, step_ptr, delta_ptr,
                   lo_scale_ptr, step_scale_ptr, cols, col_ok, K, n_kblocks, kb_start, kb_end,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """float32 [BLOCK_M, BLOCK_N] = x[x_rows, :] @ W[cols, :]^T over K blocks
    kb_start..kb_end-1 (x rows K apart, W rows code_stride bytes apart, the
    first row_bytes of each holding codes). The pointers are one weight's (an
    expert's) tensors."""
    half = tl.arange(0, GROUP // 2)
    k = tl.arange(0, GROUP)
    lo_scale = tl.load(lo_scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    step_scale = tl.load(step_scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if BLOCK_M == 1:
        partial = tl.zeros((BLOCK_N, GROUP // 2), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_start, kb_end):
        meta = cols * n_kblocks + kb
        lo = tl.load(lo_ptr + meta, mask=col_ok, other=0).to(tl.float32) * lo_scale
        step = tl.load(step_ptr + meta, mask=col_ok, other=0).to(tl.float32) * step_scale
        d = step * tl.load(delta_ptr + meta, mask=col_ok, other=0).to(tl.float32) / 255.0
        byte_at = kb * (GROUP // 2) + half
        byte = tl.load(packed_ptr + cols[:, None] * code_stride + byte_at[None, :],
                       mask=col_ok[:, None] & (byte_at < row_bytes)[None, :], other=0).to(tl.int32)
        w_even, w_odd = nibble_values(byte, lo[:, None], step[:, None], d[:, None])
        k_at = kb * GROUP + k
        x = tl.load(x_ptr + x_rows[:, None] * K + k_at[None, :], mask=row_ok[:, None] & (k_at < K)[None, :],
                    other=0.0).to(tl.float32)
        if BLOCK_M == 1:
            x_even, x_odd = tl.split(tl.reshape(x, (1, GROUP // 2, 2)))
            partial += w_even * x_even + w_odd * x_odd
        else:
            x = tl.clamp(x, -FP16_MAX, FP16_MAX).to(tl.float16)
            x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, GROUP // 2, 2)))
            acc += tl.dot(x_even, tl.trans(w_even.to(tl.float16)))
            acc += tl.dot(x_odd, tl.trans(w_odd.to(tl.float16)))
    if BLOCK_M == 1:
        acc = tl.sum(partial, axis=1)[None, :]
    return acc


@triton.jit
def _a3b_matmul_kernel(x_ptr, packed_ptr, code_stride, row_bytes, lo_ptr, step_ptr, delta_ptr, lo_scale_ptr,
                       step_scale_ptr, y_ptr, M, N, K, n_kblocks,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, SPLIT_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    per_split = tl.cdiv(n_kblocks, SPLIT_K)
    kb_start = tl.program_id(2) * per_split
    kb_end = tl.minimum(kb_start + per_split, n_kblocks)
    acc = a3b_accumulate(x_ptr, rows, row_ok, packed_ptr, code_stride, row_bytes, lo_ptr, step_ptr, delta_ptr,
                         lo_scale_ptr, step_scale_ptr, cols, col_ok, K, n_kblocks, kb_start, kb_end, BLOCK_M,
                         BLOCK_N, GROUP)
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc, mask=mask)
    else:
        tl.atomic_add(y_ptr + rows[:, None] * N + cols[None, :], acc, mask=mask)


def code_args(q: A3BWeight) -> tuple:
    """The codes as the kernels take them: packed, its row stride and the bytes of codes per row."""
    return q.packed, q.packed.stride(-2), q.packed.shape[-1]


def a3b_matmul(x: torch.Tensor, q: A3BWeight, config: A3BConfig, out: torch.Tensor | None = None,
               launch: Launch | None = None, split_k: int | None = None) -> torch.Tensor:
    """float32 y[M, N] (into `out` when given). Needs 1 x C blocks (the format's
    default), C a power of two. Decode-sized calls (M <= 16) are bound by
    reading the weight: they split K over more programs (partial sums added
    atomically) until the GPU is full. `launch` (default `launch_for(M)`) and
    `split_k` override."""
    if config.block_rows != 1:
        raise ValueError(f"the Triton A3B kernel reads 1xC blocks, not {config.block_rows}x{config.block_cols}")
    N, K = q.shape.tolist()
    M = x.shape[0]
    launch = launch or launch_for(M)
    n_kblocks = q.lo.shape[1]
    x = x.contiguous()
    grid_mn = (triton.cdiv(M, launch.block_m), triton.cdiv(N, launch.block_n))
    if split_k is None:
        split_k = splits_to_fill(grid_mn[0] * grid_mn[1], n_kblocks, launch.per_sm) if launch.per_sm else 1
    y = torch.empty(M, N, dtype=torch.float32, device=x.device) if out is None else out
    if split_k > 1:
        y.zero_()
    _, lo, step, delta, lo_scale, step_scale = q.kernel_tensors()
    _a3b_matmul_kernel[(*grid_mn, split_k)](x, *code_args(q), lo, step, delta, lo_scale, step_scale, y,
                                            M, N, K, n_kblocks, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
                                            GROUP=config.block_cols, SPLIT_K=split_k,
                                            num_warps=launch.num_warps, num_stages=launch.num_stages)
    return y

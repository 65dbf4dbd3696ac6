"""A3B weight-only matmul in the Triton language: y[M, N] = x[M, K] @ W^T with
W read as packed 4-bit codes (two per byte, low nibble = even column) and
per-block (1 x BLOCK_COLS) metadata, dequantized in registers:
w = lo + (code >> 1) * step + (code & 1 ? +d : -d), the 16-entry table of
docs/a3b_format.md computed rather than gathered (`word_values`).

The codes are read as 32-bit words of 8 and each code position j of a word is
its own tile (columns 8i + j), so the codes are never interleaved in
registers: acc += sum_j x_j @ w_j^T. One row of x (BLOCK_M = 1, a decode step
of one sequence) multiplies the float32 table values on the CUDA cores and
reduces once at the end; more rows go through fp16 tensor-core dots (BLOCK_M
>= 16, x clamped to fp16's range) with fp32 accumulation. Both read the codes
and x in 16-byte vectors: row strides are passed as arguments so Triton sees
that they divide by 16.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from a3b_backend.quant.format import A3BConfig, A3BWeight
from a3b_kernels.occupancy import splits_to_fill
from a3b_kernels.triton.a3b_gemv import a3b_gemv
from a3b_kernels.triton.codes import block_table, code_args, split8

DECODE_ROWS = 16  # up to this many rows a call is bound by reading the weight
FP16_MAX = tl.constexpr(65504.0)
FLOAT_ONE = tl.constexpr(0x3F800000)  # the bits of float32 1.0


@dataclasses.dataclass(frozen=True)
class Launch:
    """Tiles and occupancy of one a3b_matmul launch. per_sm: K is split until
    the launch has about this many programs per SM (None: K is not split, for
    calls with enough output tiles of their own)."""
    block_m: int
    block_n: int
    per_sm: int | None = 2
    num_warps: int = 4
    num_stages: int = 3


def launch_for(m: int) -> Launch:
    """The launch a call with m rows of x gets by default: for decode, the
    fastest on 2048x2048 and 8192x8192 together in `make bench-gpu`'s launch
    sweep on an H200 (perf/results/gpu/gpu_kernels.json)."""
    if m == 1:
        return Launch(1, 128, per_sm=8)
    return Launch(16, 64, per_sm=8) if m <= DECODE_ROWS else Launch(64, 64, per_sm=None)


@triton.jit
def code_value(shifted, base, code_scale, bit_scale):
    """The table value of the code in bits 16..19 of `shifted`, as a + code * b
    + (code & 1) * c (see `table_terms`): the masked bits OR-ed into the bits of
    1.0 make 1 + code / 128, so with the scales multiplied by 128 and their 1.0s
    folded into `base` each term is one mask and one multiply-add (no
    int-to-float conversion, a quarter-rate instruction), within about 2**-14
    of a step (float32 roundings of terms up to ~260 steps). Every code sits at
    the same bit, so one pair of masks serves them all."""
    code = ((shifted & 0xF0000) | FLOAT_ONE).to(tl.float32, bitcast=True)
    bit = ((shifted & 0x10000) | FLOAT_ONE).to(tl.float32, bitcast=True)
    return base + code * code_scale + bit * bit_scale


@triton.jit
def table_terms(lo, step, d):
    """lo + (code >> 1) * step + (2 * (code & 1) - 1) * d is a + code * b +
    (code & 1) * c with a = lo - d, b = step / 2, c = 2 d - step / 2: returns
    `code_value`'s (base, code_scale, bit_scale)."""
    b = step * 64.0
    c = 256.0 * d - b
    return lo - d - b - c, b, c


@triton.jit
def nibble_values(byte, lo, step, d):
    """Table values of both nibbles of int32 `byte`s: (low = even column, high = odd column)."""
    base, b, c = table_terms(lo, step, d)
    return code_value(byte << 16, base, b, c), code_value(byte << 12, base, b, c)


@triton.jit
def word_values(word, lo, step, d):
    """Table values of the 8 codes of uint32 `word`s (code j in bits 4j..4j+3,
    column 8i + j of word i), as 8 tiles in column order."""
    base, b, c = table_terms(lo, step, d)
    return (code_value(word << 16, base, b, c), code_value(word << 12, base, b, c),
            code_value(word << 8, base, b, c), code_value(word << 4, base, b, c),
            code_value(word, base, b, c), code_value(word >> 4, base, b, c),
            code_value(word >> 8, base, b, c), code_value(word >> 12, base, b, c))


@triton.jit
def a3b_accumulate(x_ptr, x_rows, row_ok, words_ptr, word_stride, row_words, lo_ptr, step_ptr, delta_ptr,
                   lo_scale_ptr, step_scale_ptr, cols, col_ok, K, n_kblocks, kb_start, kb_end,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """float32 [BLOCK_M, BLOCK_N] = x[x_rows, :] @ W[cols, :]^T over K blocks
    kb_start..kb_end-1 (x rows K apart; W's codes as uint32 words, rows
    word_stride apart, the first row_words of each holding codes). The
    pointers are one weight's (an expert's) tensors."""
    w_at = tl.arange(0, GROUP // 8)
    k = tl.arange(0, GROUP)
    lo_scale = tl.load(lo_scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    step_scale = tl.load(step_scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if BLOCK_M == 1:
        partial = tl.zeros((BLOCK_N, GROUP // 8), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_start, kb_end):
        lo, step, d = block_table(lo_ptr, step_ptr, delta_ptr, cols * n_kblocks + kb, col_ok, lo_scale, step_scale)
        word_at = kb * (GROUP // 8) + w_at
        word = tl.load(words_ptr + cols[:, None] * word_stride + word_at[None, :],
                       mask=col_ok[:, None] & (word_at < row_words)[None, :], other=0).to(tl.uint32, bitcast=True)
        w = word_values(word, lo[:, None], step[:, None], d[:, None])
        k_at = kb * GROUP + k
        x = tl.load(x_ptr + x_rows[:, None] * K + k_at[None, :], mask=row_ok[:, None] & (k_at < K)[None, :],
                    other=0.0).to(tl.float32)
        if BLOCK_M == 1:
            xs = split8(x, 1, GROUP)
            partial += (w[0] * xs[0] + w[1] * xs[1] + w[2] * xs[2] + w[3] * xs[3] + w[4] * xs[4] + w[5] * xs[5]
                        + w[6] * xs[6] + w[7] * xs[7])
        else:
            xs = split8(tl.clamp(x, -FP16_MAX, FP16_MAX).to(tl.float16), BLOCK_M, GROUP)
            for j in tl.static_range(8):
                acc += tl.dot(xs[j], tl.trans(w[j].to(tl.float16)))
    if BLOCK_M == 1:
        acc = tl.sum(partial, axis=1)[None, :]
    return acc


@triton.jit
def _a3b_matmul_kernel(x_ptr, words_ptr, word_stride, row_words, lo_ptr, step_ptr, delta_ptr, lo_scale_ptr,
                       step_scale_ptr, y_ptr, M, N, K, n_kblocks,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, SPLIT_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    per_split = tl.cdiv(n_kblocks, SPLIT_K)
    kb_start = tl.program_id(2) * per_split
    kb_end = tl.minimum(kb_start + per_split, n_kblocks)
    acc = a3b_accumulate(x_ptr, rows, row_ok, words_ptr, word_stride, row_words, lo_ptr, step_ptr, delta_ptr,
                         lo_scale_ptr, step_scale_ptr, cols, col_ok, K, n_kblocks, kb_start, kb_end, BLOCK_M,
                         BLOCK_N, GROUP)
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc, mask=mask)
    else:
        tl.atomic_add(y_ptr + rows[:, None] * N + cols[None, :], acc, mask=mask)


def a3b_matmul(x: torch.Tensor, q: A3BWeight, config: A3BConfig, out: torch.Tensor | None = None,
               launch: Launch | None = None, split_k: int | None = None) -> torch.Tensor:
    """float32 y[M, N] (into `out` when given). Needs 1 x C blocks (the format's
    default), C a power of two. Decode-sized calls (M <= 16) are bound by
    reading the weight: they split K over more programs (partial sums added
    atomically) until the GPU is full. One row of x goes to the decode GEMV
    without a table (a3b_gemv.py) unless a `launch` is given; `launch` (default
    `launch_for(M)`) and `split_k` override."""
    if config.block_rows != 1:
        raise ValueError(f"the Triton A3B kernel reads 1xC blocks, not {config.block_rows}x{config.block_cols}")
    # from shapes, never from q.shape's values: no host read (FakeTensorMode, CUDA graphs)
    M, K = x.shape
    if M == 1 and launch is None:
        return a3b_gemv(x, q, config, out, split_k)
    N = q.packed.shape[0]
    launch = launch or launch_for(M)
    n_kblocks = q.lo.shape[1]
    x = x.contiguous()
    grid_mn = (triton.cdiv(M, launch.block_m), triton.cdiv(N, launch.block_n))
    if split_k is None:
        split_k = 1 if launch.per_sm is None else splits_to_fill(grid_mn[0] * grid_mn[1], n_kblocks, launch.per_sm)
    y = torch.empty(M, N, dtype=torch.float32, device=x.device) if out is None else out
    if split_k > 1:
        y.zero_()
    _, lo, step, delta, lo_scale, step_scale = q.kernel_tensors()
    _a3b_matmul_kernel[(*grid_mn, split_k)](x, *code_args(q), lo, step, delta, lo_scale, step_scale, y,
                                            M, N, K, n_kblocks, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
                                            GROUP=config.block_cols, SPLIT_K=split_k,
                                            num_warps=launch.num_warps, num_stages=launch.num_stages)
    return y

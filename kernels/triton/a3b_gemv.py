"""A3B decode GEMV without a table (one row of x, a decode step of one sequence), in the Triton
language: y[N] = x[K] @ W^T.

A code c = 2k + s (docs/a3b_format.md) is worth lo + k * step + (2s - 1) * d, which is
alpha + beta * c + gamma * s with alpha = lo - d, beta = step / 2, gamma = 2d - step / 2
(kernels/README.md, "The design the GEMV follows"). So over one 1 x GROUP block, with x the
block's columns:

    sum_j x_j w_j = alpha * sum(x) + beta * sum(x * c) + gamma * sum(x * s)

Per weight: its nibble moved to the top of a float's mantissa by one shift, then two masks OR-ed
into the bits of 1.0 give 1 + c / 16 and 1 + s / 16 (no int-to-float conversion), and two
multiply-adds into the sums; the block's three scalars (the 1.0s folded into the first: `base`)
are applied once per 8 weights. Each program owns BLOCK_N rows and a range of K blocks (split-K
into one wave of BLOCKS_PER_SM programs an SM); a thread's codes come 4 consecutive 32-bit words of
a row at a time (16-byte loads), and its x values serve every row it owns.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from a3b_backend.quant.format import A3BConfig, A3BWeight
from a3b_kernels.occupancy import whole_wave_splits
from a3b_kernels.triton.codes import block_table, code_args, split8

BLOCK_N = 64
# Programs an SM holds at once: 80 registers a thread at 4 warps on sm_90a under Triton 3.6 (make
# kernel-report, which flags a build whose registers give another count)
BLOCKS_PER_SM = 6
# Passed to the kernel as arguments, not constants, so they sit in registers: a LOP3 takes one
# immediate, and (top & mask) | one with both as immediates takes two LOP3s
FLOAT_ONE = 0x3F800000  # the bits of float32 1.0
NIBBLE_AT_TOP = 0x780000  # mantissa bits 19..22: a nibble there is worth c / 16 over 1.0
BIT_AT_TOP = 0x080000  # the nibble's low bit there is worth s / 16


@triton.jit
def code_and_bit(word, J: tl.constexpr, nibble_mask, bit_mask, one):
    """(1 + c / 16, 1 + s / 16) of code J of 32-bit `word`s (bits 4J..4J+3)."""
    if 4 * J <= 19:
        top = word << (19 - 4 * J)
    else:
        top = word >> (4 * J - 19)
    code = ((top & nibble_mask) | one).to(tl.float32, bitcast=True)
    bit = ((top & bit_mask) | one).to(tl.float32, bitcast=True)
    return code, bit


@triton.jit
def _a3b_gemv_kernel(x_ptr, words_ptr, word_stride, row_words, lo_ptr, step_ptr, delta_ptr, lo_scale_ptr,
                     step_scale_ptr, y_ptr, N, K, n_kblocks, nibble_mask, bit_mask, one,
                     BLOCK_N: tl.constexpr, GROUP: tl.constexpr, SPLIT_K: tl.constexpr):
    WORDS: tl.constexpr = GROUP // 8
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    per_split = tl.cdiv(n_kblocks, SPLIT_K)
    kb_start = tl.program_id(1) * per_split
    kb_end = tl.minimum(kb_start + per_split, n_kblocks)
    lo_scale = tl.load(lo_scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    step_scale = tl.load(step_scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    w_at = tl.arange(0, WORDS)
    acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    for kb in range(kb_start, kb_end):
        lo, step, d = block_table(lo_ptr, step_ptr, delta_ptr, rows * n_kblocks + kb, row_ok, lo_scale, step_scale)
        # alpha + beta * c + gamma * s with c = 16 * (code - 1) and s = 16 * (bit - 1)
        beta16 = step * 8.0
        gamma16 = 32.0 * d - beta16
        base = lo - d - beta16 - gamma16
        word_at = kb * WORDS + w_at
        word = tl.load(words_ptr + rows[:, None] * word_stride + word_at[None, :],
                       mask=row_ok[:, None] & (word_at < row_words)[None, :], other=0)
        k_at = kb * GROUP + tl.arange(0, GROUP)
        x = tl.load(x_ptr + k_at, mask=k_at < K, other=0.0).to(tl.float32)
        xs = split8(x[None, :], 1, GROUP)
        sum_code = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        sum_bit = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        sum_x = tl.zeros((1, WORDS), dtype=tl.float32)
        for j in tl.static_range(8):
            code, bit = code_and_bit(word, j, nibble_mask, bit_mask, one)
            sum_code += xs[j] * code
            sum_bit += xs[j] * bit
            sum_x += xs[j]
        acc += base[:, None] * sum_x + beta16[:, None] * sum_code + gamma16[:, None] * sum_bit
    y = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        tl.store(y_ptr + rows, y, mask=row_ok)
    else:
        tl.atomic_add(y_ptr + rows, y, mask=row_ok)


def split_k_for(n: int, n_kblocks: int) -> int:
    """The split-K of an N-row GEMV over `n_kblocks` K blocks: whole waves on SMS SMs."""
    return whole_wave_splits(triton.cdiv(n, BLOCK_N), n_kblocks, BLOCKS_PER_SM)


def a3b_gemv(x: torch.Tensor, q: A3BWeight, config: A3BConfig, out: torch.Tensor | None = None,
             split_k: int | None = None) -> torch.Tensor:
    """float32 y[1, N] = x[1, K] @ W^T (into `out` when given), W in 1 x C blocks."""
    if config.block_rows != 1 or x.shape[0] != 1:
        raise ValueError(f"a3b_gemv multiplies one row of x by 1xC blocks, not {x.shape[0]} rows by "
                         f"{config.block_rows}x{config.block_cols}")
    K = x.shape[1]
    N = q.packed.shape[0]
    n_kblocks = q.lo.shape[1]
    tiles = triton.cdiv(N, BLOCK_N)
    split_k = split_k_for(N, n_kblocks) if split_k is None else split_k
    y = torch.empty(1, N, dtype=torch.float32, device=x.device) if out is None else out
    if split_k > 1:
        y.zero_()
    _, lo, step, delta, lo_scale, step_scale = q.kernel_tensors()
    _a3b_gemv_kernel[(tiles, split_k)](x.contiguous(), *code_args(q), lo, step, delta, lo_scale, step_scale, y,
                                       N, K, n_kblocks, NIBBLE_AT_TOP, BIT_AT_TOP, FLOAT_ONE, BLOCK_N=BLOCK_N,
                                       GROUP=config.block_cols, SPLIT_K=split_k)
    return y

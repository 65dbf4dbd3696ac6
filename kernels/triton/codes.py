"""How the Triton A3B kernels read a weight's 4-bit codes: as 32-bit words of 8, code j of word i
in column 8i + j, each code position its own tile."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from a3b_backend.quant.format import A3BWeight


@triton.jit
def split8(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS] -> 8 tiles [ROWS, COLS / 8], tile j holding columns 8i + j."""
    x0246, x1357 = tl.split(tl.reshape(x, (ROWS, COLS // 8, 2, 2, 2)))
    x04, x26 = tl.split(x0246)
    x15, x37 = tl.split(x1357)
    x0, x4 = tl.split(x04)
    x2, x6 = tl.split(x26)
    x1, x5 = tl.split(x15)
    x3, x7 = tl.split(x37)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def block_table(lo_ptr, step_ptr, delta_ptr, meta, ok, lo_scale, step_scale):
    """(lo, step, d) of the blocks at `meta` (row * n_kblocks + block) as float32: the block codes
    times their rows' scales, d = step * delta / 255."""
    lo = tl.load(lo_ptr + meta, mask=ok, other=0).to(tl.float32) * lo_scale
    step = tl.load(step_ptr + meta, mask=ok, other=0).to(tl.float32) * step_scale
    return lo, step, step * tl.load(delta_ptr + meta, mask=ok, other=0).to(tl.float32) / 255.0


def code_args(q: A3BWeight) -> tuple:
    """The codes as the kernels take them: 32-bit words (8 codes each), their
    row stride and the words of codes per row."""
    if q.packed.shape[-1] % 4:
        raise ValueError(f"the Triton A3B kernels read codes as 32-bit words: in_features must be a multiple of 8, "
                         f"not {2 * q.packed.shape[-1]}")
    words = q.packed.view(torch.int32)
    return words, words.stride(-2), words.shape[-1]

"""Grouped A3B MoE in the Triton language: every routed (token, expert) pair of
a batch in one launch per projection, each expert's 4-bit codes read in place
(`a3b_matmul.a3b_accumulate`, the dense kernel's dequantize-in-registers loop).

Routed rows (token t's k-th choice is row t * top_k + k) are sorted by expert
and each expert's run padded to BLOCK_M (`align`, sync-free: the launch size is
an upper bound and programs past the last expert's run return at once), so a
program multiplies BLOCK_M rows of one expert by a BLOCK_N slice of its weight.
The expert MLP is SiLU(x W_gate^T) * (x W_up^T) then W_down, router weights on
the output, as Qwen3.6's experts (hidden 2048, 512 per expert, 8 of 256 routed).

Experts' A3B weights are stacked (`format.stack`): every stored tensor with a
leading expert dimension.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from a3b_backend.quant.format import A3BWeight
from a3b_kernels.triton.a3b_matmul import a3b_accumulate
from a3b_kernels.triton.codes import code_args


@triton.jit
def _a3b_moe_kernel(x_ptr, sorted_rows_ptr, block_expert_ptr, words_ptr, word_stride, row_words, lo_ptr,
                    step_ptr, delta_ptr, lo_scale_ptr, step_scale_ptr, y_ptr, num_rows, N, K, n_kblocks, top_k,
                    X_BY_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_rows
    x_rows = rows // top_k if X_BY_TOKEN else rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    meta = expert * N * n_kblocks
    acc = a3b_accumulate(x_ptr, x_rows, row_ok, words_ptr + expert * N * word_stride, word_stride, row_words,
                         lo_ptr + meta, step_ptr + meta, delta_ptr + meta, lo_scale_ptr + expert * N,
                         step_scale_ptr + expert * N, cols, col_ok, K, n_kblocks, 0, n_kblocks, BLOCK_M, BLOCK_N,
                         GROUP)
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_rows, block_expert): routed rows grouped by expert, each group
    padded to block_m with the sentinel num_rows; the expert of every block of
    block_m rows, -1 past the last group. Ids < 0 (experts of another rank)
    are left out. No host sync and no data-dependent shape (it runs under CUDA
    graphs and FakeTensorMode): every size is an upper bound known from the
    shapes, and rows left out are counted in, and written to, a slot past the end."""
    ids = topk_ids.flatten().long()
    num_rows = ids.numel()
    binned = torch.where(ids >= 0, ids, num_experts)  # another rank's rows: bin num_experts, sorted last
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, binned, torch.ones_like(binned))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    capacity = (num_rows + num_experts * (block_m - 1) + block_m - 1) // block_m * block_m
    order = torch.argsort(binned, stable=True)
    sorted_bins = binned[order]
    first_of_bin = counts.cumsum(0) - counts
    local = sorted_bins < num_experts
    position = torch.where(local, torch.cat([starts, starts.new_full((1,), capacity)])[sorted_bins]
                           + torch.arange(num_rows, device=ids.device) - first_of_bin[sorted_bins], capacity)
    sorted_rows = torch.full((capacity + 1,), num_rows, dtype=torch.int32, device=ids.device)
    sorted_rows.scatter_(0, position, order.to(torch.int32))
    block_starts = torch.arange(0, capacity, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_rows[:capacity], block_expert


def grouped_matmul(x: torch.Tensor, experts: A3BWeight, sorted_rows: torch.Tensor,
                   block_expert: torch.Tensor, num_rows: int, top_k: int, x_by_token: bool, group: int,
                   block_m: int = 16, block_n: int = 64, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 y[num_rows, N] (into `out` when given): row r = x[r // top_k or r]
    @ W_{expert(r)}^T; rows of no local expert are not written (0 in a new y).
    block_m >= 16: fp16 tensor-core dots, as the dense kernel's."""
    N = experts.packed.shape[1]
    K = x.shape[1]
    y = torch.zeros(num_rows, N, dtype=torch.float32, device=x.device) if out is None else out
    grid = (block_expert.numel(), triton.cdiv(N, block_n))
    _, lo, step, delta, lo_scale, step_scale = experts.kernel_tensors()
    _a3b_moe_kernel[grid](x.contiguous(), sorted_rows, block_expert, *code_args(experts), lo, step, delta,
                          lo_scale, step_scale, y, num_rows, N, K, experts.lo.shape[2], top_k,
                          X_BY_TOKEN=x_by_token, BLOCK_M=block_m, BLOCK_N=block_n, GROUP=group)
    return y


def a3b_moe(x: torch.Tensor, w13: A3BWeight, w2: A3BWeight, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, group: int, block_m: int = 16) -> torch.Tensor:
    """float32 out[T, H] = sum_k topk_weights[t, k] * expert_{ids[t, k]}(x[t]),
    w13 = [gate; up] stacked per expert ([E, 2I, H] as A3B), w2 = down ([E, H, I])."""
    tokens, top_k = topk_ids.shape
    num_rows = tokens * top_k
    sorted_rows, block_expert = align(topk_ids, w13.packed.shape[0], block_m)
    gate_up = grouped_matmul(x, w13, sorted_rows, block_expert, num_rows, top_k, True, group, block_m)
    gate, up = gate_up.chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate) * up).to(x.dtype)
    down = grouped_matmul(act, w2, sorted_rows, block_expert, num_rows, top_k, False, group, block_m)
    weights = torch.where(topk_ids >= 0, topk_weights.float(), 0.0)
    return (down.view(tokens, top_k, -1) * weights[..., None]).sum(1)

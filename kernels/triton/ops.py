"""The Triton A3B kernels as torch custom ops, the calls vLLM's compiled GPU engine makes.

Opaque to torch.compile, with fake implementations for tracing, so that:
- the launch (tiles, split-K) is chosen inside the op from the run-time M (`launch_for`): a graph
  traced at M=64 still runs M=1 decode on the decode launch, with guards dropped and a dynamic
  batch dimension as vLLM compiles;
- shapes come in as ints or from tensor shapes, never from reading a tensor's values on the host.
"""
from __future__ import annotations

import torch

from a3b_backend.quant.format import KERNEL_KINDS, A3BConfig, A3BWeight
from a3b_kernels.triton.a3b_matmul import a3b_matmul
from a3b_kernels.triton.a3b_moe import a3b_moe


def _weight(tensors: tuple[torch.Tensor, ...], out_features: int, in_features: int) -> A3BWeight:
    return A3BWeight.for_kernels(dict(zip(KERNEL_KINDS, tensors)), out_features, in_features)


@torch.library.custom_op("a3b::gpu_linear", mutates_args=())
def gpu_linear(x: torch.Tensor, packed: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, delta: torch.Tensor,
               lo_scale: torch.Tensor, step_scale: torch.Tensor, block_cols: int) -> torch.Tensor:
    """float32 x[M, in] @ W^T, W an A3B weight in 1 x block_cols blocks."""
    weight = _weight((packed, lo, step, delta, lo_scale, step_scale), packed.shape[0], x.shape[1])
    return a3b_matmul(x, weight, A3BConfig(1, block_cols))


@gpu_linear.register_fake
def _gpu_linear_shape(x, packed, *_rest) -> torch.Tensor:
    return x.new_empty((x.shape[0], packed.shape[0]), dtype=torch.float32)


@torch.library.custom_op("a3b::gpu_moe", mutates_args=())
def gpu_moe(x: torch.Tensor, w13_packed: torch.Tensor, w13_lo: torch.Tensor, w13_step: torch.Tensor,
            w13_delta: torch.Tensor, w13_lo_scale: torch.Tensor, w13_step_scale: torch.Tensor,
            w2_packed: torch.Tensor, w2_lo: torch.Tensor, w2_step: torch.Tensor, w2_delta: torch.Tensor,
            w2_lo_scale: torch.Tensor, w2_step_scale: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, block_cols: int) -> torch.Tensor:
    """float32 routed-expert output [T, hidden] (ids < 0: another rank's experts, left out);
    w13 = [gate; up] per expert [E, 2I, hidden], w2 = down [E, hidden, I], both stacked A3B."""
    hidden, double_width = x.shape[1], w13_packed.shape[1]
    w13 = _weight((w13_packed, w13_lo, w13_step, w13_delta, w13_lo_scale, w13_step_scale), double_width, hidden)
    w2 = _weight((w2_packed, w2_lo, w2_step, w2_delta, w2_lo_scale, w2_step_scale), hidden, double_width // 2)
    return a3b_moe(x, w13, w2, topk_weights, topk_ids, block_cols)


@gpu_moe.register_fake
def _gpu_moe_shape(x, *_rest) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.float32)

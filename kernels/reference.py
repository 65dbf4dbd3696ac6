"""Torch references the Triton and CUDA kernels are checked against."""
from __future__ import annotations

import torch

from a3b_backend.quant.format import A3BConfig, A3BWeight, dequantize


def a3b_matmul(x: torch.Tensor, q: A3BWeight, config: A3BConfig, weight_dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """float32 y[M, N] = x[M, K] @ W^T, W dequantized by the format's own
    reference and rounded to `weight_dtype` (fp16: what the tensor-core path multiplies)."""
    return x.float() @ dequantize(q, config).to(weight_dtype).float().T


def a3b_moe(x: torch.Tensor, w13: list[A3BWeight], w2: list[A3BWeight], topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, config: A3BConfig, weight_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float32 out[T, H]: per routed (token, expert), SiLU(gate) * up then down,
    scaled by the router weight; ids < 0 are another rank's experts."""
    out = torch.zeros(x.shape[0], w2[0].shape[0].item(), dtype=torch.float32)
    for t in range(x.shape[0]):
        for slot, e in enumerate(topk_ids[t].tolist()):
            if e < 0:
                continue
            gate, up = a3b_matmul(x[t:t + 1], w13[e], config, weight_dtype).chunk(2, dim=-1)
            act = (torch.nn.functional.silu(gate) * up).to(x.dtype)
            out[t] += topk_weights[t, slot].float() * a3b_matmul(act, w2[e], config, weight_dtype)[0]
    return out

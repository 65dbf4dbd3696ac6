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


def random_weight(count: int | None, out: int, inp: int, block: tuple[int, int] = (1, 128),
                  generator: torch.Generator | None = None, device: str = "cpu") -> A3BWeight:
    """An A3B weight (a stack of `count` experts, or one weight for None) with random codes and
    metadata in the stored layout: kernel checks at real sizes without rounding (256 real-width
    experts take minutes to round). Table values stay small: row scales 2e-4 (lo) and 1e-4 (step)."""
    from a3b_backend.quant.format import stored_tensors

    lead = () if count is None else (count,)
    specs = stored_tensors(out, inp, block)
    ranges = {"packed": (0, 256), "lo": (-127, 128), "step": (0, 256), "delta": (0, 256)}
    tensors = {kind: torch.randint(*ranges[kind], (*lead, *specs[kind].shape), generator=generator)
               .to(device=device, dtype=specs[kind].dtype) for kind in ranges}
    tensors.update({kind: torch.full((*lead, *specs[kind].shape), value, dtype=torch.bfloat16, device=device)
                    for kind, value in (("lo_scale", 2e-4), ("step_scale", 1e-4))})
    return A3BWeight.for_kernels(tensors, out, inp)

"""Uniform round-to-nearest baselines (asymmetric, per group of columns), packed as they would be stored."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from a3b_backend.quant.format import ceil_div


@dataclasses.dataclass(frozen=True)
class RtnConfig:
    bits: int = 4
    group: int = 128


def quantize_dequantize(w: torch.Tensor, config: RtnConfig) -> tuple[torch.Tensor, int]:
    """Returns (dequantized W, bytes on disk: packed codes, an fp16 scale per
    group and its integer zero-point packed at `bits` bits, as GPTQ / AWQ
    checkpoints store them)."""
    out, inp = w.shape
    pad = (-inp) % config.group
    wp = torch.nn.functional.pad(w.detach().float(), (0, pad))
    g = wp.reshape(-1, config.group)
    top = 2**config.bits - 1
    lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
    scale = ((hi - lo) / top).clamp_min(1e-12).half().float()
    zero = (-lo / scale).round().clamp(0, top).half().float()
    codes = ((g / scale).round() + zero).clamp(0, top)
    deq = ((codes - zero) * scale).reshape(out, -1)[:, :inp]
    # Stored without the padding: a partial last group costs only its scale and zero.
    stored = codes.reshape(out, -1)[:, :inp].to(torch.int64).numpy()
    packed = np.packbits(((stored[..., None] >> np.arange(config.bits)) & 1).astype(np.uint8))
    groups = g.shape[0]
    nbytes = packed.nbytes + 2 * groups + ceil_div(groups * config.bits, 8)
    return deq, nbytes

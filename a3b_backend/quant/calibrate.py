"""Activation statistics from real text, and the activation-aware transform they drive.

For every quantized linear layer we record the mean square and mean absolute
value of each input channel over calibration text. Two uses:
- importance weights for the fit (mean x^2 per column: the diagonal of the
  layer's input Hessian, so the fit minimizes output error, not weight error);
- an AWQ-style per-channel scale s = mean|x|^alpha that enlarges salient
  columns before quantizing; W ~ Q(W diag(s)) diag(1/s). Layers that share an
  input (q/k/v after input_layernorm, gate/up after post_attention_layernorm)
  share s, so it can be folded into that RMSNorm's weight.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch
from tqdm import tqdm

# Linear layers quantized by default; embeddings, norms, lm_head and MoE routers stay.
QUANTIZED = re.compile(
    r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|in_proj_qkvz|in_proj_ba|in_proj_qkv|in_proj_z|"
    r"in_proj_b|in_proj_a|out_proj)$|\.experts\.\d+\.(gate_proj|up_proj|down_proj)$"
)
ALPHA = 0.5


@dataclasses.dataclass
class ChannelStats:
    sq_sum: torch.Tensor
    abs_sum: torch.Tensor
    count: int = 0

    @property
    def importance(self) -> torch.Tensor:
        return self.sq_sum / max(self.count, 1)

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.count, 1)


def awq_scale(stats: ChannelStats, alpha: float = ALPHA) -> torch.Tensor:
    s = stats.mean_abs.clamp_min(1e-5) ** alpha
    return s / (s.max() * s.min()).sqrt()


def quantized_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and QUANTIZED.search(n)}


@torch.no_grad()
def collect(model: torch.nn.Module, token_ids: torch.Tensor, seq_len: int = 512) -> dict[str, ChannelStats]:
    """Run the model over token_ids in windows of seq_len; per-linear input channel statistics."""
    stats: dict[str, ChannelStats] = {}
    hooks = []
    for name, module in quantized_linears(model).items():
        def hook(_mod, args, _out, name=name):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            st = stats.setdefault(name, ChannelStats(torch.zeros(x.shape[1]), torch.zeros(x.shape[1])))
            st.sq_sum += (x * x).sum(0)
            st.abs_sum += x.abs().sum(0)
            st.count += x.shape[0]
        hooks.append(module.register_forward_hook(hook))
    try:
        for start in tqdm(range(0, token_ids.numel(), seq_len), desc="calibrating", unit="window", leave=False):
            model(token_ids[start:start + seq_len].unsqueeze(0))
    finally:
        for h in hooks:
            h.remove()
    return stats


def load_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")

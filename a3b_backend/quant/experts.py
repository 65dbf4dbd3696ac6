"""A MoE layer's routed experts rounded in groups, each on its own tokens (the layer pipeline).

`calibrate.record` keeps, for each stacked experts module, what it was called with over the
calibration windows: its input tokens and the experts each token chose (`calibrate.RoutedInputs`). Then,
one group of experts at a time, each expert's own tokens give its gate/up input Hessian and its
own intermediate activations act(gate) * up (from its float weights) give its down_proj's.

An expert projection whose own tokens number at least TOKENS_PER_INPUT per input channel is
rounded error-compensating (GPTQ) on its Hessian, the group's experts together
(`gptq.quantize_gptq_stack`). With fewer, GPTQ fits the few tokens it saw and rounds worse than
nearest on tokens it did not (`make bench-convert-scale` prints the held-out output error by
token count), so the projection takes nearest rounding on its importance (its own, or its
block's when it fell back, `calibrate.fill_expert_fallbacks`).

Memory at Qwen3.6-35B-A3B's width: the routed inputs are one copy of the layer's MoE input (128 x
512 tokens x 2048 in fp32: 0.54 GB), and a group's Hessians are a few experts' (4 x 2048^2 fp32 =
64 MB; on a GPU 64 experts, 1 GB), never all 256 at once (4.3 GB).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from a3b_backend.quant import calibrate
from a3b_backend.quant.format import A3BConfig, A3BWeight, dequantize, quantize_stack
from a3b_backend.quant.gptq import quantize_gptq_stack

# Weights rounded per group, by device. A CPU: 4 experts of 512 x 2048; larger stacks leave the cache
# (bench-convert-scale's throughput table: error-compensating rounding of 4 such experts together
# against 16). A GPU: 64 (their Hessians 1 GB); the column loop launches the same kernels for a group
# of any size, so on a GPU the time goes with the number of groups (bench-convert-scale's GPU projection).
GROUP_WEIGHTS = {"cpu": 2**22, "cuda": 2**26}
# Own tokens per input channel from which error-compensating rounding beats nearest on held-out tokens.
TOKENS_PER_INPUT = 0.5
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def compensating_tokens(in_features: int) -> int:
    """Own tokens an expert projection of this input width needs for error-compensating rounding."""
    return max(calibrate.MIN_EXPERT_TOKENS, int(TOKENS_PER_INPUT * in_features))


@dataclasses.dataclass
class RoundedExperts:
    tensors: dict[str, torch.Tensor]  # the checkpoint's per-expert tensors
    error_compensated: int  # expert projections rounded on their own Hessian
    projections: int


def _second_moments(x: torch.Tensor) -> torch.Tensor:
    return x.T @ x / x.shape[0]


@torch.no_grad()
def round_experts(experts: torch.nn.Module, module: str, checkpoint_name: Callable[[str], str],
                  stats: dict[str, calibrate.ChannelStats], routed: calibrate.RoutedInputs | None,
                  config: A3BConfig, input_scale: torch.Tensor | None = None) -> RoundedExperts:
    """Rounds the stacked experts `module` (gate_up_proj [E, 2I, H], down_proj [E, H, I]); their
    weights become their quantized values. `routed` None: nearest rounding for all;
    `checkpoint_name`: an expert projection's module name -> its checkpoint tensor name;
    `input_scale`: the AWQ scale folded into the norm they read: gate/up are stored times it,
    rounded on inputs divided by it, and given back in the source's scale."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    s = None if input_scale is None else input_scale.to(gate_up)
    if s is not None:
        gate_up.mul_(s)
    count, width = gate_up.shape[0], gate_up.shape[1] // 2
    weights = {"gate_proj": gate_up[:, :width], "up_proj": gate_up[:, width:], "down_proj": down}
    group = max(1, GROUP_WEIGHTS[gate_up.device.type] // (width * gate_up.shape[2]))
    tensors, compensated = {}, 0
    for start in range(0, count, group):
        members = range(start, min(count, start + group))
        inputs: dict[str, dict[int, torch.Tensor]] = {p: {} for p in PROJECTIONS}
        for e in members if routed is not None else ():
            own = routed.tokens(e) if s is None else routed.tokens(e) / s
            if own.shape[0] >= compensating_tokens(own.shape[1]):
                inputs["gate_proj"][e] = inputs["up_proj"][e] = own
            gate, up = torch.nn.functional.linear(own, gate_up[e]).chunk(2, dim=-1)
            if own.shape[0] >= compensating_tokens(width):
                inputs["down_proj"][e] = experts.act_fn(gate) * up
        rounded: dict[tuple[int, str], A3BWeight] = {}
        for proj in PROJECTIONS:
            with_hessian = [e for e in members if e in inputs[proj]]
            rest = [e for e in members if e not in inputs[proj]]
            if with_hessian:
                hessians = torch.stack([_second_moments(inputs[proj][e]) for e in with_hessian])
                stacked = quantize_gptq_stack(weights[proj][with_hessian], config, hessians, f"{module}.{proj}")
                rounded.update({(e, proj): stacked.expert(i) for i, e in enumerate(with_hessian)})
            if rest:
                importance = torch.stack([stats[f"{module}.{e}.{proj}"].importance for e in rest])
                if s is not None and proj != "down_proj":
                    importance = importance / s**2
                stacked = quantize_stack(weights[proj][rest], config, importance, f"{module}.{proj}")
                rounded.update({(e, proj): stacked.expert(i) for i, e in enumerate(rest)})
            compensated += len(with_hessian)
        for (e, proj), q in rounded.items():
            tensors.update(q.tensors(checkpoint_name(f"{module}.{e}.{proj}")))
            weights[proj][e] = dequantize(q, config)
    if s is not None:
        gate_up.div_(s)
    return RoundedExperts(tensors, compensated, count * len(PROJECTIONS))

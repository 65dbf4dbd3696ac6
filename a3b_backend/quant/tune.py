"""The parts of end-to-end tuning of A3B's metadata by distillation from the source model
(run one layer in memory at a time by quant/stream_tune.py).

An A3B weight is `lo + level * step +- delta` per block, with `lo`, `step`
and `delta` stored as int8/uint8 codes against two bf16 scales per block row,
and `level` and the sign fixed by each weight's 4-bit code. Every layer's fit
minimizes its own output error; tuning the metadata against the whole model's
output (KL divergence from the source model's next-token distribution over
the calibration text) lets the layers correct each other's errors. Tuned:
- the row scales (as logarithms of their ratio to the fitted ones);
- with `block_codes_lr`, each block's lo/step/delta codes too, as continuous
  offsets rounded in the forward pass (straight-through), so the model tuned is
  the one stored;
- the gains of the RMSNorms passed in, those that carry AWQ scales (an AWQ
  scale tuned end to end).
The weights' 4-bit codes, the checkpoint's format and its bytes are unchanged.
"""
from __future__ import annotations

import dataclasses

import torch

from a3b_backend.quant.format import CODE_RANGES, A3BConfig, A3BWeight, lookup


@dataclasses.dataclass(frozen=True)
class TuneConfig:
    epochs: int = 1  # passes over the calibration windows, one optimizer step per window
    lr: float = 5e-4  # Adam, on logarithms of scales, cosine-decayed to 0
    block_codes_lr: float = 0.03  # Adam on the block codes' offsets (in code units); 0: the codes stay
    seq_len: int = 512


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward, identity backward."""
    return x + (x.round() - x).detach()


class TunedLinear(torch.nn.Module):
    """A quantized linear whose metadata is trainable: weight = lo + level * step + sign * delta
    per block, the block values from their codes times their row's scales."""

    def __init__(self, weight: A3BWeight, config: A3BConfig, block_codes: bool):
        super().__init__()
        # the 4-bit codes stay packed (half a byte a weight): the layer pipeline keeps every layer's
        # TunedLinears in memory between uses (quant/stream_tune.py)
        self.register_buffer("packed", weight.packed)
        self.out_features, self.in_features = weight.out_features, weight.in_features
        for kind in CODE_RANGES:
            self.register_buffer(f"{kind}_code", getattr(weight, kind).float())
        self.register_buffer("fitted", torch.stack([weight.lo_scale.float(), weight.step_scale.float()]))
        self.log_gain = torch.nn.Parameter(torch.zeros_like(self.fitted))
        self.offsets = torch.nn.Parameter(torch.zeros(3, *weight.lo.shape), requires_grad=block_codes)
        self.block = config.block

    def scales(self) -> torch.Tensor:
        """[2, block rows]: lo_scale and step_scale as tuned."""
        return self.fitted * self.log_gain.exp()

    def codes(self) -> list[torch.Tensor]:
        """lo, step and delta codes as tuned: whole numbers in their stored ranges."""
        return [round_ste(getattr(self, f"{kind}_code") + offset).clamp(*CODE_RANGES[kind])
                for kind, offset in zip(CODE_RANGES, self.offsets)]

    def weight(self) -> torch.Tensor:
        lo_q, step_q, delta_q = self.codes()
        lo_scale, step_scale = self.scales()
        lo, step = lo_q * lo_scale[:, None], step_q * step_scale[:, None]
        return lookup(self.packed, lo, step, step * delta_q / 255, self.block, (self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight())

    def stored(self, weight: A3BWeight) -> A3BWeight:
        """`weight` with this layer's tuned metadata."""
        with torch.no_grad():
            lo_q, step_q, delta_q = self.codes()
            lo_scale, step_scale = self.scales().to(torch.bfloat16)
        return dataclasses.replace(weight, lo=lo_q.to(torch.int8), step=step_q.to(torch.uint8),
                                   delta=delta_q.to(torch.uint8), lo_scale=lo_scale, step_scale=step_scale)


class NormGain(torch.nn.Module):
    """An RMSNorm weight times a trainable per-channel gain (a zero-centred norm's 1 + w)."""

    def __init__(self, channels: int, zero_centred: bool):
        super().__init__()
        self.log_gain = torch.nn.Parameter(torch.zeros(channels))
        self.zero_centred = zero_centred

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if self.zero_centred:
            return (1 + weight) * self.log_gain.exp() - 1
        return weight * self.log_gain.exp()


def make_optimizer(layers: dict[str, TunedLinear], gains: dict[str, NormGain], tune_config: TuneConfig, steps: int):
    groups = [{"params": [layer.log_gain for layer in layers.values()]
               + [gain.log_gain for gain in gains.values()], "lr": tune_config.lr}]
    if tune_config.block_codes_lr > 0:
        groups.append({"params": [layer.offsets for layer in layers.values()], "lr": tune_config.block_codes_lr})
    optimizer = torch.optim.Adam(groups)
    return optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)


def kl_per_token(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student), summed over the vocabulary, averaged over tokens."""
    return torch.nn.functional.kl_div(student_logits.float().log_softmax(-1), teacher_logits.float().log_softmax(-1),
                                      log_target=True, reduction="sum") / student_logits[..., 0].numel()

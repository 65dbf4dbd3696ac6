"""End-to-end tuning of A3B's row scales by distillation from the source model.

An A3B weight row is `lo_scale * L + step_scale * S`: L holds each weight's
block `lo` code and S its `step` code times (level +- delta), both fixed by
the fit and the codes. The two bf16 scales per block row are the only
parameters here. Every layer's fit minimizes its own output error; tuning
the scales against the whole model's output (KL divergence from the source
model's next-token distribution over the calibration text, codes and tables
fixed) lets the layers correct each other's errors. The checkpoint's bytes
and format are unchanged: only the stored scales move.
"""
from __future__ import annotations

import dataclasses

import torch
from tqdm import tqdm

from a3b_backend.quant.format import A3BConfig, A3BWeight, dequantize


@dataclasses.dataclass(frozen=True)
class TuneConfig:
    epochs: int = 1  # passes over the calibration windows, one optimizer step per window
    lr: float = 5e-4  # Adam, on the scales' logarithms, cosine-decayed to 0
    seq_len: int = 512


class RowScaledLinear(torch.nn.Module):
    """A quantized linear whose block-row scales are trainable (as logarithms of
    their ratio to the fitted ones)."""

    def __init__(self, weight: A3BWeight, config: A3BConfig):
        super().__init__()
        ones, zeros = torch.ones_like(weight.lo_scale), torch.zeros_like(weight.lo_scale)
        # dequantize is linear in the two scales: W = lo_scale * L + step_scale * S per block row
        self.register_buffer("lo_part", dequantize(dataclasses.replace(weight, lo_scale=ones, step_scale=zeros),
                                                   config))
        self.register_buffer("step_part", dequantize(dataclasses.replace(weight, lo_scale=zeros, step_scale=ones),
                                                     config))
        self.register_buffer("fitted", torch.stack([weight.lo_scale.float(), weight.step_scale.float()]))
        self.log_gain = torch.nn.Parameter(torch.zeros_like(self.fitted))
        self.block_rows = config.block_rows

    def scales(self) -> torch.Tensor:
        """[2, block rows]: lo_scale and step_scale as tuned."""
        return self.fitted * self.log_gain.exp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.scales().repeat_interleave(self.block_rows, dim=1)[:, : self.lo_part.shape[0], None]
        return torch.nn.functional.linear(x, rows[0] * self.lo_part + rows[1] * self.step_part)


def tune_scales(teacher: torch.nn.Module, student: torch.nn.Module, weights: dict[str, A3BWeight],
                config: A3BConfig, token_ids: torch.Tensor, tune: TuneConfig = TuneConfig()) -> dict[str, A3BWeight]:
    """The weights with their scales tuned: `student` (the source architecture holding
    what the checkpoint stores outside the quantized linears) gets each named linear
    replaced by its A3B weight; its scales are fitted so its next-token distribution
    over `token_ids` follows `teacher`'s."""
    layers = {name: RowScaledLinear(w, config) for name, w in weights.items()}
    for name, layer in layers.items():
        parent, attr = name.rsplit(".", 1)
        setattr(student.get_submodule(parent), attr, layer)
    windows = [token_ids[i:i + tune.seq_len] for i in range(0, token_ids.numel() - 1, tune.seq_len)]
    steps = tune.epochs * len(windows)
    params = [layer.log_gain for layer in layers.values()]
    optimizer = torch.optim.Adam(params, lr=tune.lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    teacher.eval().requires_grad_(False)
    student.eval().requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    with tqdm(range(steps), desc="tuning row scales", unit="window") as bar:
        for step in bar:
            window = windows[step % len(windows)].unsqueeze(0)
            with torch.no_grad():
                target = teacher(window).logits.float().log_softmax(-1)
            predicted = student(window).logits.float().log_softmax(-1)
            loss = torch.nn.functional.kl_div(predicted, target, log_target=True, reduction="sum") / window.numel()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            bar.set_postfix(kl=f"{loss.item():.4f}")
    out = {}
    with torch.no_grad():
        for name, layer in layers.items():
            lo_scale, step_scale = layer.scales().to(torch.bfloat16)
            out[name] = dataclasses.replace(weights[name], lo_scale=lo_scale, step_scale=step_scale)
    return out

"""Block-wise tuning of A3B's rounding and metadata: AutoRound's recipe in A3B's terms.

The layer pipeline (quant/sequential.py, --tune-steps N) tunes each decoder layer on its own, as
AutoRound (intel/auto-round, `sign_round`) tunes each block:
- per weight, where it rounds: each weight is rounded (straight-through) to its block table's
  nearest entry from a point that may move half a code spacing (half the block's step) either
  way, AutoRound's offset V. The point starts at the float weight moved the least into the cell
  of the entry the error-compensating rounding stored it as, so iteration 0 is that rounding
  and the weights it left at their nearest entry start where AutoRound's do;
- per block and row, the table: the lo/step/delta codes as continuous offsets rounded
  straight-through, and the two row scales as logarithms of their ratio to the fitted ones
  (AutoRound's min/max scale factors), rounded to bf16 as stored;
- the loss: the layer's output against the float layer's on the float chain's inputs, each
  output channel's squared error divided by that channel's mean square in the float output, so
  a few outlier channels of the residual stream cannot carry the whole loss;
- sign-SGD (or Adam) with its learning rate decayed linearly to 0, a random batch of windows a
  step;
- the best iteration by the loss on held-out windows (every HELD_OUT_EVERY-th, spread over the
  calibration text's documents), iteration 0 included: a layer never ends worse on them than
  its untuned rounding, and one whose tuning never lowered it keeps its untuned weights.
The stored model is the tuned one: codes are assigned against the stored (bf16-scaled) tables.
Off by default: on SmolLM2 no setting tried beat the error-compensating rounding on held-out
windows (docs/quantization.md, "Block-wise tuning").
"""
from __future__ import annotations

import dataclasses
import random
from typing import Callable, Literal

import torch
from tqdm import tqdm

from a3b_backend.quant.format import (CODE_RANGES, A3BConfig, A3BWeight, assign, dequantize, pack_codes,
                                      table_params, unpack_codes)
from a3b_backend.quant.tune import round_ste

# Which chain's hidden states the quantized layer is tuned on (its targets are always the float
# layer's outputs on the float chain): "float", the float chain's (and its statistics from them),
# or "quantized", the quantized layers' outputs passed on (AutoRound's default; on Mixtral it
# blew up perplexity on text unlike the calibration text).
TuneInputs = Literal["float", "quantized"]
HELD_OUT_EVERY = 8  # every 8th calibration window is held out for choosing the best iteration
ROUNDING_BOUND = 0.5  # a weight's rounding point stays within half a code spacing of where it started


@dataclasses.dataclass(frozen=True)
class BlockTuneConfig:
    steps: int = 0  # optimizer steps per layer (AutoRound takes 200); 0: no tuning
    batch: int = 4  # windows per step
    # The most each parameter can move over the linearly decayed schedule (sign-SGD moves it by
    # lr each step, lr = 2 * travel / steps at the start; AutoRound's 1 / iterations is travel 0.5):
    # the rounding point in code spacings, the block codes in code units, the row scales' logarithms.
    rounding_travel: float = 0.5
    code_travel: float = 2.0
    scale_travel: float = 0.05
    evaluate_every: int = 20  # steps between held-out evaluations (and after the last)
    inputs: TuneInputs = "float"
    optimizer: Literal["sign-sgd", "adam"] = "sign-sgd"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class RoundedLinear(torch.nn.Module):
    """A quantized linear whose rounding and table are trainable; computes the weight it stores."""

    def __init__(self, weight: A3BWeight, config: A3BConfig, float_weight: torch.Tensor):
        super().__init__()
        self.block, self.source = config.block, weight
        for kind in CODE_RANGES:
            self.register_buffer(f"{kind}_code", getattr(weight, kind).float())
        self.register_buffer("fitted", torch.stack([weight.lo_scale.float(), weight.step_scale.float()]))
        _, step, delta = (self._per_weight(t) for t in table_params(weight))
        self.register_buffer("spacing", step / 2)
        plus = (unpack_codes(weight.packed)[:, :weight.in_features] & 1).bool()
        self.register_buffer("start", _into_cell(float_weight.float(), dequantize(weight, config), plus, step, delta))
        self.rounding = torch.nn.Parameter(torch.zeros_like(self.start))
        self.code_offsets = torch.nn.Parameter(torch.zeros(3, *weight.lo.shape))
        self.log_gain = torch.nn.Parameter(torch.zeros_like(self.fitted))

    def _per_weight(self, t: torch.Tensor) -> torch.Tensor:
        rows, cols = self.block
        out, inp = self.source.out_features, self.source.in_features
        return t.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:out, :inp]

    def _codes(self) -> list[torch.Tensor]:
        """lo, step and delta codes as tuned: whole numbers in their stored ranges (straight-through)."""
        return [round_ste(getattr(self, f"{kind}_code") + offset).clamp(*CODE_RANGES[kind])
                for kind, offset in zip(CODE_RANGES, self.code_offsets)]

    def _scales(self) -> torch.Tensor:
        """[2, block rows]: lo_scale and step_scale as tuned, rounded to bf16 as stored (straight-through)."""
        scales = self.fitted * self.log_gain.exp()
        return scales + (scales.to(torch.bfloat16).float() - scales).detach()

    def table(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per block (lo, step, delta) as the checkpoint would store them now."""
        lo_q, step_q, delta_q = self._codes()
        lo_scale, step_scale = self._scales()
        step = step_q * step_scale[:, None]
        return lo_q * lo_scale[:, None], step, step * delta_q / 255

    def _point(self) -> torch.Tensor:
        return self.start + self.rounding * self.spacing

    def weight(self) -> torch.Tensor:
        lo, step, delta = (self._per_weight(t) for t in self.table())
        point = self._point()
        with torch.no_grad():
            level, plus = assign(point, lo, step, delta)
        value = lo + level * step + (plus.float() * 2 - 1) * delta
        # the table's value forward; backward, the rounding point's gradient and the table's
        return point + (value - point).detach() + value - value.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight())

    @torch.no_grad()
    def stored(self) -> A3BWeight:
        """The weight as tuned: its table's codes and scales, and each weight's code assigned
        against that stored table."""
        lo_q, step_q, delta_q = self._codes()
        lo_scale, step_scale = self._scales().to(torch.bfloat16)
        q = dataclasses.replace(self.source, lo=lo_q.to(torch.int8), step=step_q.to(torch.uint8),
                                delta=delta_q.to(torch.uint8), lo_scale=lo_scale, step_scale=step_scale)
        lo, step, delta = (self._per_weight(t) for t in table_params(q))
        level, plus = assign(self._point(), lo, step, delta)
        codes = (level.to(torch.uint8) << 1) | plus.to(torch.uint8)
        if codes.shape[1] % 2:
            codes = torch.nn.functional.pad(codes, (0, 1))
        return dataclasses.replace(q, packed=pack_codes(codes))


def _into_cell(weight: torch.Tensor, stored: torch.Tensor, plus: torch.Tensor, step: torch.Tensor,
               delta: torch.Tensor, margin: float = 0.05) -> torch.Tensor:
    """Each float weight moved the least into the cell of the table entry it is stored as (the
    values nearer to it than to any other entry), `margin` of a code spacing inside; where the
    stored entry is its nearest, the weight itself. An entry lo + k * step + delta (`plus`) has
    its partner - delta 2 * delta below and the next level's - delta entry step - 2 * delta above,
    so its cell reaches delta down and half of step - 2 * delta up; mirrored for - delta."""
    toward_partner, toward_level = delta, (step - 2 * delta).clamp_min(0) / 2
    inset = margin * step / 2
    below = (torch.where(plus, toward_partner, toward_level) - inset).clamp_min(0)
    above = (torch.where(plus, toward_level, toward_partner) - inset).clamp_min(0)
    return torch.minimum(torch.maximum(weight, stored - below), stored + above)


class SourceInputs(torch.nn.Module):
    """A RoundedLinear fed the source model's inputs: they are divided by the AWQ scale the
    checkpoint folds into what produces them, and its output rows multiplied by the row divisor
    folded into its weight (the layer is tuned inside the source's layer)."""

    def __init__(self, linear: RoundedLinear, scale: torch.Tensor | None, row_divisor: torch.Tensor | None):
        super().__init__()
        self.linear, self.scale, self.row_divisor = linear, scale, row_divisor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x if self.scale is None else x / self.scale)
        return y if self.row_divisor is None else y * self.row_divisor


@dataclasses.dataclass
class BlockTuned:
    weights: dict[str, A3BWeight]
    held_out_before: float  # the held-out loss of the untuned rounding
    held_out_after: float  # of what is returned
    best_step: int  # 0: no tuned iteration beat the untuned weights, which are returned
    history: list[tuple[int, float]]  # (step, held-out loss) at each evaluation

    def to_json(self) -> dict:
        return {"held_out_before": round(self.held_out_before, 6), "held_out_after": round(self.held_out_after, 6),
                "best_step": self.best_step}


def held_out_windows(count: int) -> list[int]:
    """The windows held out of `count`: every HELD_OUT_EVERY-th; none when too few to spare."""
    return list(range(HELD_OUT_EVERY - 1, count, HELD_OUT_EVERY)) if count >= 2 * HELD_OUT_EVERY else []


def tune_block(block: torch.nn.Module, weights: dict[str, A3BWeight], floats: dict[str, torch.Tensor],
               config: A3BConfig, run: Callable[[int], torch.Tensor], targets: list[torch.Tensor],
               folds: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]],
               tune_config: BlockTuneConfig, seed: int = 0) -> BlockTuned:
    """`block`'s named linears (names within it), holding their A3B weights' values when called,
    replaced by RoundedLinears of those weights (`floats`: their float weights as the checkpoint
    scales them; `folds`: each one's AWQ scale and row divisor, or None), tuned so `run(i)`, the
    block on window i's inputs, follows `targets[i]`. The block keeps the tuned modules until the
    caller puts its linears back. With fewer than 2 * HELD_OUT_EVERY windows none are held out
    and the best iteration is chosen on all of them."""
    block.requires_grad_(False)
    held_out = held_out_windows(len(targets))
    train = [i for i in range(len(targets)) if i not in set(held_out)] or list(range(len(targets)))
    held_out = held_out or train
    with torch.no_grad():
        channel_ms = sum(targets[i].float().square().sum(tuple(range(targets[i].ndim - 1))) for i in train)
        channel_ms = channel_ms / sum(targets[i][..., 0].numel() for i in train)
        channel_ms = channel_ms.clamp_min(1e-6 * float(channel_ms.max()) + 1e-30)

    def loss(i: int) -> torch.Tensor:
        return ((run(i).float() - targets[i]).square() / channel_ms).mean()

    def evaluate() -> float:
        with torch.no_grad():
            return sum(float(loss(i)) for i in held_out) / len(held_out)

    before = evaluate()  # the block holds the untuned weights
    layers = {name: RoundedLinear(w, config, floats[name]) for name, w in weights.items()}
    for name, layer in layers.items():
        parent, _, attr = name.rpartition(".")
        setattr(block.get_submodule(parent), attr, SourceInputs(layer, *folds[name]))
    groups = {"rounding": [layer.rounding for layer in layers.values()],
              "code": [layer.code_offsets for layer in layers.values()],
              "scale": [layer.log_gain for layer in layers.values()]}
    travel = {"rounding": tune_config.rounding_travel, "code": tune_config.code_travel,
              "scale": tune_config.scale_travel}

    def snapshot() -> list[torch.Tensor]:
        return [p.detach().clone() for params in groups.values() for p in params]

    best_loss, best_step, best = before, 0, snapshot()
    history = [(0, before)]
    rng = random.Random(seed)
    steps = tune_config.steps
    adam = torch.optim.Adam([{"params": ps, "lr": 2 * travel[kind] / steps} for kind, ps in groups.items()],
                            betas=(0.9, 0.99)) if tune_config.optimizer == "adam" else None
    with tqdm(range(steps), desc="tuning the layer's A3B rounding", unit="step", leave=False) as bar:
        for step in bar:
            params = [p for ps in groups.values() for p in ps]
            for p in params:
                p.grad = None
            batch = rng.sample(train, min(tune_config.batch, len(train)))
            for i in batch:
                (loss(i) / len(batch)).backward()
            decay = 1 - step / steps
            lr = {kind: 2 * travel[kind] / steps * decay for kind in groups}
            with torch.no_grad():
                if adam is None:
                    for kind, ps in groups.items():
                        for p in ps:
                            if p.grad is not None:
                                p.sub_(lr[kind] * p.grad.sign())
                else:
                    for group, kind in zip(adam.param_groups, groups):
                        group["lr"] = lr[kind]
                    adam.step()
                for p in groups["rounding"]:
                    p.clamp_(-ROUNDING_BOUND, ROUNDING_BOUND)
            if (step + 1) % tune_config.evaluate_every == 0 or step + 1 == steps:
                current = evaluate()
                history.append((step + 1, current))
                if current < best_loss:
                    best_loss, best_step, best = current, step + 1, snapshot()
                bar.set_postfix(held_out=f"{current:.4g}", untuned=f"{before:.4g}")
    with torch.no_grad():
        for p, value in zip((p for ps in groups.values() for p in ps), best):
            p.copy_(value)
    tuned = {name: weights[name] if best_step == 0 else layer.stored() for name, layer in layers.items()}
    return BlockTuned(tuned, before, best_loss, best_step, history)

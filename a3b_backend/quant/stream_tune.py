"""End-to-end tuning in the layer pipeline's memory (`a3b-quantize --tune-epochs N`, default 1).

The quantized linears' metadata and the AWQ norms' gains (quant/tune.py's TunedLinear and
NormGain) are fitted so that the whole student's next-token distribution follows the source's,
over the converted layers' shards with one decoder layer built at a time (activation
checkpointing at layer boundaries), never the whole model in memory:
- the teacher's distribution: the float chain's last hidden states, carried beside the quantized
  chain through the conversion, through the final norm and lm_head;
- a step: one calibration window forward through the layers, each built from its shard (its
  dense linears as TunedLinears and its AWQ norms' gains, kept in memory between uses: packed
  codes and metadata; every other tensor read again), keeping each layer's input; the KL at the
  head; then backward from the last layer, each layer's forward recomputed from its input and the
  gradient handed down; then one Adam step over every layer's parameters (tune.make_optimizer's);
- held-out windows (every HELD_OUT_EVERY-th, not trained on) score the KL before tuning and at
  each evaluation, all of them through a layer once it is built, and the best evaluation is kept,
  the untuned one included: the tuning never ends worse on them than the untuned conversion.
Resumable: the parameters, Adam's state and the best evaluation are saved at each evaluation.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from torch.nn.utils import parametrize
from tqdm import tqdm

from a3b_backend.quant import calibrate
from a3b_backend.quant.block_tune import held_out_windows
from a3b_backend.quant.checkpoint import write_atomic
from a3b_backend.quant.convert import fold_norm_scale
from a3b_backend.quant.format import KINDS, A3BConfig, A3BWeight, dequantize
from a3b_backend.quant.names import Layout
from a3b_backend.quant.tune import NormGain, TunedLinear, TuneConfig, kl_per_token, make_optimizer

STATE = "end_to_end.pt"  # in DST.partial: the tuning's parameters, Adam's state and best evaluation so far
EVALUATIONS_PER_EPOCH = 4
# logits computed at once at the head: a 512-token window at Qwen3.6's 248,320-token vocabulary is
# 0.5 GB of float32 logits, and the KL's log-softmaxes and their gradients hold several times that
HEAD_LOGITS = 2**25
# lm_head's weight stays as stored (bf16: 1 GB at Qwen3.6's vocabulary, 2 GB in float32), made
# float32 this many vocabulary rows at a time for the logits and for their gradient
HEAD_ROWS = 2**14
# sequential.load_layer: a meta decoder layer filled from a source's tensors of layer `index`
LoadLayer = Callable[[torch.nn.Module, object, int], tuple[torch.nn.Module, set[str]]]


@dataclasses.dataclass(frozen=True)
class Head:
    """The model's final norm and lm_head: final hidden states -> logits."""
    norm: torch.nn.Module
    lm_head: torch.nn.Linear

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return _Logits.apply(self.norm(hidden), self.lm_head.weight)

    def chunks(self, tokens: int) -> list[slice]:
        """Token slices whose logits are at most HEAD_LOGITS values (at least one token each)."""
        step = max(1, HEAD_LOGITS // self.lm_head.weight.shape[0])
        return [slice(start, start + step) for start in range(0, tokens, step)]


class _Logits(torch.autograd.Function):
    """x @ weight.T in float32, the weight (not tuned) made float32 HEAD_ROWS rows at a time."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return torch.cat([x @ rows.float().T for rows in weight.split(HEAD_ROWS)], -1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (weight,) = ctx.saved_tensors
        return sum(g @ rows.float() for g, rows in zip(grad.split(HEAD_ROWS, -1), weight.split(HEAD_ROWS))), None


@dataclasses.dataclass(frozen=True)
class StoredLayer:
    """A converted layer's shard, read as `sequential.load_layer` reads a source: A3B weights dequantized."""
    path: Path
    layout: Layout
    by_layer: dict[int, list[str]]
    tensors: dict[str, torch.Tensor]
    config: A3BConfig
    replaced: frozenset[str]  # A3B weights the caller replaces once loaded: read as uninitialised tensors

    @classmethod
    def open(cls, path: Path, layout: Layout, index: int, config: A3BConfig,
             replaced: frozenset[str] = frozenset(), device: torch.device = torch.device("cpu")) -> "StoredLayer":
        tensors = load_file(path, device=str(device))  # dequantized where the layer runs
        names = [n for n in tensors if not any(n.endswith(f"_{kind}") for kind in KINDS)]
        names += [n.removesuffix("_packed") for n in tensors if n.endswith("_packed")]
        return cls(path, layout, {index: names}, tensors, config, replaced)

    def read(self, name: str) -> torch.Tensor:
        if name in self.tensors:
            return self.tensors[name]
        weight = A3BWeight.from_tensors(self.tensors, name)
        if name in self.replaced:
            return torch.empty(weight.out_features, weight.in_features)
        return dequantize(weight, self.config)



@dataclasses.dataclass
class EndToEndTuned:
    held_out_before: float  # KL per token on the held-out windows, untuned
    held_out_after: float  # of what is kept
    best_step: int  # 0: no evaluation beat the untuned conversion, which is kept
    steps: int
    history: list[tuple[int, float]]
    timing: dict[str, float]  # Timing's totals of this run (a resumed run's part)

    def to_json(self) -> dict:
        return {"method": "end-to-end, layer by layer", "steps": self.steps,
                "held_out_kl": [round(self.held_out_before, 6), round(self.held_out_after, 6)],
                "best_step": self.best_step, "kept_untuned": self.best_step == 0,
                "history": [[step, round(kl, 6)] for step, kl in self.history],
                "timing": {k: round(v, 2) for k, v in self.timing.items()}}


class ConvertedLayers:
    """The converted layers, built one at a time from their shards, with the tuned parameters
    (TunedLinears, NormGains) made on first use and kept."""

    def __init__(self, load_layer: LoadLayer, shard_of: Callable[[int], Path], meta_layers: list[torch.nn.Module],
                 layout: Layout, config: A3BConfig, zero_centred: bool,
                 scales: Callable[[int], dict[str, torch.Tensor]], tune_config: TuneConfig, device: torch.device):
        self.load_layer, self.shard_of, self.meta, self.layout, self.config = (load_layer, shard_of, meta_layers,
                                                                               layout, config)
        self.zero_centred, self.scales, self.tune_config, self.device = zero_centred, scales, tune_config, device
        self.linears: dict[int, dict[str, TunedLinear]] = {}  # per layer, by module name within it
        self.gains: dict[int, dict[str, NormGain]] = {}

    def __len__(self) -> int:
        return len(self.meta)

    def build(self, index: int) -> torch.nn.Module:
        prefix = f"model.layers.{index}."
        # the linears its TunedLinears replace are not dequantized
        replaced = frozenset(self._checkpoint(prefix + name) for name in self.linears.get(index, {}))
        stored = StoredLayer.open(self.shard_of(index), self.layout, index, self.config, replaced, self.device)
        layer, _ = self.load_layer(copy.deepcopy(self.meta[index]), stored, index)
        if index not in self.linears:
            self._make_trainables(index, layer, stored, prefix)
        for name, linear in self.linears[index].items():
            parent, _, attr = name.rpartition(".")
            setattr(layer.get_submodule(parent), attr, linear)
        for norm, gain in self.gains[index].items():
            parametrize.register_parametrization(layer.get_submodule(norm), "weight", gain)
        return layer.to(self.device)

    def _make_trainables(self, index: int, layer: torch.nn.Module, stored: StoredLayer, prefix: str) -> None:
        dense = calibrate.quantized_linears(layer, prefix)
        self.linears[index] = {
            name: TunedLinear(A3BWeight.from_tensors(stored.tensors, self._checkpoint(prefix + name)), self.config,
                              self.tune_config.block_codes_lr > 0).to(self.device) for name in dense}
        scaled = {key.split(":", 1)[1] for key in self.scales(index) if key.startswith("scale:")}
        norms = [norm for norm, members in calibrate.groups([prefix + n for n in dense]).items()
                 if all(m in scaled for m in members)]
        self.gains[index] = {norm.removeprefix(prefix): NormGain(layer.get_submodule(norm.removeprefix(prefix))
                                                                 .weight.numel(), self.zero_centred).to(self.device)
                             for norm in norms}

    def _checkpoint(self, module: str) -> str:
        return self.layout.checkpoint(module) + ".weight"

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for index in sorted(self.linears) for m in (*self.linears[index].values(),
                                                              *self.gains[index].values()) for p in m.parameters()]

    def tuned_tensors(self, index: int, read_source: Callable[[str], torch.Tensor]
                      ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Layer `index`'s shard and its folded scales as tuned: each TunedLinear's stored metadata;
        each gained norm folded from the source's weight (`read_source`, by checkpoint name) with
        its AWQ scale over its gain, the scale its linears and its other readers record for the LoRA fold
        likewise."""
        prefix = f"model.layers.{index}."
        tensors, scales = load_file(self.shard_of(index)), dict(self.scales(index))
        for name, linear in self.linears[index].items():
            checkpoint = self._checkpoint(prefix + name)
            tensors.update(linear.cpu().stored(A3BWeight.from_tensors(tensors, checkpoint)).tensors(checkpoint))
        members = calibrate.groups([prefix + n for n in self.linears[index]])
        readers = [key.removeprefix("scale:") for key in scales if key.startswith("scale:")
                   and calibrate.reads_folded_norm(key.removeprefix("scale:"))]
        for norm, gain in self.gains[index].items():
            factor = gain.log_gain.detach().cpu().exp()
            scale = scales[f"scale:{members[prefix + norm][0]}"] / factor
            for module in members[prefix + norm] + [r for r in readers if calibrate.norm_for(r) == prefix + norm]:
                scales[f"scale:{module}"] = scale
            checkpoint = self._checkpoint(prefix + norm)
            tensors[checkpoint] = fold_norm_scale(read_source(checkpoint), scale, self.zero_centred)
        return tensors, scales


class Timing:
    """Where a tuning's time went, by phase (train: the training steps; evaluation): seconds in all
    (`{phase}_s`), building layers (`{phase}_build_s`) and at the head (`{phase}_head_s`: the
    logits, the KL and its gradient), and the windows and builds counted."""

    def __init__(self):
        self.totals: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, key: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.count(f"{key}_s", time.perf_counter() - started)

    def count(self, key: str, amount: float = 1) -> None:
        self.totals[key] = self.totals.get(key, 0) + amount


def head_kl(head: Head, hidden: torch.Tensor, teacher_hidden: torch.Tensor, backward: bool) -> float:
    """KL(teacher || student) per token at the head, a chunk of tokens at a time; with `backward`,
    each chunk's gradient reaches `hidden` before the next chunk's logits are made."""
    tokens, total = hidden.shape[-2], 0.0
    for part in head.chunks(tokens):
        with torch.no_grad():
            teacher = head(teacher_hidden[..., part, :].to(hidden.device))
        student = hidden[..., part, :]
        kl = kl_per_token(head(student), teacher) * (student.shape[-2] / tokens)
        if backward:
            kl.backward()
        total += float(kl.detach())
    return total


def layer_output(out: torch.Tensor | tuple) -> torch.Tensor:
    """A decoder layer's hidden states, whichever form its forward returns."""
    return out[0] if isinstance(out, tuple) else out


def tune_layers(layers: ConvertedLayers, embedded: list[torch.Tensor], calls: list[list[tuple[tuple, dict]]],
                teacher_hidden: list[torch.Tensor], head: Head, tune_config: TuneConfig, state_path: Path
                ) -> EndToEndTuned:
    """Tunes `layers`' parameters so the student, window i's embedding through every layer
    (`calls[layer][i]`: its other arguments) and `head`, follows `head(teacher_hidden[i])`."""
    device = layers.device
    held_out = held_out_windows(len(embedded))
    train = [i for i in range(len(embedded)) if i not in set(held_out)] or list(range(len(embedded)))
    held_out = held_out or train
    steps = tune_config.epochs * len(train)
    evaluate_every = max(1, len(train) // EVALUATIONS_PER_EPOCH)

    timing = Timing()

    def build(index: int, phase: str) -> torch.nn.Module:
        timing.count(f"{phase}_builds")
        with timing(f"{phase}_build"):
            return layers.build(index)

    def forward(i: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Window i through every layer, without gradients: each layer's input, and the last output."""
        inputs, hidden = [], embedded[i].to(device)
        with torch.no_grad():
            for index in range(len(layers)):
                args, kwargs = calls[index][i]
                inputs.append(hidden)
                hidden = layer_output(build(index, "train")(hidden, *args, **kwargs))
        return inputs, hidden

    def evaluate() -> float:
        """The mean KL over the held-out windows, run through each layer together: one build a layer."""
        hidden = {i: embedded[i].to(device) for i in held_out}
        with timing("evaluation"), torch.no_grad():
            for index in range(len(layers)):
                layer = build(index, "evaluation")
                for i in held_out:
                    args, kwargs = calls[index][i]
                    hidden[i] = layer_output(layer(hidden[i], *args, **kwargs))
                del layer
            with timing("evaluation_head"):
                total = sum(head_kl(head, hidden[i], teacher_hidden[i], backward=False) for i in held_out)
        timing.count("evaluation_windows", len(held_out))
        return total / len(held_out)

    def train_step(i: int) -> float:
        with timing("train"):
            inputs, hidden = forward(i)
            hidden = hidden.detach().requires_grad_(True)
            with timing("train_head"):
                loss = head_kl(head, hidden, teacher_hidden[i], backward=True)
            grad = hidden.grad
            for index in reversed(range(len(layers))):
                args, kwargs = calls[index][i]
                x = inputs[index].detach().requires_grad_(index > 0)
                out = layer_output(build(index, "train")(x, *args, **kwargs))
                if out.requires_grad:
                    out.backward(grad)
                grad = x.grad if index > 0 else None
        timing.count("train_windows")
        return loss

    for index in range(len(layers)):  # the trainables made before the optimizer takes them
        layers.build(index)
    params = layers.parameters()
    optimizer, schedule = _optimizer_over(layers, tune_config, steps)
    if state_path.exists():
        state = torch.load(state_path)
        _load_values(params, state["params"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        done, history, best = state["step"], state["history"], state["best"]
        print(f"resuming the end-to-end tuning at step {done} of {steps}")
    else:
        done, history = 0, [(0, evaluate())]
        best = {"step": 0, "kl": history[0][1], "params": _values(params)}
    with tqdm(range(done, steps), desc="tuning end to end, layer by layer", unit="window", initial=done,
              total=steps) as bar:
        for step in bar:
            optimizer.zero_grad()
            loss = train_step(train[step % len(train)])
            optimizer.step()
            schedule.step()
            bar.set_postfix(kl=f"{loss:.4f}", held_out=f"{history[-1][1]:.4f}")
            if (step + 1) % evaluate_every == 0 or step + 1 == steps:
                history.append((step + 1, evaluate()))
                if history[-1][1] < best["kl"]:
                    best = {"step": step + 1, "kl": history[-1][1], "params": _values(params)}
                state = {"params": _values(params), "optimizer": optimizer.state_dict(),
                              "schedule": schedule.state_dict(), "step": step + 1, "history": history,
                              "best": best}
                write_atomic(lambda p: torch.save(state, p), state_path)
    _load_values(params, best["params"])
    return EndToEndTuned(history[0][1], best["kl"], best["step"], steps, history, timing.totals)


def _optimizer_over(layers: ConvertedLayers, tune_config: TuneConfig, steps: int):
    linears = {f"{i}:{n}": m for i, by_name in layers.linears.items() for n, m in by_name.items()}
    gains = {f"{i}:{n}": m for i, by_name in layers.gains.items() for n, m in by_name.items()}
    return make_optimizer(linears, gains, tune_config, steps)


def _values(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.detach().cpu().clone() for p in params]


def _load_values(params: list[torch.nn.Parameter], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, value in zip(params, values, strict=True):
            p.copy_(value)


def write_tuned(layers: ConvertedLayers, read_source: Callable[[str], torch.Tensor],
                tuned_shard_of: Callable[[int], Path], tuned_scales_of: Callable[[int], Path]) -> None:
    """Each layer's tuned shard and folded scales beside its untuned ones (which the tuning reads
    and a resumed run reads again), written once."""
    for index in range(len(layers)):
        if tuned_shard_of(index).exists():
            continue
        tensors, scales = layers.tuned_tensors(index, read_source)
        if scales:
            # clones: a norm's linears share its scale, and safetensors refuses shared storage
            write_atomic(lambda p: save_file({k: v.clone() for k, v in scales.items()}, p), tuned_scales_of(index))
        write_atomic(lambda p: save_file(tensors, p, metadata={"format": "pt"}), tuned_shard_of(index))


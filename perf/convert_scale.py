"""make bench-convert-scale: the layer pipeline (a3b-quantize) on random
checkpoints at Qwen3.6-35B-A3B's real layer width, to show its memory stays one layer's and
to project the whole model's conversion time on this CPU and on a GPU host.

The checkpoints have 2 and 4 decoder layers of the real width (hidden 2048, 256 routed
experts top-8 with intermediate 512, a shared expert of 512, Gated DeltaNet 16 QK / 32 V
heads of 128, gated attention 16 Q / 2 KV heads of 256, 3 DeltaNet layers to 1 attention
layer) and the real vocabulary (248,320), in the published layout (model.language_model.*,
stacked experts); they are written one layer at a time, never whole in memory. Each is
converted in a process of its own with the pipeline's defaults but untuned (at the bench's 1,024 tokens
an expert sees too few of its own for error-compensating rounding, so experts round nearest),
and the report gives its peak RSS, the seconds per layer by phase (the conversion's own
a3b/conversion.json), the rounding throughput of expert matrices, and a projection to 40
layers at the default 65,536 tokens: on this CPU from those figures, on an H100 host from a
roofline count of the code's own kernels (GpuTimeEstimate; not a run). Each checkpoint is then
converted again tuned end to end (--tune-epochs, default 1; quant/stream_tune.py), and the report
gives the tuning's seconds per window per layer and its projection to the whole model likewise.

--conversions-only --device cuda: the conversions' table alone, on a GPU (make gpu-check).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode

from a3b_backend.bench.perf_report import machine
from a3b_backend.prepare.qwen_tiny import FULL_SIZE
from a3b_backend.profiles import LICENCE_TEXTS, PROJECT_ROOT
from a3b_backend.quant.format import A3BConfig, dequantize, quantize, quantize_stack
from a3b_backend.quant.gptq import quantize_gptq, quantize_gptq_stack
from a3b_backend.quant import calibrate, experts
from a3b_backend.quant.block_tune import held_out_windows
from a3b_backend.quant.sequential import (REPORT, SEQ_LEN, Source, final_head, layer_inputs, load_layer,
                                          run_layer, skeleton, windows_of)
from a3b_backend.quant.stream_tune import EVALUATIONS_PER_EPOCH, ConvertedLayers, layer_output
from a3b_backend.quant.tune import TuneConfig, kl_per_token

QWEN_TINY = PROJECT_ROOT / "models" / "qwen3.6-tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
CALIBRATION_TEXT = LICENCE_TEXTS / "GPL-3"
FULL_LAYERS = FULL_SIZE["num_hidden_layers"]
PHASES = ("statistics", "rounding", "tuning", "passing_on", "total")  # a3b/conversion.json's, per layer
# experts per rounding group (quant/experts.py), by device: their matrices are 512 x 2048
GROUP = {device: weights // (512 * 2048) for device, weights in experts.GROUP_WEIGHTS.items()}
EXPERT_WEIGHTS = FULL_SIZE["num_experts"] * 3 * FULL_SIZE["moe_intermediate_size"] * FULL_SIZE["hidden_size"]


def config_for(layers: int) -> dict:
    config = json.loads((QWEN_TINY / "config.json").read_text())
    config.update(FULL_SIZE, num_hidden_layers=layers,
                  layer_types=[config["layer_types"][i % 4] for i in range(layers)], mtp_num_hidden_layers=0)
    return config


def random_tensor(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):  # zero-centred RMSNorms: weight 0 is a gain of 1
        return torch.zeros(shape, dtype=torch.bfloat16)
    if name.endswith("A_log"):
        return torch.rand(shape, generator=generator).mul(15).add(1).log().to(torch.bfloat16)
    if name.endswith("dt_bias"):
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)


def write_checkpoint(out: Path, layers: int) -> Path:
    """A random checkpoint of `layers` real-width layers, one shard per layer, built one layer at a time."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "config.json").exists():
        return out
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    config = config_for(layers)
    (partial / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        shutil.copy2(QWEN_TINY / name, partial / name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    shapes = {name: t.shape for name, t in skeleton.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    for index in range(layers):
        prefix = f"model.layers.{index}."
        save_file({name.replace("model.", "model.language_model.", 1): random_tensor(name, shape, generator)
                   for name, shape in shapes.items() if name.startswith(prefix)},
                  partial / f"layer-{index:05d}.safetensors", metadata={"format": "pt"})
    save_file({name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name:
               random_tensor(name, shape, generator)
               for name, shape in shapes.items() if not name.startswith("model.layers.")},
              partial / "rest.safetensors", metadata={"format": "pt"})
    os.replace(partial, out)
    return out


def convert(src: Path, dst: Path, tokens: int, device: str, text: Path | None, tune_epochs: int = 0) -> dict:
    """One conversion in a process of its own, on `text` (None: a3b-quantize's built-in), tuned end to end
    for `tune_epochs` -> its report (its peak RSS: that process's own high-water mark, which getrusage of the
    child would not give: ru_maxrss carries this process's over execve), with the config's record of the
    end-to-end tuning where it ran."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.rmtree(dst.with_name(dst.name + ".partial"), ignore_errors=True)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "a3b_backend.quant.convert", str(src), str(dst),
                           *(["--calibration-text", str(text)] if text else []), "--calibration-tokens", str(tokens),
                           "--device", device, "--tune-epochs", str(tune_epochs)])
    if done.returncode != 0:
        raise SystemExit(f"conversion of {src} failed")
    report = json.loads((dst / REPORT).read_text())
    tuning = json.loads((dst / "config.json").read_text())["quantization_config"].get("end_to_end_tuning")
    return {**report, "wall_s": time.perf_counter() - started, **({"end_to_end_tuning": tuning} if tuning else {})}


def anisotropic_inputs(generator: torch.Generator, width: int = 2048) -> Callable[[int], torch.Tensor]:
    """A sampler of inputs with a decaying spectrum and a few outlier channels, as a trained model's are."""
    basis = torch.linalg.qr(torch.randn(width, width, generator=generator))[0]
    spectrum = torch.logspace(0, -3, width).sqrt()
    scale = torch.ones(width)
    scale[torch.randperm(width, generator=generator)[:8]] = 20
    return lambda tokens: ((torch.randn(tokens, width, generator=generator) * spectrum) @ basis.T) * scale


def rounding_throughput() -> dict[str, float]:
    """Weights per second of nearest and error-compensating rounding of 512 x 2048 expert matrices,
    one alone and stacked as quant/experts.py rounds a group."""
    config = A3BConfig()
    generator = torch.Generator().manual_seed(1)
    weights = torch.randn(16, 512, 2048, generator=generator) * 0.02
    x = anisotropic_inputs(generator)(4096)
    hessian = x.T @ x / len(x)
    cpu = GROUP["cpu"]
    runs = {
        "nearest, 1 expert": (1, lambda: quantize(weights[0], config, col_importance=hessian.diagonal())),
        f"nearest, {cpu} experts stacked": (cpu, lambda: quantize_stack(weights[:cpu], config,
                                                                      hessian.diagonal().expand(cpu, -1))),
        "gptq, 1 expert": (1, lambda: quantize_gptq(weights[0], config, hessian)),
        f"gptq, {cpu} experts stacked": (cpu, lambda: quantize_gptq_stack(weights[:cpu], config,
                                                                          hessian.expand(cpu, -1, -1))),
        "gptq, 16 experts stacked": (16, lambda: quantize_gptq_stack(weights, config, hessian.expand(16, -1, -1))),
    }
    out = {}
    for name, (stacked, run) in runs.items():
        run()  # warm-up
        started = time.perf_counter()
        run()
        out[name] = stacked * weights[0].numel() / (time.perf_counter() - started)
    return out


def held_out_errors(token_counts: tuple[int, ...] = (128, 256, 512, 1024, 2048)) -> dict[int, float]:
    """Error-compensating over nearest rounding's output error on held-out tokens, for one 512 x 2048
    expert whose Hessian comes from `tokens` of its own: where quant/experts.py's TOKENS_PER_INPUT
    comes from."""
    config = A3BConfig()
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(512, 2048, generator=generator) * 0.02
    sample = anisotropic_inputs(generator)
    held_out = sample(4096)
    out = {}
    for tokens in token_counts:
        x = sample(tokens)
        hessian = x.T @ x / tokens
        errors = [float(((held_out @ (dequantize(q, config) - weight).T) ** 2).mean())
                  for q in (quantize_gptq(weight, config, hessian), quantize(weight, config, hessian.diagonal()))]
        out[tokens] = errors[0] / errors[1]
    return out


@dataclasses.dataclass(frozen=True)
class GpuHost:
    """What the GPU-host projection assumes of one H100 SXM: 70% of its datasheet's HBM3 bandwidth
    (3.35 TB/s) and FP32 rate (67 TFLOP/s; torch leaves TF32 off for float32 matmuls), 6 us for a
    kernel's launch and shortest run, 20 us for an op that waits on the GPU (a data-dependent
    shape: nonzero, a boolean mask, unique, .item()), no overlap between kernels, and PCIe 5 at
    half its 50 GB/s for moving a layer."""
    bytes_per_s: float = 0.7 * 3.35e12
    flops: float = 0.7 * 67e12
    kernel_s: float = 6e-6
    sync_s: float = 20e-6
    pcie_bytes_per_s: float = 25e9


MATMULS = {torch.ops.aten.mm.default: 0, torch.ops.aten.bmm.default: 0, torch.ops.aten.addmm.default: 1,
           torch.ops.aten.baddbmm.default: 1, torch.ops.aten.linalg_solve_triangular.default: 0,
           torch.ops.aten.linalg_cholesky_ex.default: 0}  # -> which argument's last dimension is the reduction
SYNCS = {torch.ops.aten.nonzero.default, torch.ops.aten._local_scalar_dense.default,
         torch.ops.aten._unique2.default, torch.ops.aten.masked_select.default}
FREE = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
        torch.ops.aten.empty_like.default}


class GpuTimeEstimate(TorchDispatchMode):
    """Runs every op on the CPU as usual and keeps what it would take on a GPU host: per kernel the
    longest of its launch, its bytes (inputs and outputs) over the bandwidth and its matmul FLOPs over
    the FP32 rate; views and allocations cost nothing, ops that wait on the GPU cost a sync. A
    roofline count of the code's real ops, not a measurement."""

    def __init__(self, host: GpuHost = GpuHost()):
        super().__init__()
        self.host = host
        self.ops: list[tuple[int, float, bool]] = []  # (bytes, FLOPs, waits on the GPU) per kernel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func in FREE:
            return out
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        flops = 0.0
        if func in MATMULS:
            result = out[0] if isinstance(out, tuple) else out
            flops = 2.0 * result.numel() * args[MATMULS[func]].shape[-1]
        waits = func in SYNCS or (func is torch.ops.aten.index.Tensor
                                  and any(i is not None and i.dtype == torch.bool for i in args[1]))
        self.ops.append((sum(t.numel() * t.element_size() for t in tensors), flops, waits))
        return out

    def seconds(self, scale: float = 1.0) -> float:
        """The kernels' time; scale: their bytes and FLOPs times this (the same ops on `scale` times the data)."""
        host = self.host
        return sum(max(host.sync_s if waits else host.kernel_s, scale * nbytes / host.bytes_per_s,
                       scale * flops / host.flops) for nbytes, flops, waits in self.ops)

    def summary(self, scale: float = 1.0) -> dict[str, float]:
        return {"seconds": self.seconds(scale), "kernels": len(self.ops), "syncs": sum(w for _, _, w in self.ops)}


def gpu_layer_window(src: Path) -> dict[str, float]:
    """Layer 0 of `src` on one calibration window, counted by GpuTimeEstimate: seconds of its statistics
    pass (as quantize_layer records it, error-compensating) and of a plain forward (passing on)."""
    source = Source.open(src)
    windows = windows_of(src, CALIBRATION_TEXT, SEQ_LEN)
    hidden, calls, layers = layer_inputs(skeleton(src), source, windows)
    layer, _ = load_layer(layers[0], source, 0)
    with GpuTimeEstimate() as statistics:
        calibrate.record(layer, lambda: run_layer(layer, hidden, calls[0]), True, "model.layers.0.", {})
    with GpuTimeEstimate() as forward:
        run_layer(layer, hidden, calls[0])
    return {"statistics": statistics.summary(), "passing_on": forward.summary()}


def gpu_expert_groups(groups: tuple[int, ...]) -> dict[int, dict[str, float]]:
    """A group of routed experts (512 x 2048) rounded error-compensating, gate, up and down, by
    GpuTimeEstimate, for each group size in `groups`: 4 are rounded and counted, and each kernel's bytes
    and FLOPs scaled to the group (the column loop's kernels are the same in number for any group;
    their data grows with it)."""
    config = A3BConfig()
    generator = torch.Generator().manual_seed(3)
    counted_experts = 4
    x = anisotropic_inputs(generator)(2048)
    gate_up_h = (x.T @ x / len(x)).expand(counted_experts, -1, -1)
    down_h = (x[:, :512].T @ x[:, :512] / len(x)).expand(counted_experts, -1, -1)
    with GpuTimeEstimate() as counted:
        for _ in range(2):  # gate, up
            quantize_gptq_stack(torch.randn(counted_experts, 512, 2048, generator=generator) * 0.02, config,
                                gate_up_h)
        quantize_gptq_stack(torch.randn(counted_experts, 2048, 512, generator=generator) * 0.02, config, down_h)
    return {group: counted.summary(group / counted_experts) for group in groups}


def gpu_tune_window(src: Path, dst: Path) -> dict[str, dict[str, float] | int]:
    """The end-to-end tuning's parts on one calibration window, counted by GpuTimeEstimate: layer 0 of
    `dst` (`src` converted) built from its shard ("build"), run forward ("forward": an evaluation's and a
    training step's first pass), run again with gradients and backward ("recompute_backward": the training
    step's second pass); the head's logits and KL for a training step (with its gradient) and for an
    evaluation; and the shard's bytes, which a GPU host moves over PCIe at each build."""
    source = Source.open(src)
    hidden, calls, meta_layers = layer_inputs(skeleton(src), source, windows_of(src, CALIBRATION_TEXT, SEQ_LEN))
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    shard = dst / next(file for name, file in index.items() if ".layers.0." in name)
    layers = ConvertedLayers(load_layer, lambda i: shard, meta_layers, source.layout, A3BConfig(), True,
                             lambda i: {}, TuneConfig(), torch.device("cpu"))
    layers.build(0)  # its TunedLinears, made on first use and kept
    args, kwargs = calls[0][0]
    counted = {}
    with GpuTimeEstimate() as counted["build"]:
        layer = layers.build(0)
    with GpuTimeEstimate() as counted["forward"], torch.no_grad():
        layer_output(layer(hidden[0], *args, **kwargs))
    with GpuTimeEstimate() as counted["recompute_backward"]:
        x = hidden[0].clone().requires_grad_(True)
        out = layer_output(layer(x, *args, **kwargs))
        out.backward(torch.ones_like(out))
    del layer, out, x
    head = final_head(src, source, torch.device("cpu"))
    with GpuTimeEstimate() as counted["head_train"]:
        with torch.no_grad():
            teacher = head(hidden[0])  # the float chain's hidden states in a tuning: the same shape
        student = hidden[0].clone().requires_grad_(True)
        kl_per_token(head(student), teacher).backward()
    with GpuTimeEstimate() as counted["head_evaluation"], torch.no_grad():
        kl_per_token(head(hidden[0]), head(hidden[0]))
    return {**{part: estimate.summary() for part, estimate in counted.items()}, "shard_bytes": shard.stat().st_size}


def plot(results: dict[int, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(results)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(layers, [results[n]["peak_rss_gib"] for n in layers], marker="o")
    ax.set_xlabel("decoder layers (Qwen3.6-35B-A3B width)")
    ax.set_ylabel("peak RSS, GiB")
    ax.set_ylim(bottom=0)
    ax.set_title("a3b-quantize, one decoder layer at a time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def gram_flops_per_s() -> float:
    """x^T x of 2048 tokens of width 2048, the expert Hessians' product."""
    x = torch.randn(2048, 2048)
    x.T @ x
    started = time.perf_counter()
    x.T @ x
    return 2 * 2048**3 / (time.perf_counter() - started)


FULL_TOKENS = 128 * 512  # a3b-quantize's default calibration budget, in SEQ_LEN windows
LAYER_FP32_BYTES = 3.5e9  # one real-width layer in float32, moved to the GPU and back


def projection(results: dict[int, dict], throughput: dict[str, float], flops: float, tokens: int,
               gpu: dict[str, dict]) -> list[tuple[str, float, float, str]]:
    """Seconds per layer at FULL_TOKENS, by part: (part, this CPU, a GPU host, how each was reached)."""
    per = [d for r in results.values() for d in r["per_layer"]]
    mean = {k: sum(d[k] for d in per) / len(per) for k in PHASES}
    windows, host = FULL_TOKENS // SEQ_LEN, GpuHost()
    # At the full budget an expert averages FULL_TOKENS * 8 / 256 = 2048 own tokens: past TOKENS_PER_INPUT
    # for its gate/up (1024) and down (256), so its projections round error-compensating (here: nearest).
    experts_nearest = EXPERT_WEIGHTS / throughput[f"nearest, {GROUP['cpu']} experts stacked"]
    experts_gptq = EXPERT_WEIGHTS / throughput[f"gptq, {GROUP['cpu']} experts stacked"]
    hessian_flops = 2 * 8 * FULL_TOKENS * (2048**2 + 512**2)
    group, cpu_group = GROUP["cuda"], GROUP["cpu"]
    by_group = {int(size): counted for size, counted in gpu["experts"].items()}
    rounding_gpu = {size: FULL_SIZE["num_experts"] / size * counted["seconds"] for size, counted in by_group.items()}
    gathering = FULL_SIZE["num_experts"] * windows * host.sync_s  # each expert's tokens, a boolean mask per window
    host_part = mean["total"] - sum(mean[k] for k in PHASES if k != "total")
    hidden_bytes = FULL_TOKENS * 2048 * 4
    forward_gpu = windows * (gpu["window"]["statistics"]["seconds"] + gpu["window"]["passing_on"]["seconds"])
    return [
        ("statistics and passing on (forward passes over the windows)",
         (mean["statistics"] + mean["tuning"] + mean["passing_on"]) * FULL_TOKENS / tokens, forward_gpu,
         f"CPU: measured here, times {FULL_TOKENS // tokens} for the tokens; GPU: one window through layer 0 "
         f"counted ({gpu['window']['statistics']['kernels'] + gpu['window']['passing_on']['kernels']} kernels, "
         f"{gpu['window']['statistics']['syncs']} syncs), times {windows}"),
        ("routed experts' rounding, error-compensating",
         experts_gptq, rounding_gpu[group] + gathering,
         f"CPU: {cpu_group} stacked at the measured rate; GPU: groups of {group} counted "
         f"({by_group[group]['kernels']} kernels a group, as many for a group of {cpu_group}: in groups of "
         f"{cpu_group} it would take {rounding_gpu[cpu_group]:.0f} s) and a sync per expert per window to "
         "gather its tokens"),
        ("routed experts' Hessians", hessian_flops / flops, hessian_flops / host.flops,
         f"{hessian_flops / 1e12:.1f} TFLOP of x^T x: CPU at the measured {flops / 1e9:.0f} GFLOP/s"),
        ("the other linears' rounding and AWQ search", mean["rounding"] - experts_nearest,
         mean["rounding"] - experts_nearest, "measured here, not growing with the tokens; the GPU's not "
                                             "counted, taken as this CPU's"),
        ("reading the layer, writing its shard and the hidden states",
         host_part + hidden_bytes / 1e9, host_part + hidden_bytes / 1e9 + 2 * LAYER_FP32_BYTES / host.pcie_bytes_per_s,
         f"measured here, plus {hidden_bytes / 2**30:.2f} GiB of hidden states at 1 GB/s; GPU: plus the layer to "
         f"the GPU and back over PCIe"),
    ]


def tune_schedule(windows: int, epochs: int) -> tuple[int, int, int]:
    """The end-to-end tuning's (training steps, evaluations, held-out windows) over `windows` calibration
    windows for `epochs`, as stream_tune.tune_layers schedules them."""
    train = windows - len(held_out_windows(windows))
    held_out = len(held_out_windows(windows)) or train  # too few to spare: the training windows score it
    steps, every = epochs * train, max(1, train // EVALUATIONS_PER_EPOCH)
    return steps, 1 + -(-steps // every), held_out


def tune_parts(tuned: dict[int, dict]) -> dict[str, float]:
    """Per part, seconds on this CPU, from the largest tuned conversion's record: a layer's build; a layer's
    compute per window in a training step (its forward, recomputed forward and backward) and in an
    evaluation; the head's per window in each."""
    layers = max(tuned)
    t = tuned[layers]["end_to_end_tuning"]["timing"]
    return {"build": (t["train_build_s"] + t["evaluation_build_s"]) / (t["train_builds"] + t["evaluation_builds"]),
            "train_layer": (t["train_s"] - t["train_build_s"] - t["train_head_s"]) / t["train_windows"] / layers,
            "evaluation_layer": ((t["evaluation_s"] - t["evaluation_build_s"] - t["evaluation_head_s"])
                                 / t["evaluation_windows"] / layers),
            "train_head": t["train_head_s"] / t["train_windows"],
            "evaluation_head": t["evaluation_head_s"] / t["evaluation_windows"]}


def gpu_tune_parts(counted: dict) -> dict[str, float]:
    """tune_parts' parts on a GPU host, from gpu_tune_window's counts."""
    pcie = counted["shard_bytes"] / GpuHost().pcie_bytes_per_s
    return {"build": counted["build"]["seconds"] + pcie,
            "train_layer": counted["forward"]["seconds"] + counted["recompute_backward"]["seconds"],
            "evaluation_layer": counted["forward"]["seconds"],
            "train_head": counted["head_train"]["seconds"], "evaluation_head": counted["head_evaluation"]["seconds"]}


def tuning_total(parts: dict[str, float], layers: int, steps: int, evaluations: int, held_out: int) -> float:
    """Seconds of a tuning: each step builds every layer twice; each evaluation builds it once for all
    held-out windows."""
    train = steps * (layers * (2 * parts["build"] + parts["train_layer"]) + parts["train_head"])
    evaluation = evaluations * (layers * (parts["build"] + held_out * parts["evaluation_layer"])
                                + held_out * parts["evaluation_head"])
    return train + evaluation


def tuning_rows(tuned: dict[int, dict], counted: dict | None, epochs: int) -> list[str]:
    """The tuned conversions' table and the end-to-end tuning's projection to the whole model."""
    rows = ["| layers | peak RSS GiB | tuning s | training windows | of which building layers s | at the head s | "
            "evaluation windows | of which building layers s | at the head s |", "|---" * 9 + "|"]
    for layers, r in sorted(tuned.items()):
        t = r["end_to_end_tuning"]["timing"]
        rows.append(f"| {layers} | {r['peak_rss_gib']:.2f} | {r['end_to_end_tuning']['seconds']:.0f} | "
                    f"{t['train_windows']:.0f} in {t['train_s']:.0f} s | {t['train_build_s']:.0f} | "
                    f"{t['train_head_s']:.0f} | {t['evaluation_windows']:.0f} in {t['evaluation_s']:.0f} s | "
                    f"{t['evaluation_build_s']:.0f} | {t['evaluation_head_s']:.0f} |")
    steps, evaluations, held_out = tune_schedule(FULL_TOKENS // SEQ_LEN, epochs)
    cpu = tune_parts(tuned)
    gpu = gpu_tune_parts(counted) if counted else None
    labels = {"build": "a layer built from its shard (each build)",
              "train_layer": "a layer's forward, recomputed forward and backward (per training window)",
              "evaluation_layer": "a layer's forward (per evaluation window)",
              "train_head": "the head: both models' logits, the KL and its gradient (per training window)",
              "evaluation_head": "the head: both models' logits and the KL (per evaluation window)"}
    rows += ["", f"Projection: {epochs} epoch(s) over {FULL_LAYERS} layers at {FULL_TOKENS} tokens: {steps} training "
             f"steps, each building every layer twice, and {evaluations} evaluations of {held_out} held-out windows, "
             f"each building every layer once. This CPU's parts from the {max(tuned)}-layer conversion's record; the "
             "GPU host's counted by GpuTimeEstimate on layer 0 (a DeltaNet layer) and the head, each build plus the "
             "shard over PCIe:", "", "| part, seconds | this host | GPU host (projected) |", "|---|---|---|"]
    rows += [f"| {label} | {cpu[part]:.2f} | " + (f"{gpu[part]:.4f} |" if gpu else "not counted |")
             for part, label in labels.items()]
    totals = {name: tuning_total(parts, FULL_LAYERS, steps, evaluations, held_out)
              for name, parts in (("cpu", cpu), ("gpu", gpu)) if parts}
    rows.append(f"| **the tuning, {FULL_LAYERS} layers** | **{totals['cpu'] / 3600:.1f} h** | "
                + (f"**{totals['gpu'] / 60:.0f} min** |" if "gpu" in totals else "|"))
    return rows


def conversion_rows(results: dict[int, dict]) -> list[str]:
    """The conversions' table: per checkpoint its peak memory and seconds per layer by phase."""
    gpu = any("peak_gpu_gib" in d for r in results.values() for d in r["per_layer"])
    rows = ["| layers | peak RSS GiB | " + ("peak GPU GiB | " if gpu else "") + "wall s | s per layer | "
            "statistics s | rounding s | tuning s | passing on s | linears | expert projections error-compensated |",
            "|---" * (10 + gpu) + "|"]
    for layers, r in sorted(results.items()):
        per = r["per_layer"]
        mean = {k: sum(d[k] for d in per) / len(per) for k in PHASES}
        peak_gpu = f"{max(d['peak_gpu_gib'] for d in per):.2f} | " if gpu else ""
        rows.append(f"| {layers} | {r['peak_rss_gib']:.2f} | {peak_gpu}{r['wall_s']:.0f} | {mean['total']:.0f} | "
                    f"{mean['statistics']:.0f} | {mean['rounding']:.0f} | {mean['tuning']:.0f} | "
                    f"{mean['passing_on']:.0f} | "
                    f"{r['linears']} | {r['expert_projections_compensated']} of {r['expert_projections']} |")
    return rows


def report(data: dict) -> str:
    """The markdown report of a run's saved figures (a --conversions-only run's: its table alone)."""
    results, tokens = data["results"], data["tokens"]
    small, large = min(results), max(results)
    lines = [
        "# The layer pipeline at Qwen3.6-35B-A3B's layer width", "",
        f"Machine: {data['machine']}. Command: `{data['command']}`; conversions on `{data['device']}`. "
        "Random checkpoints of real-width layers (hidden 2048, "
        "256 routed experts top-8 of intermediate 512, shared expert 512, DeltaNet 16/32 heads of 128, attention "
        "16Q/2KV of 256, vocabulary 248,320) in the published layout; each converted by `a3b-quantize "
        f"--tune-epochs 0` (error-compensating rounding, untuned) on {tokens} "
        f"tokens of {data['calibration']}, in a process of its own. Peak RSS: the conversion process's own "
        "high-water mark (VmHWM).", "", *conversion_rows(results), ""]
    if large != small:
        growth = results[large]["peak_rss_gib"] - results[small]["peak_rss_gib"]
        lines += [f"Peak RSS, {large} layers minus {small}: **{growth:+.2f} GiB** (goal: under 0.5); {large} layers "
                  f"peak at {results[large]['peak_rss_gib']:.2f} GiB (goal: under 8).", ""]
    own, down, gate_up = tokens * 8 // 256, experts.compensating_tokens(512), experts.compensating_tokens(2048)
    lines += [f"At {tokens} tokens an expert sees ~{own} of its own; its down_proj rounds error-compensating "
              f"from {down}, its gate/up from {gate_up}"
              + (": here experts round nearest." if own < down else "."), ""]
    if data.get("tuned"):
        epochs = data["tune_epochs"]
        lines += [f"## End-to-end tuning at real width (`--tune-epochs {epochs}`)", "",
                  f"The same checkpoints converted again with `--tune-epochs {epochs}` "
                  "(quant/stream_tune.py; random weights: its held-out KL means nothing here, its time and memory "
                  "do). Peak RSS is the whole conversion's, the tuning included.", "",
                  *tuning_rows(data["tuned"], data.get("gpu_counted", {}).get("tune"), epochs), ""]
    if "gpu_counted" not in data:
        return "\n".join(lines)
    throughput, flops = data["rounding_weights_per_s"], data["gram_flops_per_s"]
    parts = projection(results, throughput, flops, tokens, data["gpu_counted"])
    cpu_layer, gpu_layer = sum(p[1] for p in parts), sum(p[2] for p in parts)
    host = GpuHost()
    return "\n".join(lines + [
        "Rounding 512 x 2048 expert matrices (goals: nearest 5 M weights/s, error-compensating 1 M):", "",
        "| rounding | M weights/s |", "|---|---|",
        *(f"| {name} | {rate / 1e6:.2f} |" for name, rate in throughput.items()), "",
        "Error-compensating over nearest rounding's output error on 4,096 held-out tokens, for one 512 x 2048 "
        "expert whose Hessian comes from its own tokens (inputs with a decaying spectrum and 8 outlier channels; "
        "below 1: error-compensating wins):", "",
        "| own tokens | per input channel | error ratio |", "|---|---|---|",
        *(f"| {n} | {n / 2048:.3g} | {ratio:.2f} |" for n, ratio in data["held_out_error_ratio_by_tokens"].items()),
        "",
        f"## Projection to the whole model: {FULL_LAYERS} layers, {FULL_TOKENS // SEQ_LEN} x {SEQ_LEN} = "
        f"{FULL_TOKENS} calibration tokens", "",
        "Seconds per layer. Every routed expert then sees ~2,048 of its own tokens and rounds error-compensating. "
        "The GPU host's column is not a measurement: `GpuTimeEstimate` runs the code's real ops on the CPU and "
        f"adds, per kernel, the longest of a launch ({host.kernel_s * 1e6:.0f} us; {host.sync_s * 1e6:.0f} us "
        f"for one that waits on the GPU), its bytes at {host.bytes_per_s / 1e12:.2f} TB/s and its matmul FLOPs "
        f"at {host.flops / 1e12:.0f} TFLOP/s (70% of an H100 SXM's HBM3 and FP32 figures), with no overlap; "
        f"PCIe at {host.pcie_bytes_per_s / 1e9:.0f} GB/s.", "",
        "| part | this host s | GPU host s (projected) | how |", "|---|---|---|---|",
        *(f"| {name} | {cpu:.0f} | {gpu_s:.1f} | {how} |" for name, cpu, gpu_s, how in parts),
        f"| **per layer** | **{cpu_layer:.0f}** | **{gpu_layer:.0f}** | |",
        f"| **{FULL_LAYERS} layers** | **{FULL_LAYERS * cpu_layer / 3600:.1f} h** | "
        f"**{FULL_LAYERS * gpu_layer / 60:.0f} min** | |",
    ]) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=1024, help="calibration tokens per conversion")
    parser.add_argument("--work", type=Path, default=PROJECT_ROOT / "models" / "convert_scale")
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "perf" / "results" / "convert_scale")
    parser.add_argument("--device", default="cpu", help="a3b-quantize --device: cpu, or cuda for a GPU host's figures")
    parser.add_argument("--tune-epochs", type=int, default=1,
                        help="each checkpoint converted again with a3b-quantize --tune-epochs N; 0: not")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from the saved JSON")
    parser.add_argument("--calibration-text", type=Path, default=CALIBRATION_TEXT,
                        help="the conversions' text (default GPL-3, ~8K tokens); 'built-in': a3b-quantize's own")
    parser.add_argument("--conversions-only", action="store_true",
                        help="only the conversions' table: no rounding throughput, held-out errors or projection "
                             "(make gpu-check's run on a GPU host)")
    args = parser.parse_args(argv)
    saved = args.out / "convert_scale.json"
    if args.report_only:
        data = json.loads(saved.read_text())
        data["results"] = {int(k): v for k, v in data["results"].items()}
        data["tuned"] = {int(k): v for k, v in data.get("tuned", {}).items()}
        data["held_out_error_ratio_by_tokens"] = {int(k): v for k, v in data["held_out_error_ratio_by_tokens"].items()}
    else:
        text = None if str(args.calibration_text) == "built-in" else args.calibration_text
        results, tuned = {}, {}
        for layers in args.layers:
            src = write_checkpoint(args.work / f"qwen3.6-width-{layers}-layers", layers)
            results[layers] = convert(src, args.work / f"qwen3.6-width-{layers}-layers-a3b", args.tokens,
                                     args.device, text)
            print(f"{layers} layers: peak RSS {results[layers]['peak_rss_gib']:.2f} GiB", flush=True)
            if args.tune_epochs:
                tuned[layers] = convert(src, args.work / f"qwen3.6-width-{layers}-layers-a3b-tuned", args.tokens,
                                        args.device, text, args.tune_epochs)
                print(f"{layers} layers tuned end to end: peak RSS {tuned[layers]['peak_rss_gib']:.2f} GiB, "
                      f"tuning {tuned[layers]['end_to_end_tuning']['seconds']:.0f} s", flush=True)
        command = "make bench-convert-scale" if argv is None and sys.argv[1:] == [] else \
            "python perf/convert_scale.py " + " ".join(sys.argv[1:] if argv is None else argv)
        data = {"machine": machine(), "device": args.device, "command": command, "tokens": args.tokens,
                "calibration": "a3b-quantize's built-in text" if text is None else text.name, "results": results,
                "tune_epochs": args.tune_epochs, "tuned": tuned}
        if not args.conversions_only:
            data.update(rounding_weights_per_s=rounding_throughput(), held_out_error_ratio_by_tokens=held_out_errors(),
                        gram_flops_per_s=gram_flops_per_s(), gpu_counted={
                            "window": gpu_layer_window(args.work / f"qwen3.6-width-{min(args.layers)}-layers"),
                            "experts": gpu_expert_groups(tuple(GROUP.values())),
                            **({"tune": gpu_tune_window(args.work / f"qwen3.6-width-{min(args.layers)}-layers",
                                                        args.work / f"qwen3.6-width-{min(args.layers)}-layers-a3b-tuned")}
                               if tuned else {})})
        args.out.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(data, indent=1))
    (args.out / "convert_scale.md").write_text(report(data))
    plot(data["results"], args.out / "convert_scale.png")
    print((args.out / "convert_scale.md").read_text())


if __name__ == "__main__":
    main()

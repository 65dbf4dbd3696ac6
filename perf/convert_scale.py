"""make bench-convert-scale: the layer pipeline (a3b-quantize --pipeline layers) on random
checkpoints at Qwen3.6-35B-A3B's real layer width, to show its memory stays one layer's and
to project the whole model's conversion time.

The checkpoints have 2 and 4 decoder layers of the real width (hidden 2048, 256 routed
experts top-8 with intermediate 512, a shared expert of 512, Gated DeltaNet 16 QK / 32 V
heads of 128, gated attention 16 Q / 2 KV heads of 256, 3 DeltaNet layers to 1 attention
layer) and the real vocabulary (248,320), in the published layout (model.language_model.*,
stacked experts); they are written one layer at a time, never whole in memory. Each is
converted in a process of its own, calibrated (nearest rounding: routed experts, ~93% of
the weights, take it in every pipeline), and the report gives its peak RSS, the seconds per
layer by phase (the conversion's own a3b/conversion.json), the rounding throughput of one
expert matrix, and a projection to 40 layers.
"""
from __future__ import annotations

import argparse
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

from a3b_backend.bench.perf_report import machine
from a3b_backend.prepare.qwen_tiny import FULL_SIZE
from a3b_backend.profiles import LICENCE_TEXTS, PROJECT_ROOT
from a3b_backend.quant.format import A3BConfig, dequantize, quantize, quantize_stack
from a3b_backend.quant.gptq import quantize_gptq, quantize_gptq_stack
from a3b_backend.quant.sequential import REPORT

QWEN_TINY = PROJECT_ROOT / "models" / "qwen3.6-tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
CALIBRATION_TEXT = LICENCE_TEXTS / "GPL-3"
FULL_LAYERS = FULL_SIZE["num_hidden_layers"]
PHASES = ("statistics", "rounding", "tuning", "passing_on", "total")  # a3b/conversion.json's, per layer
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


def convert(src: Path, dst: Path, tokens: int) -> dict:
    """One conversion in a process of its own -> its report, with that process's peak RSS."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.rmtree(dst.with_name(dst.name + ".partial"), ignore_errors=True)
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "a3b_backend.quant.convert", str(src), str(dst),
                             "--calibration-text", str(CALIBRATION_TEXT), "--calibration-tokens", str(tokens),
                             "--pipeline", "layers"])
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"conversion of {src} failed")
    report = json.loads((dst / REPORT).read_text())
    return {**report, "process_peak_rss_gib": usage.ru_maxrss / 2**20, "wall_s": time.perf_counter() - started}


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
    runs = {
        "nearest, 1 expert": (1, lambda: quantize(weights[0], config, col_importance=hessian.diagonal())),
        "nearest, 4 experts stacked": (4, lambda: quantize_stack(weights[:4], config,
                                                                 hessian.diagonal().expand(4, -1))),
        "gptq, 1 expert": (1, lambda: quantize_gptq(weights[0], config, hessian)),
        "gptq, 4 experts stacked": (4, lambda: quantize_gptq_stack(weights[:4], config, hessian.expand(4, -1, -1))),
        "gptq, 16 experts stacked": (16, lambda: quantize_gptq_stack(weights, config, hessian.expand(16, -1, -1))),
    }
    out = {}
    for name, (experts, run) in runs.items():
        run()  # warm-up
        started = time.perf_counter()
        run()
        out[name] = experts * weights[0].numel() / (time.perf_counter() - started)
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


def plot(results: dict[int, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(results)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(layers, [results[n]["process_peak_rss_gib"] for n in layers], marker="o")
    ax.set_xlabel("decoder layers (Qwen3.6-35B-A3B width)")
    ax.set_ylabel("peak RSS, GiB")
    ax.set_ylim(bottom=0)
    ax.set_title("a3b-quantize --pipeline layers")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def gram_flops_per_s() -> float:
    """x^T x of 2048 tokens of width 2048, the expert Hessians' product."""
    x = torch.randn(2048, 2048)
    x.T @ x
    started = time.perf_counter()
    x.T @ x
    return 2 * 2048**3 / (time.perf_counter() - started)


def report(results: dict[int, dict], throughput: dict[str, float], held_out: dict[int, float], flops: float,
           tokens: int, command: str) -> str:
    rows = []
    for layers, r in sorted(results.items()):
        per = r["per_layer"]
        mean = {k: sum(d[k] for d in per) / len(per) for k in PHASES}
        rows.append(f"| {layers} | {r['process_peak_rss_gib']:.2f} | {r['wall_s']:.0f} | {mean['total']:.0f} | "
                    f"{mean['statistics']:.0f} | {mean['rounding']:.0f} | {mean['tuning']:.0f} | "
                    f"{mean['passing_on']:.0f} | "
                    f"{r['linears']} | {r['expert_projections_compensated']} of {r['expert_projections']} |")
    small, large = min(results), max(results)
    growth = results[large]["process_peak_rss_gib"] - results[small]["process_peak_rss_gib"]
    per = [d for r in results.values() for d in r["per_layer"]]
    forward = sum(d["statistics"] + d["tuning"] + d["passing_on"] for d in per) / len(per)
    rounding = sum(d["rounding"] for d in per) / len(per)
    full_tokens = 128 * 512
    # At the full budget an expert averages full_tokens * 8 / 256 = 2048 own tokens: past TOKENS_PER_INPUT
    # for its gate/up (1024) and down (256), so its projections round error-compensating (here: nearest).
    experts_nearest = EXPERT_WEIGHTS / throughput["nearest, 4 experts stacked"]
    experts_gptq = EXPERT_WEIGHTS / throughput["gptq, 4 experts stacked"]
    hessians = 2 * 8 * full_tokens * (2048**2 + 512**2) / flops
    full_rounding = rounding - experts_nearest + experts_gptq + hessians
    projected = FULL_LAYERS * (forward * full_tokens / tokens + full_rounding)
    return "\n".join([
        "# The layer pipeline at Qwen3.6-35B-A3B's layer width", "",
        f"Machine: {machine()}. Command: `{command}`. Random checkpoints of real-width layers (hidden 2048, "
        "256 routed experts top-8 of intermediate 512, shared expert 512, DeltaNet 16/32 heads of 128, attention "
        "16Q/2KV of 256, vocabulary 248,320) in the published layout; each converted by `a3b-quantize "
        f"--pipeline layers` (its defaults: error-compensating rounding, one pass of block-wise tuning) on {tokens} "
        "tokens of GPL-3, in a process of its own.", "",
        "| layers | peak RSS GiB | wall s | s per layer | statistics s | rounding s | tuning s | passing on s | "
        "linears | expert projections error-compensated |",
        "|---|---|---|---|---|---|---|---|---|---|", *rows, "",
        f"Peak RSS, {large} layers minus {small}: **{growth:+.2f} GiB** (goal: under 0.5); {large} layers peak at "
        f"{results[large]['process_peak_rss_gib']:.2f} GiB (goal: under 8). At {tokens} tokens an expert sees "
        f"~{tokens * 8 // 256} of its own, too few for error-compensating rounding: experts round nearest here.", "",
        "Rounding 512 x 2048 expert matrices (goals: nearest 5 M weights/s, error-compensating 1 M):", "",
        "| rounding | M weights/s |", "|---|---|",
        *(f"| {name} | {rate / 1e6:.2f} |" for name, rate in throughput.items()), "",
        "Error-compensating over nearest rounding's output error on 4,096 held-out tokens, for one 512 x 2048 "
        "expert whose Hessian comes from its own tokens (inputs with a decaying spectrum and 8 outlier channels; "
        "below 1: error-compensating wins):", "",
        "| own tokens | per input channel | error ratio |", "|---|---|---|",
        *(f"| {n} | {n / 2048:.3g} | {ratio:.2f} |" for n, ratio in held_out.items()), "",
        f"Projection to the whole model ({FULL_LAYERS} layers, 128 x 512 = {full_tokens} calibration tokens) on "
        f"this machine: **{projected / 3600:.1f} h** ({full_rounding / 60:.0f} min of rounding per layer). "
        f"Assumptions: the passes over the windows (statistics, tuning, passing on: {forward:.0f} s per layer here) "
        "grow linearly "
        f"with the tokens; the routed experts' {EXPERT_WEIGHTS / 1e6:.0f} M weights per layer all round "
        f"error-compensating, 4 stacked ({experts_gptq:.0f} s instead of {experts_nearest:.0f} s nearest), "
        f"after their Hessians ({hessians:.0f} s at the measured {flops / 1e9:.0f} GFLOP/s of x^T x); the rest of "
        "the rounding does not grow with the tokens. Not measured on a GPU: the pipeline has no `--device` yet.",
    ]) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=1024, help="calibration tokens per conversion")
    parser.add_argument("--work", type=Path, default=PROJECT_ROOT / "models" / "convert_scale")
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "perf" / "results" / "convert_scale")
    args = parser.parse_args(argv)
    results = {}
    for layers in args.layers:
        src = write_checkpoint(args.work / f"qwen3.6-width-{layers}-layers", layers)
        results[layers] = convert(src, args.work / f"qwen3.6-width-{layers}-layers-a3b", args.tokens)
        print(f"{layers} layers: peak RSS {results[layers]['process_peak_rss_gib']:.2f} GiB", flush=True)
    throughput, held_out, flops = rounding_throughput(), held_out_errors(), gram_flops_per_s()
    args.out.mkdir(parents=True, exist_ok=True)
    command = "make bench-convert-scale" if argv is None and sys.argv[1:] == [] else \
        "python perf/convert_scale.py " + " ".join(sys.argv[1:])
    (args.out / "convert_scale.json").write_text(json.dumps(
        {"machine": machine(), "tokens": args.tokens, "results": results, "rounding_weights_per_s": throughput,
         "held_out_error_ratio_by_tokens": held_out, "gram_flops_per_s": flops}, indent=1))
    (args.out / "convert_scale.md").write_text(report(results, throughput, held_out, flops, args.tokens, command))
    plot(results, args.out / "convert_scale.png")
    print((args.out / "convert_scale.md").read_text())


if __name__ == "__main__":
    main()

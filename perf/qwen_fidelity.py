"""make bench-qwen-fidelity: how close each A3B conversion of qwen-tiny (Qwen3.6-35B-A3B's
architecture at toy width) stays to its source, uncalibrated and calibrated: untuned, tuned end to
end (a3b-quantize's default), tuned block-wise, and with experts' statistics from every token.

qwen-tiny's weights are random, so perplexity on text means nothing. Instead: sequences the source
samples itself (temperature 1, from its full distribution), and each conversion's excess negative
log-likelihood on them over the source's, in nats per token: its average is the KL divergence from
the source to the conversion.

Random weights give near-isotropic activations, where calibration has little to find; trained
models have a few channels whose RMSNorm gains are far larger than the rest, and large activations
in them. So the report also runs a variant of qwen-tiny whose input and post-attention RMSNorms
have OUTLIER_CHANNELS channels at OUTLIER_GAIN, the rest as built.

Each conversion is `a3b-quantize` in a process of its own on CALIBRATION_TOKENS tokens of the
built-in varied text, as `make model-qwen` converts; the dequantized weights are loaded into
transformers (a3b_backend/quant/dequantized.py) in float32.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from a3b_backend.bench.perf_report import machine
from a3b_backend.profiles import PROJECT_ROOT
from a3b_backend.quant.dequantized import float_model

QWEN_TINY = PROJECT_ROOT / "models" / "qwen3.6-tiny"
WORK = PROJECT_ROOT / "models" / "qwen_fidelity"
OUT = PROJECT_ROOT / "perf" / "results" / "qwen_fidelity"
CALIBRATION_TOKENS = 8192
OUTLIER_CHANNELS, OUTLIER_GAIN = 4, 20.0
NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
# 48, not 16: at 16 the standard error (~0.1 nats with outlier channels) was as large as the
# differences between conversions; the report also gives each one's paired difference from untuned
SEQUENCES, SEQUENCE_TOKENS = 48, 128
# Block-wise tuning's steps per layer: make bench-block-tune's 60, not AutoRound's 200, which would
# take over an hour of a 2-core run (make bench-block-tune: ~55 s a SmolLM2 layer for 60 steps)
# for settings that kept the untuned layers there
TUNE_STEPS = 60
# label -> (checkpoint directory's name, a3b-quantize options)
SOURCES = {"as-built": "qwen-tiny as built", "outliers": "with outlier channels"}  # slug -> report label
UNTUNED = "untuned (make model-qwen's)"
VARIANTS = {
    "uncalibrated": ("uncalibrated", ["--uncalibrated"]),
    UNTUNED: ("untuned", ["--tune-epochs", "0"]),
    "tuned end to end (the default)": ("end-to-end", []),
    "tuned block-wise": ("block-wise", ["--tune-epochs", "0", "--tune-steps", str(TUNE_STEPS)]),
    "untuned, experts on every token": ("every-token", ["--tune-epochs", "0", "--expert-tokens", "all"]),
}


def with_outliers(src: Path, dst: Path) -> Path:
    """src with OUTLIER_CHANNELS channels of every input and post-attention RMSNorm at a gain of
    OUTLIER_GAIN (the norms are zero-centred: the stored weight is the gain minus 1)."""
    if (dst / "config.json").exists():
        return dst
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    channels = torch.randperm(json.loads((src / "config.json").read_text())["hidden_size"],
                              generator=torch.Generator().manual_seed(0))[:OUTLIER_CHANNELS]
    for shard in dst.glob("*.safetensors"):
        tensors = load_file(shard)
        for name, tensor in tensors.items():
            if name.endswith(NORMS) and ".layers." in name and not name.startswith("mtp."):
                tensor[channels] = OUTLIER_GAIN - 1
        save_file(tensors, shard, metadata={"format": "pt"})
    return dst


def sample(model: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    """[SEQUENCES, SEQUENCE_TOKENS] token ids the model samples from random first tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (SEQUENCES, 1), generator=generator)
    with torch.no_grad():
        for _ in range(SEQUENCE_TOKENS - 1):
            probabilities = model(ids, logits_to_keep=1).logits[:, -1].float().softmax(-1)
            ids = torch.cat([ids, torch.multinomial(probabilities, 1, generator=generator)], 1)
    return ids


def token_nll(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of each token after the first, [SEQUENCES, SEQUENCE_TOKENS - 1]."""
    with torch.no_grad():
        logprobs = model(ids).logits[:, :-1].float().log_softmax(-1)
    return -logprobs.gather(-1, ids[:, 1:, None])[..., 0]


def convert(src: Path, dst: Path, options: list[str]) -> float:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.rmtree(dst.with_name(dst.name + ".partial"), ignore_errors=True)
    started = time.perf_counter()
    budget = [] if "--uncalibrated" in options else ["--calibration-tokens", str(CALIBRATION_TOKENS)]
    subprocess.run([sys.executable, "-m", "a3b_backend.quant.convert", str(src), str(dst), *budget, *options],
                   check=True)
    return time.perf_counter() - started


def measure(src: Path, slug: str) -> dict:
    source = float_model(src)
    ids = sample(source)
    reference = token_nll(source, ids)
    rows, per_sequence = {}, {}
    for variant, (name, options) in VARIANTS.items():
        dst = WORK / f"{slug}-{name}"
        seconds = convert(src, dst, options)
        excess = token_nll(float_model(dst), ids) - reference
        per_sequence[variant] = excess.mean(1)
        rows[variant] = {"excess_nll": float(excess.mean()), "conversion_s": seconds,
                         "excess_nll_sem": float(per_sequence[variant].std() / SEQUENCES**0.5)}
        if UNTUNED in per_sequence and variant != UNTUNED:  # on the same sequences: the smaller error
            difference = per_sequence[variant] - per_sequence[UNTUNED]
            rows[variant].update(vs_untuned=float(difference.mean()),
                                 vs_untuned_sem=float(difference.std() / SEQUENCES**0.5))
        print(f"{slug} / {variant}: excess NLL {rows[variant]['excess_nll']:.4f} nats/token", flush=True)
    return {"source_nll": float(reference.mean()), "variants": rows}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(results)
    for i, (source, result) in enumerate(results.items()):
        values = [v["excess_nll"] for v in result["variants"].values()]
        errors = [v["excess_nll_sem"] for v in result["variants"].values()]
        ax.bar([x + i * width for x in range(len(values))], values, width, yerr=errors, label=source)
    ax.set_xticks([x + width * (len(results) - 1) / 2 for x in range(len(VARIANTS))], list(VARIANTS),
                  rotation=15, fontsize=8)
    ax.set_ylabel("excess NLL, nats/token (~KL)")
    ax.set_title("qwen-tiny in A3B against its source")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(results: dict, command: str) -> str:
    lines = ["# qwen-tiny in A3B: excess NLL over its source", "",
             f"Machine: {machine()}. Command: `{command}`. {SEQUENCES} sequences of {SEQUENCE_TOKENS} tokens sampled "
             "by each source at temperature 1; per conversion, the mean excess negative log-likelihood over the "
             "source's on them (nats per token, about the KL divergence; +- one standard error over sequences). "
             f"Calibration: {CALIBRATION_TOKENS} tokens of the built-in varied text. 'with outlier channels': "
             f"{OUTLIER_CHANNELS} channels of every input and post-attention RMSNorm at a gain of {OUTLIER_GAIN:g}.",
             "", "| source | conversion | excess NLL | vs uncalibrated | vs untuned (paired) | conversion s |",
             "|---|---|---|---|---|---|"]
    for source, result in results.items():
        base = result["variants"]["uncalibrated"]["excess_nll"]
        for variant, row in result["variants"].items():
            paired = f"{row['vs_untuned']:+.4f} +- {row['vs_untuned_sem']:.4f}" if "vs_untuned" in row else ""
            lines.append(f"| {source} | {variant} | {row['excess_nll']:.4f} +- {row['excess_nll_sem']:.4f} | "
                         f"{row['excess_nll'] / base:.2f}x | {paired} | {row['conversion_s']:.0f} |")
    lines += ["", "Goal (with outlier channels): the default, tuned, at most 0.55x the uncalibrated excess and never "
              "worse than untuned.", "", "![plot](qwen_fidelity.png)"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES),
                        help="which sources to measure (default: both)")
    args = parser.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    results = {SOURCES[slug]: measure(QWEN_TINY if slug == "as-built" else with_outliers(QWEN_TINY, WORK / "outliers"),
                                      slug) for slug in args.sources}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "qwen_fidelity.json").write_text(json.dumps({"machine": machine(), "results": results}, indent=1))
    command = ("make bench-qwen-fidelity" if args.sources == list(SOURCES)
               else f"perf/qwen_fidelity.py --sources {' '.join(args.sources)}")
    (OUT / "qwen_fidelity.md").write_text(report(results, command))
    plot(results, OUT / "qwen_fidelity.png")
    print((OUT / "qwen_fidelity.md").read_text())


if __name__ == "__main__":
    main()

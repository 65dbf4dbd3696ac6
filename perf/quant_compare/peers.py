"""The peers' checkpoints for `make compare-quant`, written by llm-compressor
(run in .venv-quant, which scripts/quant_tools.sh creates: llm-compressor pins
numpy>=2 and a torch / transformers pair that .venv cannot share).

    .venv-quant/bin/python perf/quant_compare/peers.py --model DIR --calibration FILE --out DIR \
        --method gptq|awq --group-size 64 --sequences 64 --seq-len 512

GPTQ: GPTQModifier on every Linear but lm_head, 4-bit symmetric integer
weights in groups (compressed-tensors `pack-quantized`, uint4b8 in vLLM).
AWQ: llm-compressor's documented pair, AWQModifier(duo_scaling="both") then
QuantizationModifier, with W4A16_ASYM's asymmetric 4-bit weights (uint4 with
a zero-point). Both with the given group size instead of the presets' 128:
llm-compressor refuses a group that does not divide a layer's input, and
SmolLM2-135M's 576-wide inputs are 4.5 groups of 128. On a machine without a
GPU, AWQ's pinning of cached activations is skipped (without_pinning_on_cpu).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path


def calibration_dataset(tokenizer, text_path: Path, sequences: int, seq_len: int):
    from datasets import Dataset

    ids = tokenizer(text_path.read_text())["input_ids"]
    if len(ids) < sequences * seq_len:
        raise SystemExit(f"{text_path} has {len(ids)} tokens; {sequences} x {seq_len} asked")
    windows = [ids[i * seq_len:(i + 1) * seq_len] for i in range(sequences)]
    return Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * seq_len for _ in windows]})


def without_pinning_on_cpu() -> None:
    """llm-compressor 0.14's AWQ pins its cached activations to page-locked
    memory before each grid search, which needs a CUDA driver; pinning only
    speeds copies to a GPU, so with none it is skipped."""
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if not torch.cuda.is_available():
        IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None


def recipe(method: str, group_size: int) -> list:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=method == "gptq", strategy="group",
                               group_size=group_size)
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
    if method == "gptq":
        return [GPTQModifier(config_groups=groups, ignore=["lm_head"])]
    return [AWQModifier(duo_scaling="both"), QuantizationModifier(config_groups=groups, ignore=["lm_head"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--calibration", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--method", choices=("gptq", "awq"), required=True)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()

    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    without_pinning_on_cpu()
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto")
    oneshot(model=model, dataset=calibration_dataset(tokenizer, args.calibration, args.sequences, args.seq_len),
            recipe=recipe(args.method, args.group_size), max_seq_length=args.seq_len,
            num_calibration_samples=args.sequences)
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    print(f"{args.method}: wrote {args.out} in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()

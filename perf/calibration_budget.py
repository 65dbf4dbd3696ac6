"""make bench-calibration-budget: what a smaller calibration budget costs.

a3b-quantize's default budget is 65,536 calibration tokens of the built-in varied text; `make
model` converts SmolLM2 on 8,192 (docs/quantization.md says why). This converts the model with
a3b-quantize's defaults at both budgets (each in a process of its own, timed) and gives each checkpoint's perplexity
on EVAL_TOKENS tokens of each held-out register (quality.REGISTERS: CPython's language reference,
and the standard library's docstrings; neither calibrated on), dequantized into transformers in
float32, beside the bf16 source's and make model's checkpoint's (and those `--also` names).
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

from a3b_backend.bench.perf_report import machine
from a3b_backend.profiles import PROJECT_ROOT
from a3b_backend.quant.dequantized import float_model
from a3b_backend.quant.quality import REGISTERS, perplexity

SOURCE = PROJECT_ROOT / "models" / "smollm2-135m-instruct"
WORK = PROJECT_ROOT / "models" / "calibration_budget"
OUT = PROJECT_ROOT / "perf" / "results" / "calibration_budget"
BUDGETS = (8192, 65536)  # make model's, a3b-quantize's default
EVAL_TOKENS = 8192
SERVED = PROJECT_ROOT / "models" / "smollm2-135m-instruct-a3b"  # make model's checkpoint


def convert(tokens: int, *options: str, name: str | None = None) -> tuple[float, Path]:
    """a3b-quantize SOURCE at `tokens` calibration tokens with `options`, in a process of its own,
    into WORK/`name` -> (seconds, the checkpoint)."""
    dst = WORK / (name or f"a3b-{tokens}")
    shutil.rmtree(dst, ignore_errors=True)
    shutil.rmtree(dst.with_name(dst.name + ".partial"), ignore_errors=True)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "a3b_backend.quant.convert", str(SOURCE), str(dst),
                    "--calibration-tokens", str(tokens), *options], check=True)
    return time.perf_counter() - started, dst


def register_ids() -> dict[str, torch.Tensor]:
    """EVAL_TOKENS tokens of each held-out register, in SOURCE's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SOURCE)
    return {register: torch.tensor(tokenizer.encode(text())[:EVAL_TOKENS]) for register, text in REGISTERS.items()}


def perplexities(checkpoint: Path, ids: dict[str, torch.Tensor]) -> dict[str, float]:
    model = float_model(checkpoint)
    return {register: perplexity(model, register_ids) for register, register_ids in ids.items()}


def plot(rows: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    for offset, register in enumerate(REGISTERS):
        ax.barh([i + 0.4 * offset for i in range(len(rows))], [row["perplexity"][register] for row in rows.values()],
                height=0.4, label=register)
    ax.set_yticks([i + 0.2 for i in range(len(rows))], list(rows))
    ax.legend(fontsize=7)
    ax.set_xlabel(f"perplexity, {EVAL_TOKENS} tokens of each held-out register")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=int, nargs="*", default=list(BUDGETS),
                        help=f"the budgets to convert at (default {' '.join(map(str, BUDGETS))}; none: only score)")
    parser.add_argument("--also", type=Path, nargs="*", default=[],
                        help="A3B checkpoints converted before (by make compare-quant-a3b, say) to score beside")
    args = parser.parse_args(argv)
    ids = register_ids()
    rows = {"bf16 source": {"perplexity": perplexities(SOURCE, ids), "conversion_s": None}}
    for tokens in args.budgets:
        seconds, dst = convert(tokens)
        rows[f"A3B, {tokens} calibration tokens"] = {"perplexity": perplexities(dst, ids), "conversion_s": seconds}
        print(f"{tokens} tokens: perplexity {rows[f'A3B, {tokens} calibration tokens']['perplexity']}", flush=True)
    # the served default (make model's conversion) and any checkpoints named, their times not known here
    named = ([("make model's checkpoint", SERVED)] if SERVED.is_dir() else []) + [(str(p), p) for p in args.also]
    for label, checkpoint in named:
        quantization = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
        rows[f"{label} ({quantization['calibration_tokens']} calibration tokens, "
             f"tuned {quantization['tuned_epochs']} epochs)"] = {
            "perplexity": perplexities(checkpoint, ids), "conversion_s": None}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "calibration_budget.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))
    base = rows["bf16 source"]["perplexity"]
    lines = ["# Calibration budgets: 8,192 tokens against a3b-quantize's default (SmolLM2-135M-Instruct)", "",
             f"Machine: {machine()}. Command: `{' '.join(['python', 'perf/calibration_budget.py', *(argv or sys.argv[1:])])}`"
             " (`make bench-calibration-budget` runs it without options). a3b-quantize's defaults (built-in "
             "varied text, one decoder layer at a time, error-compensating rounding, one end-to-end tuning pass) "
             "at each budget; perplexity on "
             f"{EVAL_TOKENS} tokens of each held-out register in windows of 512, float32 in transformers "
             "(the A3B weights dequantized).", "",
             "| checkpoint | " + "".join(f"perplexity, {register} | vs bf16 | " for register in REGISTERS)
             + "conversion s |", "|---" * (2 + 2 * len(REGISTERS)) + "|"]
    for name, row in rows.items():
        seconds = "" if row["conversion_s"] is None else f"{row['conversion_s']:.0f}"
        lines.append(f"| {name} | " + "".join(f"{row['perplexity'][r]:.2f} | {row['perplexity'][r] / base[r] - 1:+.1%} | "
                                               for r in REGISTERS) + f"{seconds} |")
    (OUT / "calibration_budget.md").write_text("\n".join(lines + ["", "![plot](calibration_budget.png)"]) + "\n")
    plot(rows, OUT / "calibration_budget.png")
    print((OUT / "calibration_budget.md").read_text())


if __name__ == "__main__":
    main()

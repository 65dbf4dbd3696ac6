"""make bench-calibration-budget: what `make model`'s smaller calibration budget costs.

`make model` converts SmolLM2 with a3b-quantize's defaults on CALIBRATION_TOKENS (8,192) tokens of
the built-in varied text, for make test's time; a3b-quantize's default is 65,536. This converts the
model at both budgets (each in a process of its own, timed) and gives each checkpoint's perplexity
on EVAL_TOKENS tokens of CPython's language reference (`pydoc_data.topics`, not calibrated on),
dequantized into transformers in float32, beside the bf16 source's.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time

import torch

from a3b_backend.bench.perf_report import machine
from a3b_backend.profiles import PROJECT_ROOT
from a3b_backend.quant.dequantized import float_model
from a3b_backend.quant.quality import eval_text, perplexity

SOURCE = PROJECT_ROOT / "models" / "smollm2-135m-instruct"
WORK = PROJECT_ROOT / "models" / "calibration_budget"
OUT = PROJECT_ROOT / "perf" / "results" / "calibration_budget"
BUDGETS = (8192, 65536)  # make model's, a3b-quantize's default
EVAL_TOKENS = 8192


def convert(tokens: int) -> tuple[float, object]:
    dst = WORK / f"a3b-{tokens}"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.rmtree(dst.with_name(dst.name + ".partial"), ignore_errors=True)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "a3b_backend.quant.convert", str(SOURCE), str(dst),
                    "--calibration-tokens", str(tokens)], check=True)
    return time.perf_counter() - started, dst


def plot(rows: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh(list(rows), [row["perplexity"] for row in rows.values()])
    ax.set_xlabel(f"perplexity, {EVAL_TOKENS} tokens of CPython's language reference")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    from transformers import AutoTokenizer

    ids = torch.tensor(AutoTokenizer.from_pretrained(SOURCE).encode(eval_text())[:EVAL_TOKENS])
    rows = {"bf16 source": {"perplexity": perplexity(float_model(SOURCE), ids), "conversion_s": None}}
    for tokens in BUDGETS:
        seconds, dst = convert(tokens)
        rows[f"A3B, {tokens} calibration tokens"] = {"perplexity": perplexity(float_model(dst), ids),
                                                     "conversion_s": seconds}
        print(f"{tokens} tokens: perplexity {rows[f'A3B, {tokens} calibration tokens']['perplexity']:.2f}", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "calibration_budget.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))
    base = rows["bf16 source"]["perplexity"]
    lines = ["# make model's calibration budget against a3b-quantize's default (SmolLM2-135M-Instruct)", "",
             f"Machine: {machine()}. Command: `make bench-calibration-budget`. a3b-quantize's defaults (built-in "
             "varied text, error-compensating rounding, one end-to-end tuning pass) at each budget; perplexity on "
             f"{EVAL_TOKENS} tokens of CPython's language reference in windows of 512, float32 in transformers "
             "(the A3B weights dequantized).", "",
             "| checkpoint | perplexity | vs bf16 | conversion s |", "|---|---|---|---|"]
    for name, row in rows.items():
        seconds = "" if row["conversion_s"] is None else f"{row['conversion_s']:.0f}"
        lines.append(f"| {name} | {row['perplexity']:.2f} | {row['perplexity'] / base - 1:+.1%} | {seconds} |")
    (OUT / "calibration_budget.md").write_text("\n".join(lines + ["", "![plot](calibration_budget.png)"]) + "\n")
    plot(rows, OUT / "calibration_budget.png")
    print((OUT / "calibration_budget.md").read_text())


if __name__ == "__main__":
    main()

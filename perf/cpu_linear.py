"""The CPU A3B linear's two ways by row count (`make bench-cpu-linear`,
perf/results/cpu_linear.md): the fused kernel reading the 4-bit codes in place
(compiled for up to `a3b_kernels.cpu.FUSED_MAX_ROWS` rows, so larger batches
run it chunk by chunk) against one dequantize + GEMM, on SmolLM2-135M's and
Qwen3.6's projection shapes, for float32 x (the cpu profile) and bf16 x
(bf16-rounded weights on both ways, a bf16 GEMM where the CPU has AVX512-BF16):
the evidence for the rows at which the method switches from the one to the other.

Both ways run interleaved in one process, median of repeated calls, so the
ratio holds on a noisy machine even when the absolute times do not.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from a3b_backend.bench.perf_report import machine
from a3b_backend.quant.format import A3BConfig, quantize
from a3b_kernels import cpu
from a3b_backend.profiles import PROJECT_ROOT

# (name, out, in): SmolLM2-135M's MLP up and down projections; Qwen3.6's
# expert gate/up (2 x 512 out of hidden 2048) and its attention output projection.
SHAPES = (("SmolLM2 up", 1536, 576), ("SmolLM2 down", 576, 1536), ("Qwen3.6 expert gate_up", 1024, 2048),
          ("Qwen3.6 attention o", 2048, 4096))
ROWS = (1, 2, 4, 8, 12, 16, 32)
X_DTYPES = (torch.float32, torch.bfloat16)
CONFIG = A3BConfig(1, 128, iterations=1)


def median_us(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def measure(repeats: int) -> list[tuple[str, str, int, float, float]]:
    rows_out = []
    cases = [(name, out, inp, dtype, rows) for name, out, inp in SHAPES for dtype in X_DTYPES for rows in ROWS]
    weights = {(out, inp): quantize(torch.randn(out, inp) * 0.02, CONFIG) for _, out, inp in SHAPES}
    for name, out, inp, dtype, rows in tqdm(cases, desc="timing", unit="case"):
        weight, x = weights[(out, inp)], torch.randn(rows, inp).to(dtype)
        fused = lambda: torch.cat([cpu.linear(chunk, weight, CONFIG.block, "fused")  # noqa: E731
                                   for chunk in x.split(cpu.FUSED_MAX_ROWS)])
        dequant = lambda: cpu.linear(x, weight, CONFIG.block, "dequant")  # noqa: E731
        fused(), dequant()  # warm-up (first call builds the extension)
        fused_us, dequant_us = [], []
        for _ in range(3):  # interleaved rounds
            fused_us.append(median_us(fused, repeats))
            dequant_us.append(median_us(dequant, repeats))
        rows_out.append((name, str(dtype).removeprefix("torch."), rows, min(fused_us), min(dequant_us)))
    return rows_out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "perf" / "results" / "cpu_linear.md")
    args = parser.parse_args(argv)
    results = measure(args.repeats)
    lines = ["# A3B CPU linear: fused kernel vs dequantize + GEMM, by rows of x\n",
             f"Machine: {machine()}, {torch.get_num_threads()} torch threads. Command: `make bench-cpu-linear`. "
             f"1x128 blocks; best of 3 interleaved medians of {args.repeats} calls. bf16 GEMM: "
             f"{'yes' if cpu.BF16_GEMM else 'no (float32 GEMM on the bf16-rounded weights)'}.\n",
             f"`a3b_kernels.cpu.FUSED_MAX_ROWS` = {cpu.FUSED_MAX_ROWS}: up to that many rows the method runs "
             "the fused kernel, above it dequantize + GEMM; here the fused kernel runs past it in chunks of "
             f"{cpu.FUSED_MAX_ROWS} rows.\n",
             "| shape | x | rows | fused us | dequant + GEMM us | dequant / fused |", "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {dtype} | {rows} | {fused:.0f} | {dequant:.0f} | {dequant / fused:.2f} |"
              for name, dtype, rows, fused, dequant in results]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

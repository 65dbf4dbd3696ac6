"""make gpu-check: the one prepared run on a rented H100/H200 (torch + CUDA, Triton 3.6, nvcc; no
vLLM, no network), sized to leave time for a rerun within 15 minutes of GPU time.

Steps, in order, each timed; the run stops at the first failure and says which:
  1. the custom ops (a3b::gpu_linear, a3b::gpu_moe) at Qwen3.6's real shapes, against the torch
     reference, under torch.cuda.set_sync_debug_mode("error") (a host sync raises), then captured
     in a CUDA graph and replayed (what vLLM's compiled engine does);
  2. tests/test_kernels_cuda.py (builds the CUDA C++ extension, checks it on fresh inputs);
  3. perf/gpu_kernels.py: every kernel against its reference, then the timings, to
     perf/results/gpu/ (md, JSON, PNG, with the device's name);
  4. a3b-quantize --device cuda on a tiny Qwen3.5-MoE checkpoint against the same
     conversion on the CPU (tests/test_quant_sequential.py; its tokenizer fixture reads the default
     model's tokenizer files: carry models/smollm2-135m-instruct/tokenizer.json and tokenizer_config.json);
  5. the same at Qwen3.6-35B-A3B's real width: one random real-width layer converted on the GPU on
     65,536 tokens of a3b-quantize's built-in text (perf/convert_scale.py --conversions-only, to
     perf/results/gpu/convert_scale/: seconds per layer by phase, peak RSS and GPU memory), the figure
     bench-convert-scale projects (~33 s a layer); stopped after CONVERSION_TIMEOUT_S. It writes the
     checkpoint from qwen-tiny's config and tokenizer: carry models/qwen3.6-tiny/config.json,
     tokenizer.json, tokenizer_config.json and chat_template.jinja.

    python perf/gpu_check.py [--dry-run]

--dry-run (any machine): prints the plan, runs step 1 on the CPU under Triton's interpreter at small
sizes (eager only: no sync-debug mode, no graphs) and step 3 as `perf/gpu_kernels.py --smoke`;
steps 2 and 4 need a GPU and are listed only. No GPU duration has been measured yet.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from a3b_backend.profiles import PROJECT_ROOT

QWEN = dict(experts=256, hidden=2048, intermediate=512, top_k=8)
SMALL = dict(experts=8, hidden=256, intermediate=128, top_k=2)
LINEAR_SHAPES = ((12288, 2048), (2048, 4096), (1024, 2048))  # DeltaNet in_proj_qkvz, o_proj, shared gate_up
# Step 5's bound: 5x its projection of one layer plus writing the checkpoint, so a slow run still leaves
# the device time for a rerun of steps 1-4.
CONVERSION_TIMEOUT_S = 240


def check_ops(device: str, sizes: dict, shapes: tuple[tuple[int, int], ...]) -> None:
    """The ops against the reference; on CUDA under sync-debug "error", then in a CUDA graph."""
    import torch

    from a3b_backend.quant.format import A3BConfig, dequantize
    from a3b_kernels.reference import random_weight
    from a3b_kernels.triton import ops

    config = A3BConfig(1, 128)
    cuda = device == "cuda"
    calls = []
    for out, inp in shapes:
        weight = random_weight(None, out, inp, device=device)
        reference = dequantize(weight.to("cpu"), config).to(device)
        for rows in (1, 8):
            x = torch.randn(rows, inp, device=device, dtype=torch.bfloat16)
            calls.append((f"gpu_linear {out}x{inp} M={rows}",
                          lambda x=x, w=weight: ops.gpu_linear(x, *w.kernel_tensors(), 128), x.float() @ reference.T))
    e, h, i, k = sizes["experts"], sizes["hidden"], sizes["intermediate"], sizes["top_k"]
    w13, w2 = random_weight(e, 2 * i, h, device=device), random_weight(e, h, i, device=device)
    for tokens in (1, 8):
        x = torch.randn(tokens, h, device=device, dtype=torch.bfloat16)
        top, ids = torch.softmax(torch.randn(tokens, e, device=device), -1).topk(k, -1)
        weights, ids = top / top.sum(-1, keepdim=True), ids.to(torch.int32)
        calls.append((f"gpu_moe {e} experts T={tokens}",
                      lambda x=x, w=weights, ids=ids: ops.gpu_moe(x, *w13.kernel_tensors(), *w2.kernel_tensors(), w,
                                                                  ids, 128), None))
    for name, call, expected in calls:
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        got = call()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("default")
        if expected is not None:
            error = float((got - expected).abs().max() / expected.abs().max())
            if error > 2**-7:
                raise SystemExit(f"{name}: relative error {error:.2e} against the reference")
        if cuda:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = call()
            graph.replay()
            torch.cuda.synchronize()
            if not torch.equal(captured, got):
                raise SystemExit(f"{name}: the CUDA graph's replay differs from the eager call")
        print(f"  {name}: ok", flush=True)


def run(step: str, command: list[str], timeout_s: float | None = None) -> None:
    print(f"==> {step}: {' '.join(command)}", flush=True)
    try:
        done = subprocess.run(command, cwd=PROJECT_ROOT, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"gpu-check stopped: {step} ran past {timeout_s:.0f} s") from None
    if done.returncode != 0:
        raise SystemExit(f"gpu-check stopped: {step} failed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="the plan, and what of it runs on a CPU")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' modules are imported
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("make gpu-check needs a CUDA GPU; --dry-run shows and runs what a CPU can", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    timings = {}
    started = time.perf_counter()
    print("==> 1. custom ops" + (" (CPU, interpreter, small sizes, eager)" if args.dry_run else
                                 " at Qwen3.6's shapes, sync-debug and CUDA graphs"), flush=True)
    check_ops(device, SMALL if args.dry_run else QWEN, ((512, 256),) if args.dry_run else LINEAR_SHAPES)
    timings["custom ops"] = time.perf_counter() - started
    if args.dry_run:
        print("==> 2. tests/test_kernels_cuda.py: needs a GPU (listed only)", flush=True)
    else:
        started = time.perf_counter()
        run("2. CUDA extension tests", [sys.executable, "-m", "pytest", "-q", "tests/test_kernels_cuda.py"])
        timings["CUDA extension tests"] = time.perf_counter() - started
    started = time.perf_counter()
    # a dry run's smoke figures mean nothing: they go to a scratch folder, not over perf/results/gpu/
    smoke = ["--smoke", "--out", tempfile.mkdtemp(prefix="gpu-check-dry-run-")] if args.dry_run else []
    run("3. kernel checks and timings", [sys.executable, "perf/gpu_kernels.py", *smoke])
    timings["kernel checks and timings"] = time.perf_counter() - started
    gpu_conversion = [sys.executable, "-m", "pytest", "-q", "tests/test_quant_sequential.py", "-k", "on_the_gpu"]
    if args.dry_run:
        print("==> 4. a conversion with --device cuda: needs a GPU (listed only)", flush=True)
    else:
        started = time.perf_counter()
        run("4. conversion on the GPU", gpu_conversion)
        timings["conversion on the GPU"] = time.perf_counter() - started
    if args.dry_run:
        print("==> 5. a real-width layer converted with --device cuda: needs a GPU (listed only)", flush=True)
    else:
        started = time.perf_counter()
        run("5. a real-width layer converted on the GPU", [
            sys.executable, "perf/convert_scale.py", "--layers", "1", "--tokens", "65536", "--device", "cuda",
            "--calibration-text", "built-in", "--conversions-only", "--tune-epochs", "0",
            "--work", tempfile.mkdtemp(prefix="gpu-check-"), "--out", "perf/results/gpu/convert_scale"], CONVERSION_TIMEOUT_S)
        timings["real-width conversion on the GPU"] = time.perf_counter() - started
    print("gpu-check " + ("dry run " if args.dry_run else "") + "passed: "
          + ", ".join(f"{step} {seconds:.0f} s" for step, seconds in timings.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

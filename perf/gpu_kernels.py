"""A3B kernels on a GPU, one run: check, then time (`make bench-gpu`).

    python perf/gpu_kernels.py [--out perf/results/gpu] [--iters 50] [--no-cuda-ext]
    python perf/gpu_kernels.py --smoke --out /tmp/x    # every code path on the CPU, tiny sizes, no figures

1. Checks every kernel against its torch reference on fresh random inputs
   (Triton A3B matmul and grouped MoE, CUDA GEMV, Triton KV write, Triton and
   CUDA paged decode attention); a mismatch is reported and the run exits 1
   after timing.
2. Times --iters calls captured in a CUDA graph (no host launch overhead),
   each call on the next of several copies of its operands that together
   exceed L2 several times (an A3B 8192x8192 weight, 34 MB, would otherwise be
   timed from the 60 MB L2); CUDA events around graph replays, median of 5:
   - A3B GEMV/GEMM (Triton; CUDA GEMV at batch <= 16) vs torch bf16 matmul
     (cuBLAS) vs torch's int4 weight-only matmul (_weight_int4pack_mm, group
     128), batch 1/4/16/64, weights [N, K] = 2048x512, 512x2048, 2048x2048,
     8192x8192;
   - A3B paged decode attention (Triton, CUDA) vs fp16 SDPA, Qwen3.6's
     attention shape (16 query heads, 2 KV heads, head_dim 256), 8K/32K/128K
     context, batch 1;
   - the Triton matmul under a sweep of launches (BLOCK_N, K splits per SM,
     pipeline stages) at batch 1/4/16, fastest against the default.
   GB/s counts the bytes a call must read (packed codes + metadata, or the
   dense weight / cache) and is set against a device-to-device copy timed in
   the same run. The extra device memory an A3B call allocates is checked to
   stay under 1% of the bf16 weight.
3. Writes gpu_kernels.{md,json,png} with the GPU named.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable
from a3b_backend.profiles import PROJECT_ROOT


L2_BYTES = 60 << 20


@dataclasses.dataclass(frozen=True)
class Plan:
    device: str
    shapes: tuple[tuple[int, int], ...]  # weights [N, K]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    iters: int
    rotate_bytes: int  # operands cycled per timed call
    copy_bytes: int
    check_hidden: int  # checks: matmul K and MoE hidden size
    check_lens: tuple[int, ...]  # checks: cached tokens per sequence
    attention: tuple[int, int, int] = (16, 2, 256)  # query heads, KV heads, head_dim (Qwen3.6's)
    block_size: int = 16
    group: int = 128
    # the Triton matmul's launch sweep: shapes, and the values tried for each Launch field
    sweep_shapes: tuple[tuple[int, int], ...] = ((8192, 8192), (2048, 2048))
    sweep_block_n: tuple[int, ...] = (32, 64, 128)
    sweep_per_sm: tuple[int, ...] = (2, 4, 8)
    sweep_stages: tuple[int, ...] = (2, 3, 4)


GPU = Plan("cuda", shapes=((2048, 512), (512, 2048), (2048, 2048), (8192, 8192)), batches=(1, 4, 16, 64),
           contexts=(8192, 32768, 131072), iters=50, rotate_bytes=4 * L2_BYTES, copy_bytes=1 << 30,
           check_hidden=2048, check_lens=(17, 700, 2100))
# Every code path on the CPU, under Triton's interpreter at tiny sizes: `make test` runs it so the
# first GPU session does not spend its minutes on a broken script.
SMOKE = Plan("cpu", shapes=((64, 256),), batches=(1, 17), contexts=(64,), iters=2, rotate_bytes=1 << 16,
             copy_bytes=1 << 20, check_hidden=256, check_lens=(5, 40), attention=(4, 2, 64), group=64,
             sweep_shapes=((64, 256),), sweep_block_n=(32,), sweep_per_sm=(2,), sweep_stages=(2,))


@dataclasses.dataclass
class Timing:
    bench: str  # "linear", "attention" or "sweep"
    case: str  # e.g. "8192x8192 M=1" or "ctx=131072"
    variant: str
    us: float | None  # median microseconds; None when the variant cannot run
    bytes_read: int
    note: str = ""

    @property
    def gbps(self) -> float | None:
        return None if not self.us else self.bytes_read / self.us / 1e3


# --------------------------------------------------------------------------- timing
def time_us(plan: Plan, fn: Callable[[int], object], warmup: int = 5, replays: int = 5) -> float:
    """Microseconds per call of fn(i). On a GPU: plan.iters calls (each on the
    next rotated operand) captured in a CUDA graph, so host launch overhead
    does not count, replayed `replays` times between CUDA events; the median
    replay over plan.iters. Where capture fails, per-call events. On the CPU
    (smoke run): a wall clock per call."""
    import torch

    if plan.device != "cuda":
        fn(0)
        samples = []
        for i in range(plan.iters):
            start = time.perf_counter()
            fn(1 + i)
            samples.append((time.perf_counter() - start) * 1e6)
        return statistics.median(samples)
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(plan.iters):
                fn(i)
        graph.replay()
        per_replay = []
        for _ in range(replays):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            graph.replay()
            end.record()
            end.synchronize()
            per_replay.append(begin.elapsed_time(end) * 1e3 / plan.iters)
        return statistics.median(per_replay)
    except RuntimeError as exc:  # not capturable: time each call, launch overhead included
        print(f"CUDA graph capture failed ({str(exc).splitlines()[0][:100]}); timing calls one by one", flush=True)
        torch.cuda.synchronize()
    samples = []
    for i in range(plan.iters):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn(i)
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def copies(plan: Plan, make: Callable[[], object], nbytes: int) -> list:
    """Enough independent copies of an operand that cycling through them defeats L2."""
    from a3b_backend.quant.format import ceil_div

    return [make() for _ in range(max(2, ceil_div(plan.rotate_bytes, max(nbytes, 1))))]


def copy_bandwidth(plan: Plan) -> float:
    """GB/s of a device-to-device copy, counting bytes read + written."""
    import torch

    src = torch.empty(plan.copy_bytes, dtype=torch.uint8, device=plan.device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / time_us(plan, lambda i: dst.copy_(src)) / 1e3


# --------------------------------------------------------------------------- checks
def checks(plan: Plan, cuda_ext: bool) -> list[tuple[str, float, bool]]:
    """(kernel, max abs error relative to the reference's max, passed) on fresh random inputs."""
    import torch

    from a3b_backend.quant.format import A3BConfig, quantize, stack
    from a3b_kernels import kv_cache, reference
    from a3b_kernels.triton import a3b_kv, a3b_matmul, a3b_moe

    dev, hidden = plan.device, plan.check_hidden
    config = A3BConfig(1, plan.group, iterations=2)
    results = []

    def record(name, got, expected, tol):
        err = ((got.float().cpu() - expected.float().cpu()).abs().max() / expected.abs().max()).item()
        results.append((name, err, bool(torch.isfinite(got).all()) and err <= tol))

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    q = quantize(torch.randn(hidden // 2, hidden, generator=g) * 0.05, config)
    for m in (1, 16, 64):
        x = torch.randn(m, hidden, generator=g).to(torch.bfloat16)
        expected = reference.a3b_matmul(x, q, config)
        record(f"triton a3b_matmul M={m}", a3b_matmul.a3b_matmul(x.to(dev), q.to(dev), config), expected, 1e-3)
        if m == 1:  # the default is the GEMV without a table; the table kernel's M=1 launch beside it
            record("triton a3b_matmul M=1, table", a3b_matmul.a3b_matmul(
                x.to(dev), q.to(dev), config, launch=a3b_matmul.launch_for(1)), expected, 1e-3)
        if cuda_ext and m <= 16:
            from a3b_kernels import cuda

            record(f"cuda a3b_gemv M={m}", cuda.a3b_gemv(x.to(dev), q.to(dev), config), expected, 1e-3)

    experts, inter = 8, hidden // 4
    w13 = [quantize(torch.randn(2 * inter, hidden, generator=g) * 0.05, config) for _ in range(experts)]
    w2 = [quantize(torch.randn(hidden, inter, generator=g) * 0.05, config) for _ in range(experts)]
    x = torch.randn(6, hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:4] for _ in range(6)])
    weights = torch.rand(6, 4, generator=g).softmax(-1)
    # the reference's weights rounded to fp16, as the kernel's tensor cores multiply them
    record(f"triton a3b_moe (hidden {hidden}, expert {inter}, top 4 of 8)",
           a3b_moe.a3b_moe(x.to(dev), stack(w13).to(dev), stack(w2).to(dev), weights.to(dev), ids.to(dev), plan.group),
           reference.a3b_moe(x, w13, w2, weights, ids, config, torch.float16), 2e-3)

    heads, kv_heads, dim = plan.attention
    seqs = kv_cache.random_sequences(list(plan.check_lens), kv_heads, dim, plan.group, g, plan.block_size)
    # the Triton writer against the reference writer, on the last sequence's values
    written = kv_cache.PagedA3B.empty(*seqs.v.codes.shape[:3], dim, plan.group, device=dev)
    a3b_kv.write(written, seqs.values[-1].to(dev), seqs.slots[-1].to(dev))
    slots = seqs.slots[-1]
    same = (written.codes.view(-1, kv_heads, dim // 2)[slots.to(dev)].cpu()
            == seqs.v.codes.view(-1, kv_heads, dim // 2)[slots]).float().mean().item()
    results.append(("triton a3b_kv.write (share of codes unequal to the reference)", 1 - same, same > 0.99))
    qry = torch.randn(len(seqs.lens), heads, dim, generator=g).to(torch.bfloat16)
    expected = kv_cache.paged_decode_attention(qry, seqs.k, seqs.v, seqs.tables, seqs.lens)
    on_device = [kv_cache.PagedA3B(c.codes.to(dev), c.meta.to(dev)) for c in (seqs.k, seqs.v)]
    args = (qry.to(dev), *on_device, seqs.tables.to(dev), seqs.lens.int().to(dev))
    record("triton a3b paged decode attention", a3b_kv.paged_decode_attention(*args), expected, 2e-3)  # fp16 dots
    if cuda_ext:
        from a3b_kernels import cuda

        record("cuda a3b paged decode attention", cuda.paged_decode_attention(*args), expected, 1e-3)
    return results


# --------------------------------------------------------------------------- linear
def random_a3b(n: int, k: int, group: int, device: str):
    """Random codes and metadata of an [n, k] A3B weight (timing needs no fit)."""
    import torch

    from a3b_backend.quant.format import A3BWeight, stored_tensors

    def random(kind, spec):
        if spec.dtype == torch.bfloat16:  # row scales: small, so table values stay in range
            return torch.full(spec.shape, 1e-3 if kind == "lo_scale" else 1e-4, dtype=spec.dtype, device=device)
        info = torch.iinfo(spec.dtype)
        return torch.randint(max(info.min, -127), info.max + 1, spec.shape, dtype=spec.dtype, device=device)

    tensors = {kind: random(kind, spec) for kind, spec in stored_tensors(n, k, (1, group)).items() if kind != "shape"}
    return A3BWeight.for_kernels(tensors, n, k)


def int4_weight(n: int, k: int, device: str):
    """torch's int4 weight-only format: packed weight + bf16 scales/zeros, group 128."""
    import torch

    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, device=device)
    packed = torch.ops.aten._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8), 8)
    scales_zeros = torch.randn(k // 128, n, 2, device=device).to(torch.bfloat16)
    return packed, scales_zeros


def time_linear(plan: Plan, cuda_ext: bool) -> tuple[list[Timing], list[str]]:
    import torch

    from a3b_backend.quant.format import A3BConfig
    from a3b_kernels.triton import a3b_matmul

    dev = plan.device
    config = A3BConfig(1, plan.group)
    rows, notes = [], []
    for n, k in plan.shapes:
        a3b_bytes = random_a3b(n, k, plan.group, dev).nbytes()
        dense_bytes = n * k * 2
        a3b = copies(plan, lambda: random_a3b(n, k, plan.group, dev), a3b_bytes)
        dense = copies(plan, lambda: torch.randn(n, k, device=dev).to(torch.bfloat16), dense_bytes)
        try:
            int4, int4_error = copies(plan, lambda: int4_weight(n, k, dev), n * k // 2), ""
        except Exception as exc:  # a torch build without the int4 kernels for this device
            int4, int4_error = None, f"{type(exc).__name__}: {exc}".splitlines()[0][:120]
        for m in plan.batches:
            case = f"{n}x{k} M={m}"
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            act = m * k * 2
            rows.append(Timing("linear", case, "bf16 cuBLAS",
                               time_us(plan, lambda i: x @ dense[i % len(dense)].T), dense_bytes + act))
            if int4 is None:
                rows.append(Timing("linear", case, "torch int4", None, n * k // 2, int4_error))
            else:
                rows.append(Timing("linear", case, "torch int4", time_us(
                    plan, lambda i: torch.ops.aten._weight_int4pack_mm(x, int4[i % len(int4)][0], 128,
                                                                       int4[i % len(int4)][1])),
                    n * k // 2 + k // 128 * n * 4 + act))
            rows.append(Timing("linear", case, "A3B Triton", time_us(
                plan, lambda i: a3b_matmul.a3b_matmul(x, a3b[i % len(a3b)], config)), a3b_bytes + act))
            if m == 1:  # "A3B Triton" is the GEMV without a table here: the table kernel's M=1 launch beside it
                rows.append(Timing("linear", case, "A3B Triton, table", time_us(
                    plan, lambda i: a3b_matmul.a3b_matmul(x, a3b[i % len(a3b)], config,
                                                          launch=a3b_matmul.launch_for(1))), a3b_bytes + act))
            if cuda_ext and m <= 16:
                from a3b_kernels import cuda

                rows.append(Timing("linear", case, "A3B CUDA GEMV", time_us(
                    plan, lambda i: cuda.a3b_gemv(x, a3b[i % len(a3b)], config)), a3b_bytes + act))
        if dev == "cuda":
            notes.append(extra_memory_note(n, k, config))
        del a3b, dense, int4
    return rows, notes


def extra_memory_note(n: int, k: int, config) -> str:
    """Device memory an A3B call allocates beyond its output, against 1% of the bf16 weight."""
    import torch

    from a3b_kernels.triton import a3b_matmul

    q, x = random_a3b(n, k, config.block_cols, "cuda"), torch.randn(16, k, device="cuda").to(torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = a3b_matmul.a3b_matmul(x, q, config)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - y.numel() * y.element_size()
    limit = 0.01 * n * k * 2
    return (f"{n}x{k}: extra device memory during an A3B call {extra} B "
            f"({'within' if extra <= limit else 'OVER'} 1% of the bf16 weight, {limit:.0f} B)")


def time_sweep(plan: Plan) -> list[Timing]:
    """The Triton matmul under every launch of the plan's sweep, at decode batch
    sizes, so the defaults (`a3b_matmul.launch_for`) can be chosen from one run."""
    import torch

    from a3b_backend.quant.format import A3BConfig
    from a3b_kernels.triton import a3b_matmul

    config = A3BConfig(1, plan.group)
    rows = []
    for n, k in plan.sweep_shapes:
        nbytes = random_a3b(n, k, plan.group, plan.device).nbytes()
        a3b = copies(plan, lambda: random_a3b(n, k, plan.group, plan.device), nbytes)
        for m in (1, 4, 16):
            x = torch.randn(m, k, device=plan.device).to(torch.bfloat16)
            default = a3b_matmul.launch_for(m)
            for block_n in plan.sweep_block_n:
                for per_sm in plan.sweep_per_sm:
                    for stages in plan.sweep_stages:
                        launch = dataclasses.replace(default, block_n=block_n, per_sm=per_sm, num_stages=stages)
                        label = f"block_m {launch.block_m} block_n {block_n} per_sm {per_sm} stages {stages}"
                        rows.append(Timing("sweep", f"{n}x{k} M={m}", label, time_us(
                            plan, lambda i: a3b_matmul.a3b_matmul(x, a3b[i % len(a3b)], config, launch=launch)),
                            nbytes + m * k * 2, "default" if launch == default else ""))
        del a3b
    return rows


# --------------------------------------------------------------------------- attention
def random_paged(plan: Plan, tokens: int) -> tuple[object, object, object]:
    """(k cache, v cache, block table) with random codes/metadata, pages in random order."""
    import torch

    from a3b_backend.quant.format import ceil_div
    from a3b_kernels.kv_cache import PagedA3B

    _, kv_heads, dim = plan.attention
    pages = ceil_div(tokens, plan.block_size)
    caches = []
    for _ in range(2):
        c = PagedA3B.empty(pages, plan.block_size, kv_heads, dim, plan.group, device=plan.device)
        c.codes.random_(0, 256)
        c.meta.copy_(torch.rand_like(c.meta) * 0.1)
        caches.append(c)
    table = torch.randperm(pages, device=plan.device, dtype=torch.int32)[None]
    return caches[0], caches[1], table


def time_attention(plan: Plan, cuda_ext: bool) -> list[Timing]:
    import torch

    from a3b_kernels import kv_cache
    from a3b_kernels.triton import a3b_kv

    dev = plan.device
    heads, kv_heads, dim = plan.attention
    rows = []
    for ctx in plan.contexts:
        case = f"ctx={ctx}"
        a3b_bytes = int(kv_cache.bytes_per_token_layer(
            kv_cache.AttentionShape("bench", kv_heads, dim, 1), "a3b", plan.group) * ctx)
        fp16_bytes = 2 * ctx * kv_heads * dim * 2
        q = torch.randn(1, heads, dim, device=dev).to(torch.bfloat16)
        lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
        paged = copies(plan, lambda: random_paged(plan, ctx), a3b_bytes)
        rows.append(Timing("attention", case, "A3B Triton", time_us(
            plan, lambda i: a3b_kv.paged_decode_attention(q, *paged[i % len(paged)][:2], paged[i % len(paged)][2],
                                                          lens)), a3b_bytes))
        if cuda_ext:
            from a3b_kernels import cuda

            rows.append(Timing("attention", case, "A3B CUDA", time_us(
                plan, lambda i: cuda.paged_decode_attention(q, *paged[i % len(paged)][:2], paged[i % len(paged)][2],
                                                            lens)), a3b_bytes))
        del paged
        dense = copies(plan, lambda: (torch.randn(1, kv_heads, ctx, dim, device=dev).half(),
                                      torch.randn(1, kv_heads, ctx, dim, device=dev).half()), fp16_bytes)
        q16 = q.half()[:, :, None, :]
        rows.append(Timing("attention", case, "fp16 SDPA", time_us(
            plan, lambda i: torch.nn.functional.scaled_dot_product_attention(
                q16, dense[i % len(dense)][0], dense[i % len(dense)][1], enable_gqa=True)), fp16_bytes))
        del dense
    return rows


# --------------------------------------------------------------------------- report
def weight_shapes(rows: list[Timing]) -> list[str]:
    """The "NxK" weight shapes timed, in order."""
    return list(dict.fromkeys(r.case.split(" ")[0] for r in rows if r.bench == "linear"))


def goals(rows: list[Timing], copy_gbps: float) -> list[str]:
    """The issue's H200 goals, met or missed, from this run's figures."""
    rows = [r for r in rows if r.bench == "linear"]

    def us(case, variant):
        return next((r.us for r in rows if r.case == case and r.variant == variant), None)

    out = []
    best_a3b = [r for r in rows if r.case == "8192x8192 M=1" and r.variant.startswith("A3B") and r.us]
    if best_a3b:
        best = min(best_a3b, key=lambda r: r.us)
        cublas = us("8192x8192 M=1", "bf16 cuBLAS")
        if cublas:
            out.append(f"GEMV 8192x8192 batch 1: {best.variant} {cublas / best.us:.2f}x faster than bf16 cuBLAS "
                       f"(goal >= 3x: {'met' if cublas / best.us >= 3 else 'MISSED'})")
        share = best.gbps / copy_gbps
        out.append(f"GEMV 8192x8192 batch 1: {best.gbps:.0f} GB/s = {share:.0%} of the copy bandwidth "
                   f"(goal >= 80%: {'met' if share >= 0.8 else 'MISSED'})")
    for m in (1, 4, 16):
        for shape in weight_shapes(rows):
            case = f"{shape} M={m}"
            a3b = min((r.us for r in rows if r.case == case and r.variant.startswith("A3B") and r.us), default=None)
            int4 = us(case, "torch int4")
            if a3b and int4:
                out.append(f"{case}: A3B {a3b:.1f} us vs torch int4 {int4:.1f} us "
                           f"({'faster' if a3b < int4 else 'SLOWER'})")
    return out


def markdown(rows: list[Timing], copy_gbps: float, device: str, checked: list, notes: list[str],
             plan: Plan = GPU) -> str:
    lines = [f"# A3B kernels on {device}", "",
             "Command: `make bench-gpu` (perf/gpu_kernels.py). Per-call time from CUDA-graph replays of "
             f"{plan.iters} calls (median of 5 replays), operands rotated through >= {plan.rotate_bytes / 2**20:g} MiB so L2 does not serve them.", "",
             f"Device-to-device copy: {copy_gbps:.0f} GB/s (read + write).", "", "## Checks against the torch reference",
             "", "| kernel | max error / max reference | passed |", "|---|---|---|"]
    lines += [f"| {name} | {err:.2e} | {'yes' if ok else 'NO'} |" for name, err, ok in checked]
    for bench in ("linear", "attention"):
        lines += ["", f"## {bench}", "", "| case | variant | us | GB/s | share of copy | note |", "|---|---|---|---|---|---|"]
        for r in rows:
            if r.bench == bench:
                us = f"{r.us:.1f}" if r.us else "-"
                gbps = f"{r.gbps:.0f}" if r.gbps else "-"
                share = f"{r.gbps / copy_gbps:.0%}" if r.gbps else "-"
                lines.append(f"| {r.case} | {r.variant} | {us} | {gbps} | {share} | {r.note} |")
    lines += sweep_lines(rows, copy_gbps)
    lines += ["", "## Goals", ""] + [f"- {g}" for g in goals(rows, copy_gbps)] + ["", "## Memory", ""]
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def sweep_lines(rows: list[Timing], copy_gbps: float) -> list[str]:
    """Per case of the launch sweep: the fastest launch against the default one."""
    sweep = [r for r in rows if r.bench == "sweep" and r.us]
    if not sweep:
        return []
    lines = ["", "## Triton matmul launch sweep (fastest of each case; every launch in gpu_kernels.json)", "",
             "| case | fastest launch | us | share of copy | default launch us |", "|---|---|---|---|---|"]
    for case in dict.fromkeys(r.case for r in sweep):
        runs = [r for r in sweep if r.case == case]
        best = min(runs, key=lambda r: r.us)
        default = next((f"{r.us:.1f}" for r in runs if r.note == "default"), "-")
        lines.append(f"| {case} | {best.variant} | {best.us:.1f} | {best.gbps / copy_gbps:.0%} | {default} |")
    return lines


def plot(rows: list[Timing], copy_gbps: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = weight_shapes(rows)
    fig, axes = plt.subplots(1, len(shapes) + 1, figsize=(5 * (len(shapes) + 1), 4))
    for ax, shape in zip(axes, shapes):
        for variant in sorted({r.variant for r in rows if r.bench == "linear"}):
            points = [(int(r.case.split("M=")[1]), r.us) for r in rows
                      if r.bench == "linear" and r.variant == variant and r.case.startswith(f"{shape} ") and r.us]
            if points:
                ax.plot(*zip(*points), marker="o", label=variant)
        ax.set(title=f"W {shape}", xlabel="batch M", ylabel="us (median)", xscale="log", yscale="log")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    ax = axes[-1]
    for variant in sorted({r.variant for r in rows if r.bench == "attention"}):
        points = [(int(r.case.split("=")[1]), r.us) for r in rows
                  if r.bench == "attention" and r.variant == variant and r.us]
        if points:
            ax.plot(*zip(*points), marker="o", label=variant)
    ax.set(title="paged decode attention", xlabel="context tokens", ylabel="us (median)",
           xscale="log", yscale="log")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.suptitle(f"A3B kernels; copy bandwidth {copy_gbps:.0f} GB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out: Path, rows: list[Timing], copy_gbps: float, device: str, checked: list,
                 notes: list[str], plan: Plan = GPU) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_kernels.md").write_text(markdown(rows, copy_gbps, device, checked, notes, plan))
    (out / "gpu_kernels.json").write_text(json.dumps(
        {"device": device, "copy_gbps": copy_gbps, "checks": checked, "notes": notes,
         "timings": [dataclasses.asdict(r) | {"gbps": r.gbps} for r in rows]}, indent=1))
    plot(rows, copy_gbps, out / "gpu_kernels.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "perf" / "results" / "gpu")
    parser.add_argument("--iters", type=int, default=GPU.iters)
    parser.add_argument("--no-cuda-ext", action="store_true", help="skip building and timing the CUDA C++ kernels")
    parser.add_argument("--smoke", action="store_true",
                        help="every code path on the CPU at tiny sizes, under Triton's interpreter (no figures)")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' modules are imported
    import torch
    import triton

    plan = dataclasses.replace(SMOKE if args.smoke else GPU, iters=SMOKE.iters if args.smoke else args.iters)
    if plan.device == "cuda" and not torch.cuda.is_available():
        print("perf/gpu_kernels.py needs a CUDA GPU and torch with CUDA; this machine has neither "
              f"(torch {torch.__version__}); --smoke runs its code paths on the CPU", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if plan.device == "cuda" else "CPU, Triton interpreter (smoke run)"
    device = f"{name} (torch {torch.__version__}, Triton {triton.__version__}, CUDA {torch.version.cuda})"
    print(f"device: {device}", flush=True)
    cuda_ext = plan.device == "cuda" and not args.no_cuda_ext
    if cuda_ext:
        print("building the CUDA C++ kernels (torch extension)...", flush=True)
        from a3b_kernels import cuda

        cuda.ops()
    checked = checks(plan, cuda_ext)
    for check, err, ok in checked:
        print(f"check {check}: {err:.2e} {'ok' if ok else 'FAILED'}", flush=True)
    copy_gbps = copy_bandwidth(plan)
    print(f"copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
    rows, notes = time_linear(plan, cuda_ext)
    rows += time_attention(plan, cuda_ext)
    rows += time_sweep(plan)
    write_report(args.out, rows, copy_gbps, device, checked, notes, plan)
    print(markdown(rows, copy_gbps, device, checked, notes, plan))
    print(f"wrote {args.out}/gpu_kernels.{{md,json,png}}")
    return 0 if all(ok for _, _, ok in checked) else 1


if __name__ == "__main__":
    sys.exit(main())

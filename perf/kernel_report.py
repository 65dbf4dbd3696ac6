"""make kernel-report: what the compiled Triton kernels are, read statically on the CPU (no GPU).

Every build of a3b_kernels/triton/aot.py is compiled for sm_90a (H100/H200) and sm_80 (A100) under
Triton 3.6 (the GPU hosts' version, .venv/triton-3.6) and the venv's Triton, each in a process of
its own. From each cubin, with the cuobjdump its Triton ships:
- registers per thread, local memory per thread (spills) and shared memory (`--dump-resource-usage`,
  and the compiled kernel's dynamic shared memory);
- the main loop, read from the SASS (`-sass`): the backward branch whose body holds the most global
  loads; its instruction count, its global loads by width, and its instructions per weight (per
  cached K/V value for attention): the body's instructions over what one thread consumes per trip.
Then, per launch the dispatchers choose at Qwen3.6-35B-A3B's shapes (the dense linears of its real
config, its experts, 128K-token decode attention) and at 8192x8192: the grid, the theoretical
occupancy from registers, shared memory and the launch, the waves on 132 SMs (H100/H200) and 108
(A100), and the bytes limit: the time the kernel's bytes take at the copy bandwidth `make
bench-gpu` measured on an H200 (perf/results/gpu/gpu_kernels.json).

This is a static analysis of compiled code, not a timing: nothing here ran on a GPU.

    python perf/kernel_report.py            # writes perf/results/kernels_static/
    python perf/kernel_report.py --worker   # one Triton's builds as JSON lines (run by the above)
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from a3b_backend.profiles import PROJECT_ROOT

OUT = PROJECT_ROOT / "perf" / "results" / "kernels_static"
TRITON_36 = PROJECT_ROOT / ".venv" / "triton-3.6"
GPU_RESULTS = PROJECT_ROOT / "perf" / "results" / "gpu" / "gpu_kernels.json"
SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
GOAL_REGISTERS = {"gemv": 96, "matmul": 96, "moe": 96, "kv decode": 128}


@dataclasses.dataclass(frozen=True)
class Gpu:
    """What bounds occupancy on one architecture (CUDA's occupancy rules)."""
    name: str
    sms: int
    registers: int = 65536  # per SM
    register_unit: int = 256  # per warp
    max_warps: int = 64
    max_blocks: int = 32
    shared: int = 233472  # bytes per SM
    shared_reserved: int = 1024  # per block

    def blocks_per_sm(self, registers: int, warps: int, shared: int) -> int:
        per_warp = math.ceil(registers * 32 / self.register_unit) * self.register_unit
        by_registers = self.registers // per_warp // warps
        by_shared = self.shared // (shared + self.shared_reserved) if shared else self.max_blocks
        return min(by_registers, self.max_warps // warps, self.max_blocks, by_shared)


GPUS = {"sm_90a": Gpu("H100/H200", 132), "sm_80": Gpu("A100", 108, shared=167936)}


# ---------------------------------------------------------------------------------------------
# The worker: this Triton's builds, read from their cubins
def load_width(opcode: str) -> int:
    parts = opcode.split(".")
    for bits, names in ((128, ("128",)), (64, ("64",)), (16, ("U16", "S16")), (8, ("U8", "S8"))):
        if any(name in parts for name in names):
            return bits
    return 32


def main_loop(sass: str) -> dict | None:
    """The backward branch whose body holds the most global loads: its instructions and loads."""
    code = [(int(m[1], 16), m[3], m[4].strip()) for m in SASS_LINE.finditer(sass)]
    best = None
    for address, opcode, operands in code:
        target = re.match(r"0x([0-9a-f]+)", operands)
        if opcode != "BRA" or not target or int(target[1], 16) >= address:
            continue
        body = [(a, o) for a, o, _ in code if int(target[1], 16) <= a <= address]
        loads = [o for _, o in body if o.startswith(("LDG", "LDGSTS"))]
        if best is None or (len(loads), len(body)) > (len(best["loads"]), best["instructions"]):
            best = {"from": hex(int(target[1], 16)), "to": hex(address), "instructions": len(body), "loads": loads}
    if best is None:
        return None
    widths: dict[str, int] = {}
    for opcode in best.pop("loads"):
        key = f"{'cp.async ' if opcode.startswith('LDGSTS') else ''}{load_width(opcode)}-bit"
        widths[key] = widths.get(key, 0) + 1
    return {**best, "global_loads": widths}


def resources(dump: str) -> dict[str, int]:
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", dump)
    return {key: int(value) for key, value in zip(("registers", "stack", "static_shared", "local"), found.groups())}


def worker(jobs: list[dict]) -> None:
    """Each job ({"build": name, "values": its integer arguments}) compiled for every target as the
    runtime specializes it; one JSON line each."""
    import triton

    from a3b_kernels.triton.aot import TARGETS, builds

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    by_name = {build.name: build for build in builds()}
    with tempfile.TemporaryDirectory() as tmp:
        for job, (target, gpu) in itertools.product(jobs, TARGETS.items()):
            build = by_name[job["build"]].specialized(job["values"])
            kernel = build.compile(gpu)
            cubin = Path(tmp) / "kernel.cubin"
            cubin.write_bytes(kernel.asm["cubin"])
            dump = subprocess.run([tools / "cuobjdump", "--dump-resource-usage", cubin], capture_output=True,
                                  text=True, check=True).stdout
            sass = subprocess.run([tools / "cuobjdump", "-sass", cubin], capture_output=True, text=True,
                                  check=True).stdout
            loop = main_loop(sass)
            row = {"triton": triton.__version__, "target": target, "build": build.name, "values": job["values"],
                   "num_warps": build.num_warps, "num_stages": build.num_stages,
                   "dynamic_shared": kernel.metadata.shared, **resources(dump), "main_loop": loop}
            if loop and build.per_iteration:
                count, unit = build.per_iteration
                per_thread = count / (build.num_warps * 32)
                row.update(per_thread_per_trip=per_thread, unit=unit,
                           instructions_per_unit=round(loop["instructions"] / per_thread, 2))
            print(json.dumps(row), flush=True)


# ---------------------------------------------------------------------------------------------
# The report
def compile_all(jobs: list[dict]) -> list[dict]:
    """The jobs compiled under Triton 3.6 and the venv's, each in a process of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    rows = []
    for label, path in (("3.6", str(TRITON_36)), ("venv", "")):
        done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(jobs)], capture_output=True,
                              text=True, env={**env, **({"PYTHONPATH": path} if path else {})})
        if done.returncode != 0:
            raise SystemExit(f"compiling under Triton {label} failed:\n{done.stderr[-3000:]}")
        rows += [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return rows


def qwen36_linears() -> dict[str, tuple[int, int]]:
    """(N, K) of Qwen3.6-35B-A3B's quantized dense linears and one expert's, from its real-width config."""
    from convert_scale import config_for
    from transformers import AutoConfig, AutoModelForCausalLM

    import torch
    from a3b_backend.quant import calibrate

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config_for(4)))
    shapes = {}
    for name, linear in calibrate.quantized_linears(model).items():
        shapes.setdefault(name.split(".", 3)[-1], tuple(linear.weight.shape))
    experts = next(iter(calibrate.stacked_experts(model).values()))
    shapes["mlp.experts (gate_up, one expert)"] = tuple(experts.gate_up_proj.shape[1:])
    shapes["mlp.experts (down, one expert)"] = tuple(experts.down_proj.shape[1:])
    return shapes


def a3b_bytes(n: int, k: int, group: int = 128) -> int:
    """A 1 x group A3B weight's stored bytes: codes, 3 block bytes, 2 bf16 row scales."""
    return n * k // 2 + 3 * n * math.ceil(k / group) + 4 * n


def launches(shapes: dict[str, tuple[int, int]]) -> list[dict]:
    """Each launch the dispatchers choose at these shapes: its build, programs and bytes."""
    from a3b_kernels.kv_cache import GROUP as KV_GROUP
    from a3b_kernels.occupancy import splits_to_fill
    from a3b_kernels.triton import a3b_gemv
    from a3b_kernels.triton.a3b_matmul import DECODE_ROWS, launch_for
    from a3b_kernels.triton.aot import KV_HEAD_DIM, KV_PAGE

    out = []
    dense = {name: nk for name, nk in shapes.items() if "experts" not in name} | {"8192x8192": (8192, 8192)}
    for name, (n, k) in dense.items():  # one row of x: the GEMV without a table, a3b_matmul's default
        split = a3b_gemv.split_k_for(n, math.ceil(k / 128))
        out.append({"kernel": "gemv", "case": f"{name} {n}x{k} M=1", "split_k": split,
                    "build": f"gemv 1x128 split_k={4 if split > 1 else 1}",
                    "values": {"word_stride": k // 8, "row_words": k // 8, "N": n, "K": k,
                               "n_kblocks": math.ceil(k / 128), "nibble_mask": a3b_gemv.NIBBLE_AT_TOP,
                               "bit_mask": a3b_gemv.BIT_AT_TOP, "one": a3b_gemv.FLOAT_ONE},
                    "programs": math.ceil(n / a3b_gemv.BLOCK_N) * split, "bytes": a3b_bytes(n, k) + 2 * k + 4 * n})
    for (name, (n, k)), m in itertools.product(dense.items(), (1, 4, 16)):  # M=1: the table kernel's launch
        launch = launch_for(m)
        tiles = math.ceil(m / launch.block_m) * math.ceil(n / launch.block_n)
        split = 1 if launch.per_sm is None else splits_to_fill(tiles, math.ceil(k / 128), launch.per_sm)
        rows = 1 if m == 1 else 8 if m <= DECODE_ROWS else 64
        out.append({"kernel": "matmul", "case": f"{name} {n}x{k} M={m}" + (", table (launch=)" if m == 1 else ""),
                    "build": f"matmul 1x128 M={rows} split_k={4 if split > 1 else 1}",
                    "values": {"word_stride": k // 8, "row_words": k // 8, "M": m, "N": n, "K": k,
                               "n_kblocks": math.ceil(k / 128)},
                    "programs": tiles * split, "bytes": a3b_bytes(n, k) + 2 * m * k + 4 * m * n})
    up_n, up_k = shapes["mlp.experts (gate_up, one expert)"]
    down_n, down_k = shapes["mlp.experts (down, one expert)"]
    for tokens in (1, 4, 16):
        active = min(8 * tokens, 256)  # at most one block of 16 rows each: every routed row its own expert
        for name, n, k, x_by_token in (("gate/up", up_n, up_k, True), ("down", down_n, down_k, False)):
            out.append({"kernel": "moe", "case": f"experts {name} {n}x{k}, {tokens} token(s) x top-8",
                        "build": f"moe 1x128 x_by_token={x_by_token}", "programs": active * math.ceil(n / 64),
                        "values": {"word_stride": k // 8, "row_words": k // 8, "num_rows": 8 * tokens, "N": n,
                                   "K": k, "n_kblocks": math.ceil(k / 128), "top_k": 8},
                        "bytes": active * a3b_bytes(n, k) + 2 * 8 * tokens * k + 4 * 8 * tokens * n})
    for context in (8192, 131072):
        pages = context // KV_PAGE
        per_split = math.ceil(pages / splits_to_fill(2, pages, per_sm=4))
        out.append({"kernel": "kv decode", "case": f"decode attention, 1 sequence x {context} tokens, 2 KV heads",
                    "build": "kv decode", "programs": 2 * math.ceil(pages / per_split),
                    "values": {"heads": 16, "kv_heads": 2, "max_pages": pages, "pages_per_split": per_split},
                    "bytes": context * 2 * 2 * (KV_HEAD_DIM // 2 + KV_HEAD_DIM // KV_GROUP * 3 * 2)})
    return out


def launch_rows(builds: list[dict], launch_list: list[dict], copy_gbps: float) -> list[dict]:
    rows = []
    for launch, build in itertools.product(launch_list, builds):
        if (build["build"], build["values"]) != (launch["build"], launch["values"]):
            continue
        gpu = GPUS[build["target"]]
        per_sm = gpu.blocks_per_sm(build["registers"], build["num_warps"], build["dynamic_shared"])
        rows.append({**launch, "triton": build["triton"], "target": build["target"], "registers": build["registers"],
                     "blocks_per_sm": per_sm, "occupancy": per_sm * build["num_warps"] / gpu.max_warps,
                     "waves": launch["programs"] / (per_sm * gpu.sms),
                     "bytes_limit_us": launch["bytes"] / copy_gbps / 1e3})
    return rows


def arguments(values: dict[str, int]) -> str:
    """A launch's shape arguments (not the strides and bit masks they imply)."""
    return " ".join(f"{name}={value}" for name, value in values.items()
                    if name not in ("word_stride", "row_words", "nibble_mask", "bit_mask", "one"))


def markdown(builds: list[dict], launch_list: list[dict], copy_gbps: float, versions: list[str]) -> str:
    from a3b_kernels.triton import a3b_gemv

    lines = ["# A3B's Triton kernels, read statically from their compiled code (no GPU)", "",
             "Command: `make kernel-report` (perf/kernel_report.py). **A static analysis of cubins compiled on the "
             f"CPU, not a timing.** Triton versions: {', '.join(versions)} (3.6 is the GPU hosts'). Targets: "
             "sm_90a (H100/H200, 132 SMs) and sm_80 (A100, 108 SMs). Registers, local memory (spills) and shared "
             "memory from `cuobjdump --dump-resource-usage`; the main loop from `cuobjdump -sass` (the backward "
             "branch whose body holds the most global loads); instructions per weight = the loop body's "
             "instructions over the weights one thread consumes per trip. Occupancy by CUDA's rules from "
             "registers, shared memory and the launch's warps.", "",
             "## Builds", "",
             "Each build is compiled as Triton's runtime specializes it for the launch's arguments (integers of 1 "
             "become constants; integers divisible by 16 and the pointers carry the 16-divisibility hint that "
             "vectorizes loads): without that hint the same kernels load their codes 32 bits at a time.", "",
             "| Triton | target | build | arguments | registers | spills (local B) | shared B | warps | "
             "loop instructions | global loads in the loop | instructions per weight |", "|---" * 11 + "|"]
    for b in builds:
        loop = b["main_loop"] or {}
        loads = ", ".join(f"{n} x {w}" for w, n in sorted(loop.get("global_loads", {}).items())) or "-"
        per = f"{b['instructions_per_unit']} per {b['unit']}" if "instructions_per_unit" in b else "-"
        lines.append(f"| {b['triton']} | {b['target']} | {b['build']} | {arguments(b['values'])} | {b['registers']} | "
                     f"{b['local']} | "
                     f"{b['dynamic_shared'] + b['static_shared']} | {b['num_warps']} | "
                     f"{loop.get('instructions', '-')} | "
                     f"{loads} | {per} |")
    lines += ["", f"## Launches at Qwen3.6-35B-A3B's shapes and 8192x8192 (bytes limit at {copy_gbps:.0f} GB/s, "
              "the H200 copy `make bench-gpu` measured)", "",
              "| Triton | target | case | build | registers | programs | blocks per SM | occupancy | waves | "
              "MB read | bytes limit us |", "|---" * 11 + "|"]
    for r in launch_rows(builds, launch_list, copy_gbps):
        lines.append(f"| {r['triton']} | {r['target']} | {r['case']} | {r['build']} | {r['registers']} | "
                     f"{r['programs']} | {r['blocks_per_sm']} | {r['occupancy']:.1%} | {r['waves']:.2f} | "
                     f"{r['bytes'] / 1e6:.2f} | {r['bytes_limit_us']:.1f} |")
    lines += ["", "## Against the issue's static goals (sm_90a, Triton 3.6)", ""]
    for r in launch_rows(builds, launch_list, copy_gbps):
        if r["kernel"] != "gemv" or r["target"] != "sm_90a" or not r["triton"].startswith("3.6"):
            continue
        slots = r["blocks_per_sm"] * GPUS["sm_90a"].sms
        waves = math.ceil(r["programs"] / slots)
        last = r["programs"] - (waves - 1) * slots
        kblocks = r["values"]["n_kblocks"]
        busy = r["programs"] // r["split_k"] * kblocks / (waves * slots * math.ceil(kblocks / r["split_k"]))
        # the split assumes BLOCKS_PER_SM; a build whose registers allow another count misses the goal
        whole = (waves == 1 or last >= 0.9 * slots) and r["blocks_per_sm"] == a3b_gemv.BLOCKS_PER_SM
        lines.append(f"- gemv launch {r['case']}: split-K {r['split_k']} of {kblocks} K blocks, {r['programs']} "
                     f"programs in {waves} wave(s) of {slots} ({r['blocks_per_sm']} blocks x {GPUS['sm_90a'].sms} "
                     f"SMs; the kernel assumes {a3b_gemv.BLOCKS_PER_SM}), the last {last / slots:.0%} full, "
                     f"{busy:.0%} of the slot time busy (goal: no part-full wave after a full one, at the "
                     "blocks per SM the split assumes): "
                     f"{'met' if whole else 'MISSED'}")
    for b in builds:
        if b["target"] != "sm_90a" or not b["triton"].startswith("3.6"):
            continue
        kind = next((k for k in GOAL_REGISTERS if b["build"].startswith(k)), None)
        if kind is None:
            continue
        # the codes in 16-byte loads, and x in nothing narrower than 32 bits (the block bytes are 8-bit)
        loads = (b["main_loop"] or {}).get("global_loads", {})
        widths = {int(w.split()[-1].removesuffix("-bit")) for w in loads}
        wide = 128 in widths and not widths & {16, 32, 64}
        per = b.get("instructions_per_unit")
        met = b["registers"] <= GOAL_REGISTERS[kind] and b["local"] == 0 and wide and (
            kind == "kv decode" or (per is not None and per <= 5))
        lines.append(f"- {b['build']} ({arguments(b['values'])}): {b['registers']} registers "
                     f"(goal <= {GOAL_REGISTERS[kind]}), spills "
                     f"{b['local']} B, loop loads {', '.join(sorted(loads)) or 'none'} "
                     f"({'codes 128-bit, x wide' if wide else 'not the codes in 128 bits and x in 32 or more'})"
                     + (f", {per} instructions per weight (goal <= 5)" if kind != "kv decode" else "")
                     + f": {'met' if met else 'MISSED'}")
    return "\n".join(lines + ["", "![registers](registers.png)", ""])


def plot(builds: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [{**b, "label": f"{b['build']} {arguments(b['values'])}"} for b in builds if b["target"] == "sm_90a"]
    names = sorted({b["label"] for b in shown})
    versions = sorted({b["triton"] for b in shown})
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(names) + 1.2))
    for offset, version in enumerate(versions):
        regs = {b["label"]: b["registers"] for b in shown if b["triton"] == version}
        ax.barh([i + 0.4 * offset for i in range(len(names))], [regs.get(n, 0) for n in names], height=0.4,
                label=f"Triton {version}")
    ax.axvline(96, color="k", linestyle="--", linewidth=1, label="goal for GEMV/MoE: 96")
    ax.set_yticks([i + 0.2 for i in range(len(names))], names, fontsize=6)
    ax.set_xlabel("registers per thread, sm_90a (static, from cuobjdump)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", metavar="JOBS", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    launch_list = launches(qwen36_linears())
    jobs = [json.loads(key) for key in dict.fromkeys(json.dumps({"build": launch["build"], "values": launch["values"]},
                                                                sort_keys=True) for launch in launch_list)]
    builds = compile_all(jobs)
    copy_gbps = json.loads(GPU_RESULTS.read_text())["copy_gbps"]
    versions = sorted({b["triton"] for b in builds})
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "kernels_static.json").write_text(json.dumps(
        {"note": "static analysis of compiled code, not a timing", "copy_gbps": copy_gbps, "builds": builds,
         "launches": launch_rows(builds, launch_list, copy_gbps)}, indent=1))
    (OUT / "kernels_static.md").write_text(markdown(builds, launch_list, copy_gbps, versions))
    plot(builds, OUT / "registers.png")
    print((OUT / "kernels_static.md").read_text())


if __name__ == "__main__":
    main()

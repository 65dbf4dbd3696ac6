"""A3B linear on the CPU through the C++ kernel in a3b_cpu.cpp (built by torch's
extension tooling on first use, `make setup` builds it ahead; cached under
$A3B_KERNEL_CACHE, default ~/.cache/a3b-triton).

Two strategies keep the weight packed in memory (docs/a3b_format.md):
  fused    codes read in place by `a3b_linear` for up to FUSED_MAX_ROWS rows of
           x (decode), one dequantize + GEMM above that (prefill);
  dequant  dequantize the whole weight on every call, then the GEMM.
bf16 x multiplies the weights' values rounded to bf16 on both paths, so that a
row's result does not depend on its batch's path beyond float32 summation
order (the model's later bf16 roundings would turn a larger difference into
bf16 steps); its GEMM runs in bf16 where the CPU has AVX512-BF16, in float32
on the same values elsewhere (torch's bf16 GEMM is a scalar loop there).
float32 x multiplies the float32 values.
The C++ kernel is compiled for up to FUSED_MAX_ROWS rows (kMaxRows);
`make bench-cpu-linear` times it, in chunks of that many rows past it, against
dequantize + GEMM by row count (perf/results/cpu_linear.md).

Under torch.compile (vLLM's compiled mode) `linear` is the torch custom op
`a3b::cpu_linear`, so the graph keeps it whole and the row count picks the
path at run time, not once at trace time; in eager mode it calls the kernel
directly, without the dispatcher's round trip on every decode call.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import tempfile
import typing
from pathlib import Path
from typing import Literal

import torch

from a3b_backend.quant.format import A3BWeight

SOURCE = Path(__file__).with_name("a3b_cpu.cpp")
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
Strategy = Literal["fused", "dequant"]
STRATEGIES: tuple[Strategy, ...] = typing.get_args(Strategy)
FUSED_MAX_ROWS = 8
BF16_GEMM = torch.cpu._is_avx512_bf16_supported()


def cache_dir() -> Path:
    return Path(os.environ.get("A3B_KERNEL_CACHE", Path.home() / ".cache" / "a3b-triton"))


@functools.cache
def ops():
    """The built extension, named by a digest of its source, torch and flags.
    Each builder works in a private directory and publishes the library with an
    atomic rename: torch's shared build directory holds a lock file that a
    process killed mid-build leaves behind, and every later engine start would
    wait on it forever."""
    digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + " ".join(CFLAGS).encode())
    name = f"a3b_cpu_{digest.hexdigest()[:16]}"
    library = cache_dir() / f"{name}.so"
    if not library.exists():
        from torch.utils.cpp_extension import load

        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent, prefix=f"{name}.build.") as build:
            module = load(name=name, sources=[str(SOURCE)], extra_cflags=CFLAGS, build_directory=build)
            os.replace(Path(build) / f"{name}.so", library)
            return module
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dequantize(weight: A3BWeight, block: tuple[int, int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W[out, in] from the packed tensors: float32, or for bfloat16 the values rounded to bf16."""
    return ops().a3b_dequantize(*weight.kernel_tensors(), weight.in_features, *block, dtype == torch.bfloat16)


def path(rows: int, strategy: Strategy) -> Strategy:
    """How `linear` multiplies `rows` rows of x under `strategy`."""
    return "fused" if strategy == "fused" and rows <= FUSED_MAX_ROWS else "dequant"


def linear(x: torch.Tensor, weight: A3BWeight, block: tuple[int, int], strategy: Strategy = "fused"
           ) -> torch.Tensor:
    """y[M, out] = x[M, in] @ W^T in x's dtype (float32 or bf16), float32 accumulation."""
    run = _linear_op if torch.compiler.is_compiling() else _linear
    return run(x, *weight.kernel_tensors(), *block, strategy)


def _linear(x: torch.Tensor, packed: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, delta: torch.Tensor,
            lo_scale: torch.Tensor, step_scale: torch.Tensor, block_rows: int, block_cols: int,
            strategy: str) -> torch.Tensor:
    kernel_tensors = (packed, lo, step, delta, lo_scale, step_scale)
    if path(x.shape[0], strategy) == "fused":
        return ops().a3b_linear(x, *kernel_tensors, block_rows, block_cols)
    # x's columns are the weight's in_features
    bf16 = x.dtype == torch.bfloat16
    weight = ops().a3b_dequantize(*kernel_tensors, x.shape[1], block_rows, block_cols, bf16)
    if bf16 and not BF16_GEMM:
        return torch.nn.functional.linear(x.float(), weight.float()).to(x.dtype)
    return torch.nn.functional.linear(x if bf16 else x.float(), weight)


_linear_op = torch.library.custom_op("a3b::cpu_linear", _linear, mutates_args=())


@_linear_op.register_fake
def _linear_shape(x: torch.Tensor, packed: torch.Tensor, *_rest) -> torch.Tensor:
    return x.new_empty((x.shape[0], packed.shape[0]))

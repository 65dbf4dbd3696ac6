"""The Triton kernels' builds for the GPUs we target (sm_90a: H100/H200; sm_80: A100), compiled
ahead of time on the CPU (`triton.compile` with a GPUTarget: no GPU needed): every launch the
dispatchers can pick, over every block shape the converter writes for the GPU kernels (1 x 2^n,
n >= 7), plus one it refuses (1x32). tests/triton_aot.py builds them all (make test);
perf/kernel_report.py reads each build's registers, spills and main loop (make kernel-report).
Import without TRITON_INTERPRET: the interpreter replaces what `triton.compile` needs."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator, Mapping

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from a3b_kernels.kv_cache import GROUP as KV_GROUP
from a3b_kernels.kv_cache import ITERATIONS as KV_ITERATIONS
from a3b_kernels.triton import a3b_gemv, a3b_kv, a3b_matmul, a3b_moe

TARGETS = {"sm_90a": GPUTarget("cuda", 90, 32), "sm_80": GPUTarget("cuda", 80, 32)}
GPU_BLOCK_COLUMNS = (128, 256)  # the converter's GPU block shapes, the smallest two
CODES = {"words_ptr": "*i32", "word_stride": "i32", "row_words": "i32", "lo_ptr": "*i8", "step_ptr": "*u8",
         "delta_ptr": "*u8", "lo_scale_ptr": "*bf16", "step_scale_ptr": "*bf16"}
GEMV = {"x_ptr": "*bf16", **CODES, "y_ptr": "*fp32", "N": "i32", "K": "i32", "n_kblocks": "i32", "nibble_mask": "i32",
        "bit_mask": "i32", "one": "i32"}
MATMUL = {"x_ptr": "*bf16", **CODES, "y_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "n_kblocks": "i32"}
MOE = {"x_ptr": "*bf16", "sorted_rows_ptr": "*i32", "block_expert_ptr": "*i32", **CODES, "y_ptr": "*fp32",
       "num_rows": "i32", "N": "i32", "K": "i32", "n_kblocks": "i32", "top_k": "i32"}
KV_WRITE = {"x_ptr": "*bf16", "slot_ptr": "*i64", "codes_ptr": "*u8", "meta_ptr": "*fp16", "heads": "i32",
            "dim": "i32"}
KV_DECODE = {"q_ptr": "*fp32", "k_codes": "*u8", "k_meta": "*fp16", "v_codes": "*u8", "v_meta": "*fp16",
             "tables_ptr": "*i32", "lens_ptr": "*i32", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32",
             "heads": "i32", "kv_heads": "i32", "max_pages": "i32", "pages_per_split": "i32", "sm_scale": "fp32"}
# Qwen3.6's attention: 16 query heads over 2 KV heads of 256, KV pages of 16 tokens
KV_HEAD_DIM, KV_QUERY_GROUP, KV_PAGE = 256, 8, 16


@dataclasses.dataclass(frozen=True)
class Build:
    name: str
    kernel: triton.runtime.JITFunction
    signature: dict[str, str]
    constants: dict[str, object]
    num_warps: int = 4
    num_stages: int = 3
    # what one program consumes in one main-loop iteration: (count, unit), for instructions per unit
    per_iteration: tuple[int, str] | None = None

    # arguments that carry Triton's 16-divisibility hint, as the runtime gives it (`specialized`)
    divisible: frozenset[str] = frozenset()

    def specialized(self, values: Mapping[str, int]) -> "Build":
        """This build as Triton's runtime compiles it for integer arguments of these values: those
        equal to 1 become constants; those divisible by 16, and every pointer (torch's allocations
        are 256-byte aligned), carry the 16-divisibility hint that lets loads be vectorized."""
        ones = {name: 1 for name, value in values.items() if value == 1}
        divisible = {name for name, value in values.items() if value % 16 == 0}
        divisible |= {name for name, kind in self.signature.items() if kind.startswith("*")}
        return dataclasses.replace(self, signature={k: v for k, v in self.signature.items() if k not in ones},
                                   constants={**self.constants, **ones}, divisible=frozenset(divisible))

    def compile(self, target: GPUTarget):
        signature = {**self.signature, **{key: "constexpr" for key in self.constants}}
        signature = {name: signature[name] for name in self.kernel.arg_names if name in signature}
        if list(signature) != self.kernel.arg_names:  # every argument typed
            raise ValueError(f"{self.name}: signature {list(signature)} is not {self.kernel.arg_names}")
        attrs = {(self.kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in self.divisible}
        return triton.compile(ASTSource(fn=self.kernel, signature=signature, constexprs=self.constants, attrs=attrs),
                              target=target, options={"num_warps": self.num_warps, "num_stages": self.num_stages})


def builds() -> Iterator[Build]:
    for group, rows, split_k in itertools.product(GPU_BLOCK_COLUMNS, (1, 8, 64), (1, 4)):
        launch = a3b_matmul.launch_for(rows)  # decode, batched decode, prefill: its three launches
        if launch.per_sm is None and split_k > 1:
            continue  # prefill launches do not split K
        yield Build(f"matmul 1x{group} M={rows} split_k={split_k}", a3b_matmul._a3b_matmul_kernel, MATMUL,
                    {"BLOCK_M": launch.block_m, "BLOCK_N": launch.block_n, "GROUP": group, "SPLIT_K": split_k},
                    launch.num_warps, launch.num_stages, (launch.block_n * group, "weight"))
    for group, split_k in itertools.product(GPU_BLOCK_COLUMNS, (1, 4)):  # decode without a table
        yield Build(f"gemv 1x{group} split_k={split_k}", a3b_gemv._a3b_gemv_kernel, GEMV,
                    {"BLOCK_N": a3b_gemv.BLOCK_N, "GROUP": group, "SPLIT_K": split_k},
                    per_iteration=(a3b_gemv.BLOCK_N * group, "weight"))
    for group, x_by_token in itertools.product(GPU_BLOCK_COLUMNS, (True, False)):  # gate/up, then down
        yield Build(f"moe 1x{group} x_by_token={x_by_token}", a3b_moe._a3b_moe_kernel, MOE,
                    {"X_BY_TOKEN": x_by_token, "BLOCK_M": 16, "BLOCK_N": 64, "GROUP": group},
                    per_iteration=(64 * group, "weight"))
    yield Build("kv write", a3b_kv._write_kernel, KV_WRITE, {"GROUP": KV_GROUP, "ITERS": KV_ITERATIONS})
    yield Build("kv decode", a3b_kv._decode_kernel, KV_DECODE,
                {"QG": KV_QUERY_GROUP, "QG_P": 16, "BLOCK_SIZE": KV_PAGE, "D": KV_HEAD_DIM, "GROUP": KV_GROUP},
                a3b_kv.DECODE_WARPS, per_iteration=(2 * KV_PAGE * KV_HEAD_DIM, "cached K/V value"))
    yield Build("refused: matmul 1x32 M=8", a3b_matmul._a3b_matmul_kernel, MATMUL,
                {"BLOCK_M": 16, "BLOCK_N": 64, "GROUP": 32, "SPLIT_K": 1})

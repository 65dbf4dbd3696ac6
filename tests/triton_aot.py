"""Compiles every Triton kernel ahead of time for the GPUs we target (sm_90a: H100/H200; sm_80:
A100) on the CPU (`triton.compile` with a GPUTarget: no GPU needed), over the launches the
dispatchers can pick and every block shape the converter writes for the GPU kernels (1 x 2^n,
n >= 7), plus one it refuses (1x32). Run in a process of its own by tests/test_kernels_aot.py: the
kernels must be imported without TRITON_INTERPRET, which the other kernel tests set before
importing them. Prints one line per build: RESULT <name> ok|failed <error>.

    python tests/triton_aot.py
"""
from __future__ import annotations

import itertools

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from a3b_kernels.kv_cache import GROUP as KV_GROUP
from a3b_kernels.kv_cache import ITERATIONS as KV_ITERATIONS
from a3b_kernels.triton import a3b_kv, a3b_matmul, a3b_moe

TARGETS = {"sm_90a": GPUTarget("cuda", 90, 32), "sm_80": GPUTarget("cuda", 80, 32)}
GPU_BLOCK_COLUMNS = (128, 256)  # the converter's GPU block shapes, the smallest two
CODES = {"words_ptr": "*i32", "word_stride": "i32", "row_words": "i32", "lo_ptr": "*i8", "step_ptr": "*u8",
         "delta_ptr": "*u8", "lo_scale_ptr": "*bf16", "step_scale_ptr": "*bf16"}
MATMUL = {"x_ptr": "*bf16", **CODES, "y_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "n_kblocks": "i32"}
MOE = {"x_ptr": "*bf16", "sorted_rows_ptr": "*i32", "block_expert_ptr": "*i32", **CODES, "y_ptr": "*fp32",
       "num_rows": "i32", "N": "i32", "K": "i32", "n_kblocks": "i32", "top_k": "i32"}
KV_WRITE = {"x_ptr": "*bf16", "slot_ptr": "*i64", "codes_ptr": "*u8", "meta_ptr": "*fp16", "heads": "i32",
            "dim": "i32"}
KV_DECODE = {"q_ptr": "*fp32", "k_codes": "*u8", "k_meta": "*fp16", "v_codes": "*u8", "v_meta": "*fp16",
             "tables_ptr": "*i32", "lens_ptr": "*i32", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32",
             "heads": "i32", "kv_heads": "i32", "max_pages": "i32", "pages_per_split": "i32", "sm_scale": "fp32"}


def builds():
    """(name, kernel, signature, constants) of every build to try."""
    for group, rows, split_k in itertools.product(GPU_BLOCK_COLUMNS, (1, 8, 64), (1, 4)):
        launch = a3b_matmul.launch_for(rows)  # decode, batched decode, prefill: its three launches
        if launch.per_sm is None and split_k > 1:
            continue  # prefill launches do not split K
        yield (f"matmul 1x{group} M={rows} split_k={split_k}", a3b_matmul._a3b_matmul_kernel, MATMUL,
               {"BLOCK_M": launch.block_m, "BLOCK_N": launch.block_n, "GROUP": group, "SPLIT_K": split_k})
    for group, x_by_token in itertools.product(GPU_BLOCK_COLUMNS, (True, False)):  # gate/up, then down
        yield (f"moe 1x{group} x_by_token={x_by_token}", a3b_moe._a3b_moe_kernel, MOE,
               {"X_BY_TOKEN": x_by_token, "BLOCK_M": 16, "BLOCK_N": 64, "GROUP": group})
    yield "kv write", a3b_kv._write_kernel, KV_WRITE, {"GROUP": KV_GROUP, "ITERS": KV_ITERATIONS}
    # Qwen3.6's attention: 16 query heads over 2 KV heads of 256
    yield ("kv decode", a3b_kv._decode_kernel, KV_DECODE,
           {"QG": 8, "QG_P": 16, "BLOCK_SIZE": 16, "D": 256, "GROUP": KV_GROUP})
    yield ("refused: matmul 1x32 M=8", a3b_matmul._a3b_matmul_kernel, MATMUL,
           {"BLOCK_M": 16, "BLOCK_N": 64, "GROUP": 32, "SPLIT_K": 1})


def main() -> None:
    for (name, fn, signature, constants), (target, gpu) in itertools.product(builds(), TARGETS.items()):
        signature = {**signature, **{key: "constexpr" for key in constants}}
        assert list(signature) == fn.arg_names, (name, list(signature), fn.arg_names)  # every argument typed
        try:
            kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants), target=gpu)
            status = "ok" if kernel.asm["cubin"] else "failed no cubin"
        except triton.CompilationError as exc:
            status = "failed " + str(exc).splitlines()[0]
        print(f"RESULT {target} {name} | {status}", flush=True)


if __name__ == "__main__":
    main()

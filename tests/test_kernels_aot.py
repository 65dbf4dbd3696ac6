"""Every Triton kernel compiled ahead of time for the GPUs we target (sm_90a: H100/H200; sm_80:
A100), on the CPU (`triton.compile` with a GPUTarget: no GPU needed), over the launches the
dispatchers can pick and every block shape the converter writes for the GPU kernels (1 x 2^n,
n >= 7). The interpreter runs the kernels' arithmetic but enforces neither target's rules (a dot's
K >= 16, for one): this is where a kernel that cannot build for a GPU shows."""
from __future__ import annotations

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from a3b_backend.quant.format import gpu_block_problem
from a3b_kernels.kv_cache import GROUP as KV_GROUP
from a3b_kernels.kv_cache import ITERATIONS as KV_ITERATIONS
from a3b_kernels.triton import a3b_kv, a3b_matmul, a3b_moe

TARGETS = {"sm_90a": GPUTarget("cuda", 90, 32), "sm_80": GPUTarget("cuda", 80, 32)}
GPU_BLOCK_COLUMNS = (128, 256)  # the converter's GPU block shapes, the smallest two
CODES = {"words_ptr": "*i32", "word_stride": "i32", "row_words": "i32", "lo_ptr": "*i8", "step_ptr": "*u8",
         "delta_ptr": "*u8", "lo_scale_ptr": "*bf16", "step_scale_ptr": "*bf16"}


def compile_for(target: str, fn, signature: dict[str, str], constants: dict[str, object]) -> None:
    signature = {**signature, **{name: "constexpr" for name in constants}}
    assert list(signature) == fn.arg_names, (list(signature), fn.arg_names)  # every argument typed
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants), target=TARGETS[target])
    assert kernel.asm["cubin"]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("group", GPU_BLOCK_COLUMNS)
@pytest.mark.parametrize("rows", [1, 8, 64])  # decode, batched decode, prefill: launch_for's three launches
@pytest.mark.parametrize("split_k", [1, 4])
def test_the_matmul_compiles(target, group, rows, split_k):
    launch = a3b_matmul.launch_for(rows)
    if launch.per_sm is None and split_k > 1:
        pytest.skip("prefill launches do not split K")
    signature = {"x_ptr": "*bf16", **CODES, "y_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "n_kblocks": "i32"}
    compile_for(target, a3b_matmul._a3b_matmul_kernel, signature,
                {"BLOCK_M": launch.block_m, "BLOCK_N": launch.block_n, "GROUP": group, "SPLIT_K": split_k})


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("group", GPU_BLOCK_COLUMNS)
@pytest.mark.parametrize("x_by_token", [True, False])  # gate/up read tokens, down reads routed rows
def test_the_moe_kernel_compiles(target, group, x_by_token):
    signature = {"x_ptr": "*bf16", "sorted_rows_ptr": "*i32", "block_expert_ptr": "*i32", **CODES,
                 "y_ptr": "*fp32", "num_rows": "i32", "N": "i32", "K": "i32", "n_kblocks": "i32", "top_k": "i32"}
    compile_for(target, a3b_moe._a3b_moe_kernel, signature,
                {"X_BY_TOKEN": x_by_token, "BLOCK_M": 16, "BLOCK_N": 64, "GROUP": group})


@pytest.mark.parametrize("target", TARGETS)
def test_the_kv_cache_kernels_compile(target):
    compile_for(target, a3b_kv._write_kernel,
                {"x_ptr": "*bf16", "slot_ptr": "*i64", "codes_ptr": "*u8", "meta_ptr": "*fp16", "heads": "i32",
                 "dim": "i32"}, {"GROUP": KV_GROUP, "ITERS": KV_ITERATIONS})
    # Qwen3.6's attention: 16 query heads over 2 KV heads of 256
    compile_for(target, a3b_kv._decode_kernel,
                {"q_ptr": "*fp32", "k_codes": "*u8", "k_meta": "*fp16", "v_codes": "*u8", "v_meta": "*fp16",
                 "tables_ptr": "*i32", "lens_ptr": "*i32", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32",
                 "heads": "i32", "kv_heads": "i32", "max_pages": "i32", "pages_per_split": "i32", "sm_scale": "fp32"},
                {"QG": 8, "QG_P": 16, "BLOCK_SIZE": 16, "D": 256, "GROUP": KV_GROUP})


def test_a_block_shape_the_converter_refuses_does_not_build():
    """1 x 32 blocks give the prefill dot a K of 4: Triton refuses to build it for either target,
    which is why the converter refuses the shape (format.gpu_block_problem)."""
    assert gpu_block_problem((1, 32)) is not None
    signature = {"x_ptr": "*bf16", **CODES, "y_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "n_kblocks": "i32"}
    with pytest.raises(triton.CompilationError):
        compile_for("sm_90a", a3b_matmul._a3b_matmul_kernel, signature,
                    {"BLOCK_M": 16, "BLOCK_N": 64, "GROUP": 32, "SPLIT_K": 1})

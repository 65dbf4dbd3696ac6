"""Triton-language A3B kernels against the torch reference, on the CPU through
Triton's interpreter (TRITON_INTERPRET=1), on fresh random inputs."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton builds the kernels: run them on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

from a3b_backend.quant.format import A3BConfig, A3BWeight, quantize, stack  # noqa: E402
from a3b_kernels import reference  # noqa: E402
from a3b_kernels.occupancy import splits_to_fill, whole_wave_splits  # noqa: E402
from a3b_kernels.triton import a3b_gemv, a3b_matmul, a3b_moe  # noqa: E402

CONFIG = A3BConfig(1, 128, iterations=2)


def test_runs_under_the_triton_make_test_asked_for():
    """`make test` runs these tests again with Triton 3.6 first on the path."""
    import triton

    expected = os.environ.get("A3B_EXPECT_TRITON")
    if expected is None:
        pytest.skip("A3B_EXPECT_TRITON not set: whatever Triton the venv has")
    assert triton.__version__.startswith(expected + "."), triton.__version__


def case(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    return x, quantize(w, CONFIG)


def kernel_weight_dtype(block_m: int) -> torch.dtype:
    """What the Triton kernel multiplies: float32 table values for one row of x, fp16 on the tensor cores."""
    return torch.float32 if block_m == 1 else torch.float16


def assert_matches(got: torch.Tensor, expected: torch.Tensor, weight_dtype: torch.dtype) -> None:
    """float32 accumulation of the same bf16 inputs and table values (the kernel's within about 2**-14 of a
    step of the reference's): summation order, and on the fp16 path a weight now and then rounded the other way."""
    tol = 1e-4 if weight_dtype == torch.float32 else 1e-3
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("m", [1, 5, 16, 33])
@pytest.mark.parametrize("n, k", [(64, 256), (96, 384), (40, 200)])
@pytest.mark.parametrize("split_k", [1, 3], ids=["stored", "split-k"])
def test_triton_a3b_matmul_matches_reference(m, n, k, split_k):
    x, q = case(m, n, k, seed=torch.seed() % 2**31)
    # the reference rounds the dequantized weight as the kernel's path does
    weight_dtype = kernel_weight_dtype(a3b_matmul.launch_for(m).block_m)
    expected = reference.a3b_matmul(x, q, CONFIG, weight_dtype)
    # poisoned: an element the kernel skips cannot pass (split-K zeroes y first and adds partial sums)
    got = torch.full_like(expected, float("nan"))
    a3b_matmul.a3b_matmul(x, q, CONFIG, out=got, split_k=split_k)
    assert not got.isnan().any()
    assert_matches(got, expected, weight_dtype)


def test_decode_calls_split_k_to_fill_the_gpu():
    assert splits_to_fill(tiles=2, max_splits=64, per_sm=2) == 64
    assert splits_to_fill(tiles=128, max_splits=64, per_sm=2) == 3
    assert splits_to_fill(tiles=512, max_splits=64, per_sm=2) == 1


def test_the_gemv_splits_k_into_one_wave():
    # 8192 rows (128 tiles) over 64 K blocks, 6 programs an SM: 6 splits of 11 blocks, 768 programs in one
    # wave of 792; filling to 8 an SM instead gave 9 splits (1152 programs, a second wave 45% full)
    assert whole_wave_splits(tiles=128, kblocks=64, blocks_per_sm=6) == 6
    assert whole_wave_splits(tiles=100, kblocks=64, blocks_per_sm=6) == 7  # six splits of 10 blocks, one of 4
    assert whole_wave_splits(tiles=8, kblocks=16, blocks_per_sm=6) == 16  # every K block its own program
    assert whole_wave_splits(tiles=4000, kblocks=64, blocks_per_sm=6) == 1  # the tiles fill waves alone
    assert whole_wave_splits(tiles=120, kblocks=13, blocks_per_sm=6) == 5  # 6 fit; 3 blocks a split need only 5


def test_triton_kernel_refuses_tiles():
    x, q = case(1, 64, 128, seed=0)
    with pytest.raises(ValueError, match="reads 1xC blocks, not 64x64"):
        a3b_matmul.a3b_matmul(x, q, A3BConfig(64, 64))


def test_triton_kernel_refuses_in_features_it_cannot_read_as_words():
    x, q = case(1, 64, 100, seed=0)
    with pytest.raises(ValueError, match="in_features must be a multiple of 8, not 100"):
        a3b_matmul.a3b_matmul(x, q, CONFIG)


def experts(count: int, n: int, k: int, g: torch.Generator) -> tuple[list[A3BWeight], A3BWeight]:
    """`count` quantized [n, k] expert weights, as a list and stacked as the MoE kernel reads them."""
    weights = [quantize(torch.randn(n, k, generator=g) * 0.05, CONFIG) for _ in range(count)]
    return weights, stack(weights)


def test_moe_align_groups_rows_by_expert_in_padded_blocks():
    ids = torch.tensor([[2, 0], [2, -1], [1, 2]])
    sorted_rows, block_expert = a3b_moe.align(ids, num_experts=4, block_m=4)
    blocks = sorted_rows.view(-1, 4).tolist()
    assert block_expert.tolist()[:3] == [0, 1, 2] and set(block_expert.tolist()[3:]) == {-1}
    assert blocks[0] == [1, 6, 6, 6] and blocks[1] == [4, 6, 6, 6] and blocks[2] == [0, 2, 5, 6]


@pytest.mark.parametrize("tokens, top_k", [(1, 8), (5, 3), (19, 2)])
def test_triton_grouped_moe_matches_reference(tokens, top_k):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    num_experts, hidden, inter = 8, 256, 128
    w13_list, w13 = experts(num_experts, 2 * inter, hidden, g)
    w2_list, w2 = experts(num_experts, hidden, inter, g)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    ids[0, -1] = -1  # another rank's expert
    weights = torch.rand(tokens, top_k, generator=g).softmax(-1)
    expected = reference.a3b_moe(x, w13_list, w2_list, weights, ids, CONFIG, kernel_weight_dtype(16))
    got = a3b_moe.a3b_moe(x, w13, w2, weights, ids, CONFIG.block_cols)
    assert not got.isnan().any()
    # the activation is rounded to bf16 between the projections: a weight rounded to the other fp16 neighbour
    # can round an activation the other way (2**-8 of it), so a few outputs move by more than fp16 rounding
    torch.testing.assert_close(got, expected, rtol=4e-3, atol=4e-3 * expected.abs().max().item())


def test_triton_grouped_matmul_writes_every_routed_row():
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    w_list, w = experts(4, 64, 256, g)
    x = torch.randn(6, 256, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 4, (6, 2), generator=g)
    sorted_rows, block_expert = a3b_moe.align(ids, 4, 16)
    got = torch.full((12, 64), float("nan"))
    a3b_moe.grouped_matmul(x, w, sorted_rows, block_expert, 12, 2, True, CONFIG.block_cols, out=got)
    expected = torch.cat([reference.a3b_matmul(x[r // 2:r // 2 + 1], w_list[ids.flatten()[r]], CONFIG,
                                               kernel_weight_dtype(16)) for r in range(12)])
    assert not got.isnan().any()
    assert_matches(got, expected, kernel_weight_dtype(16))


def test_vllm_a3b_gpu_path_runs_the_triton_kernels():
    """What the vLLM `a3b` method calls on CUDA, fed the layer's stored tensors."""
    from a3b_backend.engine import a3b_method
    from a3b_backend.quant.format import KERNEL_KINDS

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    x, q = case(3, 96, 256, seed=torch.seed() % 2**31)
    loaded = A3BWeight.for_kernels({k: getattr(q, k) for k in KERNEL_KINDS}, 96, 256)
    weight_dtype = kernel_weight_dtype(a3b_matmul.launch_for(3).block_m)
    expected = reference.a3b_matmul(x, q, CONFIG, weight_dtype)
    assert_matches(a3b_method.gpu_linear(x, loaded, CONFIG), expected, weight_dtype)
    w13_list, w13 = experts(4, 128, 256, g)
    w2_list, w2 = experts(4, 256, 64, g)
    ids = torch.tensor([[0, 3], [2, -1]])
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4]])
    x = torch.randn(2, 256, generator=g).to(torch.bfloat16)
    expected = reference.a3b_moe(x, w13_list, w2_list, weights, ids, CONFIG)
    # Both round SiLU(gate) * up to bf16 between the two matmuls, and their fp32 sums differ in order, which
    # flips that rounding by a bf16 step (2**-8 relative) now and then: over 80 seeds the largest difference
    # was 4.8e-3 of the largest output (a fixed atol of 1e-3 failed about 1 run in 40), so the bound is two
    # bf16 steps of the largest output.
    torch.testing.assert_close(a3b_method.gpu_moe(x, w13, w2, weights, ids, CONFIG.block_cols), expected,
                               rtol=1e-3, atol=2**-7 * expected.abs().max().item())


@pytest.mark.parametrize("n, k", [(64, 256), (96, 384), (40, 200), (130, 1024)])
@pytest.mark.parametrize("split_k", [None, 1, 3], ids=["default", "stored", "split-k"])
def test_triton_a3b_gemv_without_a_table_matches_reference(n, k, split_k):
    x, q = case(1, n, k, seed=torch.seed() % 2**31)
    expected = reference.a3b_matmul(x, q, CONFIG)
    got = torch.full_like(expected, float("nan"))  # poisoned: a row the kernel skips cannot pass
    a3b_gemv.a3b_gemv(x, q, CONFIG, out=got, split_k=split_k)
    assert not got.isnan().any()
    assert_matches(got, expected, torch.float32)

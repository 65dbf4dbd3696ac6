"""Triton-language A3B kernels against the torch reference, on the CPU through
Triton's interpreter (TRITON_INTERPRET=1), on fresh random inputs."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton builds the kernels: run them on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

from a3b_backend.quant.format import A3BConfig, quantize  # noqa: E402
from kernels import reference  # noqa: E402
from kernels.triton import a3b_matmul  # noqa: E402

CONFIG = A3BConfig(1, 128, iterations=2)


def case(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    return x, quantize(w, CONFIG)


@pytest.mark.parametrize("m", [1, 4, 16, 33])
@pytest.mark.parametrize("n, k", [(64, 256), (96, 384), (40, 200)])
def test_triton_a3b_matmul_matches_reference(m, n, k):
    x, q = case(m, n, k, seed=torch.seed() % 2**31)
    expected = reference.a3b_matmul(x, q, CONFIG)
    got = torch.full_like(expected, float("nan"))  # poisoned: an element the kernel skips cannot pass
    a3b_matmul.a3b_matmul(x, q, CONFIG, out=got)
    assert not got.isnan().any()
    # both accumulate in float32 from the same bf16 inputs and table values: summation order only
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_triton_kernel_refuses_tiles():
    x, q = case(1, 64, 128, seed=0)
    with pytest.raises(ValueError, match="reads 1xC blocks, not 64x64"):
        a3b_matmul.a3b_matmul(x, q, A3BConfig(64, 64))

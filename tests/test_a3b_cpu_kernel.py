"""The C++ CPU kernel against the torch reference (format.dequantize + matmul) on fresh random inputs."""
import pytest
import torch

from a3b_backend.quant.format import A3BConfig, dequantize, quantize
from a3b_kernels import cpu

CONFIGS = [A3BConfig(1, 128, iterations=2), A3BConfig(1, 64, iterations=2), A3BConfig(4, 32, iterations=2)]


def fresh(*shape, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(torch.seed() % 2**31)) * scale


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.block_rows}x{c.block_cols}")
@pytest.mark.parametrize("shape", [(96, 256), (37, 201), (130, 130)])  # partial blocks, odd widths
@pytest.mark.parametrize("strategy", cpu.STRATEGIES)
@pytest.mark.parametrize("rows", [1, 3, cpu.FUSED_MAX_ROWS, cpu.FUSED_MAX_ROWS + 1, 40])
def test_linear_matches_reference(config, shape, strategy, rows):
    q = quantize(fresh(*shape, scale=0.05), config)
    x = fresh(rows, shape[1])
    reference = x @ dequantize(q, config).T
    y = cpu.linear(x, q, config.block, strategy)
    assert y.shape == reference.shape and torch.isfinite(y).all()
    torch.testing.assert_close(y, reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item())


def test_dequantize_matches_reference_exactly_enough():
    config = A3BConfig(1, 128, iterations=2)
    q = quantize(fresh(64, 300, scale=0.05), config)
    w = cpu.dequantize(q, (1, 128))
    torch.testing.assert_close(w, dequantize(q, config), rtol=1e-6, atol=1e-7)


def test_bf16_dequantize_is_the_float32_one_rounded():
    config = A3BConfig(1, 128, iterations=2)
    q = quantize(fresh(64, 300, scale=0.05), config)
    assert torch.equal(cpu.dequantize(q, (1, 128), torch.bfloat16), cpu.dequantize(q, (1, 128)).bfloat16())


@pytest.mark.parametrize("config", CONFIGS[:2], ids=lambda c: f"{c.block_rows}x{c.block_cols}")
@pytest.mark.parametrize("strategy", cpu.STRATEGIES)
@pytest.mark.parametrize("rows", [2, cpu.FUSED_MAX_ROWS + 1, 40])
@pytest.mark.parametrize("bf16_gemm", [True, False], ids=["bf16 GEMM", "float32 GEMM"])
def test_bf16_x_multiplies_the_bf16_rounded_weights_on_every_path(config, strategy, rows, bf16_gemm, monkeypatch):
    """Fused or dequantize + GEMM (bf16, or float32 where the CPU lacks AVX512-BF16), bf16 x gets the
    float32 sum of x times the bf16-rounded weights, rounded once to bf16: the paths differ by
    summation order alone."""
    monkeypatch.setattr(cpu, "BF16_GEMM", bf16_gemm)
    # 512 outputs: at 2 rows, 48 made a single tie rounded the other way 1.04% of the results
    q = quantize(fresh(512, 256, scale=0.05), config)
    x = fresh(rows, 256).to(torch.bfloat16)
    w = cpu.dequantize(q, config.block, torch.bfloat16).float()
    expected = x.float() @ w.T
    y = cpu.linear(x, q, config.block, strategy)
    assert y.dtype == torch.bfloat16
    apart = (y.float() - expected.bfloat16().float()).abs()
    # a sum within float32 rounding of a bf16 tie may round the other way: one step (2^-7 relative); where
    # the terms cancel, both float32 sums may be off by up to n * 2^-24 of the terms' magnitudes each
    accumulation = 2 * x.shape[1] * 2**-24 * (x.float().abs() @ w.abs().T)
    assert (apart <= expected.abs() * 2**-7 + accumulation).all()
    assert (apart > 0).float().mean() < 0.01


def test_mismatched_metadata_is_refused_with_shapes():
    config = A3BConfig(1, 128, iterations=2)
    q = quantize(fresh(32, 256, scale=0.05), config)
    with pytest.raises(RuntimeError, match="metadata is 32x2 blocks, expected 32x4"):
        cpu.linear(fresh(1, 256), q, (1, 64))


def test_compiled_linear_keeps_the_custom_op_and_picks_the_path_per_call():
    config = A3BConfig(1, 128, iterations=2)
    q = quantize(fresh(48, 256, scale=0.05), config)
    compiled = torch.compile(lambda x: cpu.linear(x, q, (1, 128)), fullgraph=True, dynamic=True)
    for rows in (2, cpu.FUSED_MAX_ROWS + 3):  # one graph, both paths
        x = fresh(rows, 256)
        torch.testing.assert_close(compiled(x), cpu.linear(x, q, (1, 128)), rtol=1e-5, atol=1e-5)

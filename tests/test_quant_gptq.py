"""Error-compensating rounding onto the A3B table against nearest rounding, on fresh random layers
whose inputs are correlated (as real activations are)."""
import pytest
import torch

from a3b_backend.quant.format import KINDS, A3BConfig, check_shapes, dequantize, quantize
from a3b_backend.quant.gptq import hessian_inverse_factor, quantize_gptq, quantize_gptq_stack

CONFIG = A3BConfig(1, 128, iterations=4)


def correlated_inputs(tokens: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(width, width, generator=g) / width**0.5 + torch.eye(width)
    scales = torch.rand(width, generator=g) * 3 + 0.1
    return (torch.randn(tokens, width, generator=g) * scales) @ mixing


@pytest.mark.parametrize("shape", [(96, 256), (64, 200)])  # 200: a partial last block
def test_gptq_rounding_lowers_the_output_error(shape):
    out, inp = shape
    for seed in range(3):
        x = correlated_inputs(2048, inp, seed)
        w = torch.randn(out, inp, generator=torch.Generator().manual_seed(100 + seed))
        hessian = x.T @ x / x.shape[0]
        nearest = dequantize(quantize(w, CONFIG, col_importance=hessian.diagonal()), CONFIG)
        gptq_weight = quantize_gptq(w, CONFIG, hessian)
        check_shapes(gptq_weight, CONFIG.block)
        gptq = dequantize(gptq_weight, CONFIG)
        ref = x @ w.T
        err_nearest = (x @ nearest.T - ref).norm() / ref.norm()
        err_gptq = (x @ gptq.T - ref).norm() / ref.norm()
        assert err_gptq < 0.9 * err_nearest, (seed, float(err_gptq), float(err_nearest))


def test_first_block_keeps_the_nearest_fit_later_blocks_are_refitted():
    x = correlated_inputs(1024, 256, 7)
    w = torch.randn(32, 256)
    hessian = x.T @ x / x.shape[0]
    a, b = quantize(w, CONFIG, col_importance=hessian.diagonal()), quantize_gptq(w, CONFIG, hessian)
    for kind in ("lo_scale", "step_scale", "shape"):
        assert torch.equal(getattr(a, kind), getattr(b, kind)), kind
    for kind in ("lo", "step", "delta"):  # block 0 sees the original weights; block 1 the compensated ones
        assert torch.equal(getattr(a, kind)[:, 0], getattr(b, kind)[:, 0]), kind
    assert not torch.equal(a.step[:, 1], b.step[:, 1]) or not torch.equal(a.lo[:, 1], b.lo[:, 1])
    assert not torch.equal(a.packed, b.packed)


def test_dead_inputs_do_not_break_the_factorization():
    x = correlated_inputs(512, 128, 3)
    x[:, 5] = 0
    factor = hessian_inverse_factor(x.T @ x / 512)
    assert torch.isfinite(factor).all() and torch.equal(factor, factor.triu())


def test_the_factor_is_the_upper_cholesky_factor_of_the_damped_inverse():
    x = correlated_inputs(512, 96, 4)
    hessian = x.T @ x / 512
    factor = hessian_inverse_factor(hessian).double()
    damped = hessian.double() + 0.01 * hessian.diagonal().double().mean() * torch.eye(96, dtype=torch.float64)
    torch.testing.assert_close(factor.T @ factor, torch.linalg.inv(damped), rtol=1e-4, atol=1e-6)
    assert torch.equal(factor, factor.triu()) and (factor.diagonal() > 0).all()


@pytest.mark.parametrize("block", [(1, 128), (4, 64)])
def test_rounding_experts_together_equals_rounding_each(block):
    config = A3BConfig(*block, iterations=4)
    weights = torch.randn(3, 32, 256)
    hessians = torch.stack([(x := correlated_inputs(512, 256, seed)).T @ x / 512 for seed in range(3)])
    together = quantize_gptq_stack(weights, config, hessians)
    for e in range(3):
        alone = quantize_gptq(weights[e], config, hessians[e])
        for kind in KINDS:
            assert torch.equal(getattr(together.expert(e), kind), getattr(alone, kind)), (e, kind)

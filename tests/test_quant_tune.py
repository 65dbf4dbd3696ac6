"""End-to-end metadata tuning's parts: the trainable layer computes the stored weight, a norm's
gain scales its output (the tuning itself: tests/test_quant_sequential.py)."""

import pytest
import torch

from a3b_backend.quant.format import KINDS, A3BConfig, dequantize, quantize
from a3b_backend.quant.tune import NormGain, TunedLinear


@pytest.mark.parametrize("config", [A3BConfig(1, 32, iterations=2), A3BConfig(4, 32, iterations=2)],
                         ids=lambda c: f"{c.block_rows}x{c.block_cols}")
def test_untuned_layer_computes_and_stores_the_stored_weight(config):
    q = quantize(torch.randn(37, 70) * 0.05, config)
    x = torch.randn(5, 70)
    layer = TunedLinear(q, config, block_codes=True)
    torch.testing.assert_close(layer(x), x @ dequantize(q, config).T, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(getattr(layer.stored(q), kind), getattr(q, kind)) for kind in KINDS)


def test_norm_gain_scales_a_zero_centred_norms_output():
    weight = torch.randn(8)
    gain = NormGain(8, zero_centred=True)
    with torch.no_grad():
        gain.log_gain.copy_(torch.randn(8))
    torch.testing.assert_close(1 + gain(weight), (1 + weight) * gain.log_gain.exp())

"""A3B KV cache reference: bytes per token and the write/read round trip."""
from __future__ import annotations

import pytest
import torch

from kernels import kv_cache


def test_a3b_kv_is_under_three_tenths_of_fp16_for_qwen36_heads():
    shape = kv_cache.QWEN36
    fp16 = kv_cache.bytes_per_token_layer(shape, "fp16")
    assert fp16 == 2 * 2 * 256 * 2
    assert kv_cache.bytes_per_token_layer(shape, "fp8") == fp16 / 2
    # 128 code bytes + 2 blocks x 3 bytes + 4 bytes of row scales, per head, for K and V
    assert kv_cache.bytes_per_token_layer(shape, "a3b") == 2 * 2 * (128 + 6 + 4)
    assert kv_cache.bytes_per_token_layer(shape, "a3b") / fp16 <= 0.3
    with pytest.raises(ValueError, match="unknown KV dtype 'int2'"):
        kv_cache.bytes_per_token_layer(shape, "int2")


def test_a3b_kv_round_trip_keeps_shape_and_bounds_the_error():
    x = torch.randn(2, 37, 256, generator=torch.Generator().manual_seed(torch.seed() % 2**31))
    y = kv_cache.a3b_roundtrip(x, 128)
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert ((y - x).norm() / x.norm()).item() < 0.15

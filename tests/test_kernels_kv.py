"""A3B KV cache: bytes per token, the reference write/read round trip, and the
Triton kernels (quantize-on-write, paged GQA decode attention) against the
reference under Triton's interpreter, on fresh random inputs."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton builds the kernels: run them on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

from a3b_kernels import kv_cache  # noqa: E402
from a3b_kernels.triton import a3b_kv  # noqa: E402


def generator() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def test_a3b_kv_is_under_three_tenths_of_fp16_for_qwen36_heads():
    shape = kv_cache.QWEN36
    fp16 = kv_cache.bytes_per_token_layer(shape, "fp16")
    assert fp16 == 2 * 2 * 256 * 2
    assert kv_cache.bytes_per_token_layer(shape, "fp8") == fp16 / 2
    # 128 code bytes + 2 groups x (lo, step, d) in fp16, per head, for K and V
    assert kv_cache.bytes_per_token_layer(shape, "a3b") == 2 * 2 * (128 + 2 * 6)
    assert kv_cache.bytes_per_token_layer(shape, "a3b") / fp16 <= 0.3
    with pytest.raises(ValueError, match="unknown KV dtype 'int2'"):
        kv_cache.bytes_per_token_layer(shape, "int2")


def test_a3b_kv_round_trip_keeps_shape_and_bounds_the_error():
    x = torch.randn(37, 2, 256, generator=generator())
    y = kv_cache.a3b_roundtrip(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert ((y - x).norm() / x.norm()).item() < 0.12


def test_hadamard_rotation_is_orthonormal_and_shrinks_the_error_of_outlier_channels():
    g = generator()
    keys = torch.randn(256, 2, 256, generator=g)
    keys[..., :4] *= 8
    torch.testing.assert_close(kv_cache.rotate(kv_cache.rotate(keys)), keys, rtol=1e-5, atol=1e-5)
    plain = (kv_cache.a3b_roundtrip(keys, rotated=False) - keys).norm()
    rotated = (kv_cache.a3b_roundtrip(keys) - keys).norm()
    assert rotated < 0.8 * plain
    with pytest.raises(ValueError, match="head_dim 96 is not a power of two"):
        kv_cache.rotate(torch.zeros(2, 96))


def poisoned_cache(blocks: int, block_size: int, heads: int, dim: int, group: int) -> kv_cache.PagedA3B:
    cache = kv_cache.PagedA3B.empty(blocks, block_size, heads, dim, group)
    cache.codes.fill_(0xFF)
    cache.meta.fill_(float("nan"))
    return cache


@pytest.mark.parametrize("dim, group", [(64, 64), (256, 128), (128, 32)])
def test_triton_write_matches_the_reference_quantizer(dim, group):
    g = generator()
    tokens, heads, block_size = 11, 2, 16
    x = (torch.randn(tokens, heads, dim, generator=g) * 3).to(torch.bfloat16)
    x[..., :3] *= 6
    slots = torch.randperm(3 * block_size, generator=g)[:tokens]
    slots[4] = -1  # a padding token
    expected = poisoned_cache(3, block_size, heads, dim, group)
    got = poisoned_cache(3, block_size, heads, dim, group)
    keep = slots >= 0
    kv_cache.write(expected, x[keep], slots[keep])
    a3b_kv.write(got, x, slots)
    written = torch.zeros(3 * block_size, dtype=torch.bool)
    written[slots[keep]] = True
    written = written.view(3, block_size)
    assert not got.meta[written].isnan().any() and got.meta[~written].isnan().all()
    assert (got.codes[~written] == 0xFF).all()
    torch.testing.assert_close(got.meta[written].float(), expected.meta[written].float(), rtol=2e-3, atol=1e-4)
    # float32 sums in another order may move a value that sits on a decision boundary
    assert (got.codes[written] == expected.codes[written]).float().mean() > 0.99
    target = kv_cache.rotate(x[keep])
    rows_got = kv_cache.dequantize_rows(got.codes.view(-1, heads, dim // 2)[slots[keep]],
                                        got.meta.view(-1, heads, dim // group, 3)[slots[keep]])
    rows_ref = kv_cache.dequantize_rows(expected.codes.view(-1, heads, dim // 2)[slots[keep]],
                                        expected.meta.view(-1, heads, dim // group, 3)[slots[keep]])
    assert (rows_got - target).norm() <= 1.01 * (rows_ref - target).norm()


@pytest.mark.parametrize("heads, kv_heads, dim, group, splits",
                         [(8, 2, 64, 64, 1), (4, 1, 128, 64, 3), (6, 3, 32, 32, None)])
def test_triton_paged_decode_attention_matches_the_reference(heads, kv_heads, dim, group, splits):
    g = generator()
    seqs = kv_cache.random_sequences([1, 37, 80, 16], kv_heads, dim, group, g)
    q = torch.randn(len(seqs.lens), heads, dim, generator=g).to(torch.bfloat16)
    expected = kv_cache.paged_decode_attention(q, seqs.k, seqs.v, seqs.tables, seqs.lens)
    got = a3b_kv.paged_decode_attention(q, seqs.k, seqs.v, seqs.tables, seqs.lens, splits=splits)
    assert not got.isnan().any()
    # fp16 operands on the tensor cores (11 significant bits), float32 sums
    torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)

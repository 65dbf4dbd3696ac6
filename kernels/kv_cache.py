"""A3B KV cache: the paged layout the kernels read and write, its torch
reference (quantize-on-write, paged GQA decode attention) and bytes per token.
Its quality report is perf/kv_report.py (`make kv-report`).

Each token's K or V vector per KV head is cut into groups of GROUP channels;
a group is one A3B block (docs/a3b_format.md: 16-entry table lo + k*step +/- d,
4-bit codes) with its (lo, step, d) stored as fp16 beside the codes. Before it
is quantized, every K and V vector is rotated by the orthonormal Hadamard
matrix H of its head_dim (as QuaRot does): a few outlier channels, which real
keys have, are spread over all channels instead of setting a whole group's
range. Attention rotates the query by H (q.k = qH.kH) and the output back by H
(H is its own inverse), so nothing else changes and no calibration is needed.
Bytes per token per layer and KV head: head_dim/2 of codes + 6 per group, for
K and for V.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from a3b_backend.quant.format import assign, ceil_div, fit_blocks, pack_codes, unpack_codes

GROUP = 128  # channels of one token and head sharing a (lo, step, d) table
META_BYTES = 6  # lo, step, d as fp16
ITERATIONS = 2  # Lloyd refits after the uniform grid, as the kernels do


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    name: str
    kv_heads: int
    head_dim: int
    # layers that keep a KV cache (Gated DeltaNet layers keep a fixed-size state instead)
    attention_layers: int


# SmolLM2-135M from its config.json; Qwen3.6-35B-A3B from its model card:
# 40 layers as 10 x (3 Gated DeltaNet + 1 Gated Attention), the attention
# layers with 16 query and 2 KV heads of head_dim 256.
SMOLLM2 = AttentionShape("SmolLM2-135M", kv_heads=3, head_dim=64, attention_layers=30)
QWEN36 = AttentionShape("Qwen3.6-35B-A3B", kv_heads=2, head_dim=256, attention_layers=10)


def bytes_per_token_layer(shape: AttentionShape, dtype: str, group: int = GROUP) -> float:
    """K and V bytes one token adds to one attention layer's cache."""
    per_head = {"fp16": 2 * shape.head_dim, "fp8": shape.head_dim}.get(dtype)
    if dtype == "a3b":
        per_head = shape.head_dim / 2 + META_BYTES * ceil_div(shape.head_dim, group)
    if per_head is None:
        raise ValueError(f"unknown KV dtype {dtype!r}: fp16, fp8 or a3b")
    return 2 * shape.kv_heads * per_head


@dataclasses.dataclass
class PagedA3B:
    """One layer's K or V cache: codes uint8 [blocks, block_size, kv_heads, head_dim/2]
    (low nibble = even channel), meta fp16 [blocks, block_size, kv_heads, groups, 3]
    = (lo, step, d) per group of channels of one token and head."""
    codes: torch.Tensor
    meta: torch.Tensor

    @classmethod
    def empty(cls, blocks: int, block_size: int, kv_heads: int, head_dim: int, group: int = GROUP,
              device: str | torch.device = "cpu") -> "PagedA3B":
        if head_dim % group or group % 2:
            raise ValueError(f"head_dim {head_dim} must be a multiple of the (even) group {group}")
        return cls(torch.zeros(blocks, block_size, kv_heads, head_dim // 2, dtype=torch.uint8, device=device),
                   torch.zeros(blocks, block_size, kv_heads, head_dim // group, 3, dtype=torch.float16,
                               device=device))

    @property
    def group(self) -> int:
        return 2 * self.codes.shape[-1] // self.meta.shape[-2]


def quantize_rows(x: torch.Tensor, group: int, iterations: int = ITERATIONS) -> tuple[torch.Tensor, torch.Tensor]:
    """x[n, head_dim] -> (codes uint8 [n, head_dim/2], meta fp16 [n, head_dim/group, 3]):
    the format's fit (uniform 16-level grid, then Lloyd refits) per group,
    codes assigned against the stored fp16 table."""
    n, dim = x.shape
    blocks = x.float().reshape(-1, group)
    lo, step, d = fit_blocks(blocks, torch.ones_like(blocks), iterations, delta_within_step=False)
    meta = torch.cat([lo, step, d], 1).to(torch.float16)
    lo, step, d = meta.float().unbind(1)
    k, plus = assign(blocks, lo[:, None], step[:, None], d[:, None])
    codes = ((k.to(torch.uint8) << 1) | plus.to(torch.uint8)).reshape(n, dim)
    return pack_codes(codes), meta.reshape(n, dim // group, 3)


def dequantize_rows(codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """float32 [..., head_dim] from codes [..., head_dim/2] and meta [..., groups, 3]."""
    lead = codes.shape[:-1]
    c = unpack_codes(codes.reshape(-1, codes.shape[-1])).long()
    m = meta.reshape(-1, meta.shape[-2], 3).float()
    group = c.shape[1] // m.shape[1]
    lo, step, d = (m[..., i].repeat_interleave(group, 1) for i in range(3))
    return (lo + (c >> 1) * step + torch.where(c & 1 == 1, d, -d)).reshape(*lead, -1)


@functools.lru_cache(maxsize=None)
def _hadamard(dim: int, device: str) -> torch.Tensor:
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"head_dim {dim} is not a power of two; the A3B KV cache rotates by a {dim}x{dim} Hadamard")
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (h / dim ** 0.5).to(device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """float32 x @ H over the last dimension; applied twice it is the identity."""
    return x.float() @ _hadamard(x.shape[-1], str(x.device))


def write(cache: PagedA3B, x: torch.Tensor, slot_mapping: torch.Tensor, iterations: int = ITERATIONS) -> None:
    """Reference quantize-on-write: x[tokens, kv_heads, head_dim] (K or V),
    rotated, into slots (block * block_size + offset)."""
    tokens, heads, dim = x.shape
    codes, meta = quantize_rows(rotate(x).reshape(-1, dim), cache.group, iterations)
    block_size = cache.codes.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    cache.codes[blocks, offsets] = codes.reshape(tokens, heads, -1)
    cache.meta[blocks, offsets] = meta.reshape(tokens, heads, -1, 3)


def paged_decode_attention(q: torch.Tensor, k: PagedA3B, v: PagedA3B, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Reference: float32 out[batch, heads, head_dim] of one new query token per
    sequence over its cached tokens, GQA (heads = kv_heads * groups)."""
    batch, heads, dim = q.shape
    kv_heads = k.codes.shape[2]
    scale = dim ** -0.5 if scale is None else scale
    block_size = k.codes.shape[1]
    q = rotate(q)
    out = torch.empty(batch, heads, dim, dtype=torch.float32, device=q.device)
    for b in range(batch):
        n = int(seq_lens[b])
        pages = block_tables[b, :ceil_div(n, block_size)]
        keys = dequantize_rows(k.codes[pages], k.meta[pages]).reshape(-1, kv_heads, dim)[:n]
        values = dequantize_rows(v.codes[pages], v.meta[pages]).reshape(-1, kv_heads, dim)[:n]
        keys = keys.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        values = values.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        weights = torch.softmax((q[b][:, None, :] @ keys.transpose(1, 2))[:, 0] * scale, -1)
        out[b] = (weights[:, None, :] @ values)[:, 0]
    return rotate(out)


@dataclasses.dataclass
class PagedSequences:
    """Sequences of random K/V written into A3B caches by the reference, their
    pages scattered in the cache: the input kernels are checked on."""
    k: PagedA3B
    v: PagedA3B
    tables: torch.Tensor  # int32 [sequences, max pages + 1]: one unused column
    lens: torch.Tensor
    values: list[torch.Tensor]  # each sequence's V as written, [n, kv_heads, head_dim]
    slots: list[torch.Tensor]  # and its slots


def random_sequences(lens: list[int], kv_heads: int, dim: int, group: int, g: torch.Generator,
                     block_size: int = 16) -> PagedSequences:
    pages = [ceil_div(n, block_size) for n in lens]
    order = torch.randperm(sum(pages), generator=g)
    k, v = (PagedA3B.empty(sum(pages), block_size, kv_heads, dim, group) for _ in range(2))
    tables = torch.zeros(len(lens), max(pages) + 1, dtype=torch.int32)
    values, slots = [], []
    for b, (n, count) in enumerate(zip(lens, pages)):
        tables[b, :count] = order[sum(pages[:b]):sum(pages[:b + 1])]
        slots.append((tables[b, :count, None] * block_size + torch.arange(block_size)).flatten()[:n])
        write(k, torch.randn(n, kv_heads, dim, generator=g), slots[-1])
        values.append(torch.randn(n, kv_heads, dim, generator=g))
        write(v, values[-1], slots[-1])
    return PagedSequences(k, v, tables, torch.tensor(lens), values, slots)


def merge_splits(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Attention out [..., heads_per_kv, D] from split-K partials: running max m and
    sum l [..., splits, heads_per_kv], unnormalized acc [..., splits, heads_per_kv, D]
    (a split that saw no token has m = -inf, l = 0)."""
    top = m.amax(-2, keepdim=True)
    w = torch.exp(m - top).nan_to_num(0.0)
    return (acc * w[..., None]).sum(-3) / (l * w).sum(-2)[..., None]


def a3b_roundtrip(x: torch.Tensor, group: int = GROUP, rotated: bool = True) -> torch.Tensor:
    """x[..., head_dim] written to and read back from an A3B cache (without
    `rotated`: the plain per-group format, for comparison)."""
    y = rotate(x) if rotated else x.float()
    codes, meta = quantize_rows(y.reshape(-1, x.shape[-1]), min(group, x.shape[-1]))
    y = dequantize_rows(codes, meta).reshape(x.shape)
    return (rotate(y) if rotated else y).to(x.dtype)

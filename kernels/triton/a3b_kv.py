"""A3B KV cache kernels in the Triton language, on the paged layout of
kernels/kv_cache.py (codes [blocks, block_size, kv_heads, head_dim/2], fp16
(lo, step, d) per group of channels of one token and head):

K/V vectors and the query are rotated by the head_dim Hadamard matrix around
the kernels (kernels/kv_cache.py `rotate`; the kernels see rotated vectors).

- `write`: quantize-on-write. One program per (token, KV head, group) fits the
  group's table (the format's uniform 16-level grid, then Lloyd refits solved
  in closed form, each kept only when it lowers the error), rounds it to fp16
  and stores the 4-bit codes into the token's slot.
- `paged_decode_attention`: one query token per sequence, GQA. A program takes
  one KV head (all its query heads, so K/V are read once) and a split of the
  sequence's pages (flash-decoding), dequantizes K/V in registers and keeps an
  online softmax; the splits are merged afterwards. Q.K and P.V run on the
  tensor cores with fp16 operands and float32 sums (vLLM's attention takes
  bf16 ones): as float32 FMA dot products, the query group padded to 16 rows
  cost 16 FMAs per cached value and 255 registers (`make kernel-report`). Each
  token's (lo, step, d) are loaded once per group and broadcast over its
  channels.

Channels are handled as even/odd halves (low/high nibble), as in a3b_matmul.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from a3b_kernels.kv_cache import ITERATIONS, PagedA3B, merge_splits, rotate
from a3b_kernels.occupancy import splits_to_fill
from a3b_kernels.triton.a3b_matmul import nibble_values

# paged_decode_attention's warps: at 4, 156 registers per thread; at 8, 126 (`make kernel-report`)
DECODE_WARPS = 8


@triton.jit
def _assign(x, lo, step, d):
    """Nearest table entry (as the format's `assign`): (k, plus) and its value."""
    safe = tl.maximum(step, 1e-12)
    k_minus = tl.minimum(tl.maximum(tl.floor((x - lo + d) / safe + 0.5), 0.0), 7.0)
    k_plus = tl.minimum(tl.maximum(tl.floor((x - lo - d) / safe + 0.5), 0.0), 7.0)
    v_minus = lo + k_minus * step - d
    v_plus = lo + k_plus * step + d
    plus = tl.abs(x - v_plus) < tl.abs(x - v_minus)
    return tl.where(plus, k_plus, k_minus), plus, tl.where(plus, v_plus, v_minus)


@triton.jit
def _sq_err(xe, xo, lo, step, d):
    _, _, ve = _assign(xe, lo, step, d)
    _, _, vo = _assign(xo, lo, step, d)
    return tl.sum((xe - ve) * (xe - ve), 0) + tl.sum((xo - vo) * (xo - vo), 0)


@triton.jit
def _refit(xe, xo, lo, step, d, n):
    """Least-squares (lo, step, d) for the current assignment: value = lo + k*step + s*d,
    s = +/-1; 3x3 normal equations (+1e-9 ridge, as the reference) by Cramer's rule."""
    ke, pe, _ = _assign(xe, lo, step, d)
    ko, po, _ = _assign(xo, lo, step, d)
    se = tl.where(pe, 1.0, -1.0)
    so = tl.where(po, 1.0, -1.0)
    a00 = n + 1e-9
    a01 = tl.sum(ke, 0) + tl.sum(ko, 0)
    a02 = tl.sum(se, 0) + tl.sum(so, 0)
    a11 = tl.sum(ke * ke, 0) + tl.sum(ko * ko, 0) + 1e-9
    a12 = tl.sum(ke * se, 0) + tl.sum(ko * so, 0)
    a22 = n + 1e-9
    b0 = tl.sum(xe, 0) + tl.sum(xo, 0)
    b1 = tl.sum(ke * xe, 0) + tl.sum(ko * xo, 0)
    b2 = tl.sum(se * xe, 0) + tl.sum(so * xo, 0)
    c00 = a11 * a22 - a12 * a12
    c01 = a02 * a12 - a01 * a22
    c02 = a01 * a12 - a02 * a11
    det = a00 * c00 + a01 * c01 + a02 * c02
    safe = tl.where(det == 0.0, 1.0, det)
    new_lo = (b0 * c00 + b1 * c01 + b2 * c02) / safe
    new_step = (b0 * c01 + b1 * (a00 * a22 - a02 * a02) + b2 * (a01 * a02 - a00 * a12)) / safe
    new_d = (b0 * c02 + b1 * (a02 * a01 - a00 * a12) + b2 * (a00 * a11 - a01 * a01)) / safe
    ok = (det != 0.0) & (new_step >= 0.0) & (new_lo == new_lo) & (new_step == new_step) & (new_d == new_d)
    return tl.where(ok, new_lo, lo), tl.where(ok, new_step, step), tl.where(ok, tl.abs(new_d), d)


@triton.jit
def _write_kernel(x_ptr, slot_ptr, codes_ptr, meta_ptr, heads, dim, GROUP: tl.constexpr, ITERS: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    group = tl.program_id(2)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token: nothing to cache
        return
    ch = group * GROUP + 2 * tl.arange(0, GROUP // 2)
    src = (token * heads + head).to(tl.int64) * dim
    xe = tl.load(x_ptr + src + ch).to(tl.float32)
    xo = tl.load(x_ptr + src + ch + 1).to(tl.float32)
    lo_x = tl.minimum(tl.min(xe, 0), tl.min(xo, 0))
    unit = (tl.maximum(tl.max(xe, 0), tl.max(xo, 0)) - lo_x) / 16.0
    lo = lo_x + unit
    step = 2.0 * unit
    d = unit / 2.0
    err = _sq_err(xe, xo, lo, step, d)
    for _ in tl.static_range(ITERS):
        c_lo, c_step, c_d = _refit(xe, xo, lo, step, d, GROUP * 1.0)
        c_err = _sq_err(xe, xo, c_lo, c_step, c_d)
        better = c_err < err
        lo = tl.where(better, c_lo, lo)
        step = tl.where(better, c_step, step)
        d = tl.where(better, c_d, d)
        err = tl.where(better, c_err, err)
    # codes are assigned against the stored (fp16) table, so reading is exact
    lo = lo.to(tl.float16).to(tl.float32)
    step = step.to(tl.float16).to(tl.float32)
    d = d.to(tl.float16).to(tl.float32)
    ke, pe, _ = _assign(xe, lo, step, d)
    ko, po, _ = _assign(xo, lo, step, d)
    byte = (ke.to(tl.int32) * 2 + pe.to(tl.int32)) | ((ko.to(tl.int32) * 2 + po.to(tl.int32)) << 4)
    row = (slot * heads + head) * (dim // 2)
    tl.store(codes_ptr + row + group * (GROUP // 2) + tl.arange(0, GROUP // 2), byte.to(tl.uint8))
    meta = ((slot * heads + head) * (dim // GROUP) + group) * 3
    tl.store(meta_ptr + meta, lo.to(tl.float16))
    tl.store(meta_ptr + meta + 1, step.to(tl.float16))
    tl.store(meta_ptr + meta + 2, d.to(tl.float16))


def write(cache: PagedA3B, x: torch.Tensor, slot_mapping: torch.Tensor, iterations: int = ITERATIONS) -> None:
    """Quantize x[tokens, kv_heads, head_dim] (K or V), rotated, into the cache's slots (slot < 0: skipped)."""
    tokens, heads, dim = x.shape
    group = cache.group
    _write_kernel[(tokens, heads, dim // group)](rotate(x).contiguous(), slot_mapping, cache.codes, cache.meta, heads,
                                                 dim, GROUP=group, ITERS=iterations)


@triton.jit
def _dequant_half(codes_ptr, meta_ptr, rows, t_ok, GROUP: tl.constexpr, D: tl.constexpr):
    """K or V of tokens `rows` (cache row = slot * kv_heads + head) as even/odd float32 [BS, D/2]."""
    half = tl.arange(0, D // 2)
    byte = tl.load(codes_ptr + rows[:, None] * (D // 2) + half[None, :], mask=t_ok[:, None], other=0).to(tl.int32)
    meta = (rows[:, None] * (D // GROUP) + tl.arange(0, D // GROUP)[None, :]) * 3
    lo = _per_column(tl.load(meta_ptr + meta, mask=t_ok[:, None], other=0.0).to(tl.float32), GROUP, D)
    step = _per_column(tl.load(meta_ptr + meta + 1, mask=t_ok[:, None], other=0.0).to(tl.float32), GROUP, D)
    d = _per_column(tl.load(meta_ptr + meta + 2, mask=t_ok[:, None], other=0.0).to(tl.float32), GROUP, D)
    return nibble_values(byte, lo, step, d)


@triton.jit
def _per_column(per_group, GROUP: tl.constexpr, D: tl.constexpr):
    """[BS, D / GROUP] -> [BS, D / 2]: each group's value at each of its byte columns."""
    rows: tl.constexpr = per_group.shape[0]
    return tl.reshape(tl.broadcast_to(per_group[:, :, None], (rows, D // GROUP, GROUP // 2)), (rows, D // 2))


@triton.jit
def _decode_kernel(q_ptr, k_codes, k_meta, v_codes, v_meta, tables_ptr, lens_ptr,
                   m_ptr, l_ptr, acc_ptr, heads, kv_heads, max_pages, pages_per_split, sm_scale,
                   QG: tl.constexpr, QG_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr,
                   GROUP: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    qh = tl.arange(0, QG_P)
    q_ok = qh < QG
    half = tl.arange(0, D // 2)
    q_rows = (b * heads + h * QG + qh).to(tl.int64) * D
    qe = tl.load(q_ptr + q_rows[:, None] + 2 * half[None, :], mask=q_ok[:, None], other=0.0).to(tl.float32)
    qo = tl.load(q_ptr + q_rows[:, None] + 2 * half[None, :] + 1, mask=q_ok[:, None], other=0.0).to(tl.float32)
    qe = (qe * sm_scale).to(tl.float16)
    qo = (qo * sm_scale).to(tl.float16)
    m = tl.full((QG_P,), float("-inf"), tl.float32)
    l = tl.zeros((QG_P,), tl.float32)
    acc_e = tl.zeros((QG_P, D // 2), tl.float32)
    acc_o = tl.zeros((QG_P, D // 2), tl.float32)
    n = tl.load(lens_ptr + b)
    tok = tl.arange(0, BLOCK_SIZE)
    first = split * pages_per_split
    last = tl.minimum(first + pages_per_split, tl.cdiv(n, BLOCK_SIZE))
    for page in range(first, last):
        phys = tl.load(tables_ptr + b * max_pages + page).to(tl.int64)
        t_ok = page * BLOCK_SIZE + tok < n
        rows = (phys * BLOCK_SIZE + tok) * kv_heads + h
        ke, ko = _dequant_half(k_codes, k_meta, rows, t_ok, GROUP, D)
        s = tl.dot(qe, tl.trans(ke.to(tl.float16))) + tl.dot(qo, tl.trans(ko.to(tl.float16)))
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        ve, vo = _dequant_half(v_codes, v_meta, rows, t_ok, GROUP, D)
        acc_e = acc_e * alpha[:, None] + tl.dot(p.to(tl.float16), ve.to(tl.float16))
        acc_o = acc_o * alpha[:, None] + tl.dot(p.to(tl.float16), vo.to(tl.float16))
        m = m_new
    part = ((b * kv_heads + h) * splits + split) * QG_P + qh
    tl.store(m_ptr + part, m)
    tl.store(l_ptr + part, l)
    tl.store(acc_ptr + part[:, None] * D + 2 * half[None, :], acc_e)
    tl.store(acc_ptr + part[:, None] * D + 2 * half[None, :] + 1, acc_o)


def paged_decode_attention(q: torch.Tensor, k: PagedA3B, v: PagedA3B, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float | None = None, splits: int | None = None) -> torch.Tensor:
    """float32 out[batch, heads, head_dim]; `splits` per (sequence, KV head)
    defaults to enough programs to fill the GPU (4 per SM)."""
    batch, heads, dim = q.shape
    kv_heads, block_size = k.codes.shape[2], k.codes.shape[1]
    qg = heads // kv_heads
    qg_p = max(16, triton.next_power_of_2(qg))  # tl.dot needs 16 rows
    max_pages = block_tables.shape[1]
    if splits is None:
        splits = splits_to_fill(batch * kv_heads, max_pages, per_sm=4)
    per_split = triton.cdiv(max_pages, splits)
    splits = triton.cdiv(max_pages, per_split)
    m = torch.empty(batch, kv_heads, splits, qg_p, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(batch, kv_heads, splits, qg_p, dim, dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, kv_heads, splits)](
        rotate(q).contiguous(), k.codes, k.meta, v.codes, v.meta, block_tables, seq_lens, m, l, acc, heads,
        kv_heads, max_pages, per_split, dim ** -0.5 if scale is None else scale, QG=qg, QG_P=qg_p,
        BLOCK_SIZE=block_size, D=dim, GROUP=k.group, num_warps=DECODE_WARPS)
    return rotate(merge_splits(m, l, acc)[:, :, :qg].reshape(batch, heads, dim))

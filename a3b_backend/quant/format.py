"""The A3B weight format: 3-bit base level + 1-bit adaptive delta, per-block lookup table.

A weight matrix W[out, in] is cut into blocks of `block_rows x block_cols`.
Each block has an evenly spaced grid of 8 base levels `lo + k*step` (k = 0..7)
and an adaptive delta `d`; a weight stores k (3 bits) and a sign bit s and
dequantizes to `lo + k*step + (s ? +d : -d)`, so a block is a 16-entry table and
a weight one 4-bit code `(k << 1) | s`.

Fitting (Lloyd-style, optionally activation-weighted): start from the uniform
16-level grid over the block's range (which is exactly INT4 round-to-nearest),
then alternate nearest-table-entry assignment and a weighted least-squares refit
of (lo, step, d). Each step lowers the block's weighted squared error.

Metadata is double-quantized to keep bits/weight at or below INT4-g128's 4.25:
per block `lo` is int8 and `step` uint8 against per-block-row bf16 scales, and
`d` is uint8 as a fraction of the block's step (d = step * d_q / 255).

On-disk tensors for a linear weight `NAME.weight` (docs/a3b_format.md), their
names, dtypes and shapes given by `stored_tensors`, the one owner of the schema:
  NAME.weight_packed      uint8 [out, ceil(in/2)] codes, low nibble = even column
  NAME.weight_lo          int8  [ceil(out/R), ceil(in/C)]
  NAME.weight_step        uint8 [ceil(out/R), ceil(in/C)]
  NAME.weight_delta       uint8 [ceil(out/R), ceil(in/C)]
  NAME.weight_lo_scale    bf16  [ceil(out/R)]
  NAME.weight_step_scale  bf16  [ceil(out/R)]
  NAME.weight_shape       int32 [2]               (out, in) before padding
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Literal, Mapping

import torch

LEVELS = 8
TINY = 1e-12
Kind = Literal["packed", "lo", "step", "delta", "lo_scale", "step_scale", "shape"]
KINDS: tuple[Kind, ...] = typing.get_args(Kind)
# What the kernels read: everything but the shape record.
KERNEL_KINDS: tuple[Kind, ...] = KINDS[:-1]
METADATA = "int8-lo/uint8-step/uint8-delta+bf16-row-scales"
# The stored per-block codes' ranges (lo symmetric, so its scale is max |lo| / 127).
CODE_RANGES: dict[Kind, tuple[int, int]] = {"lo": (-127, 127), "step": (0, 255), "delta": (0, 255)}
SUPPORTED_VERSIONS = (1,)


class QuantizationError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class A3BConfig:
    block_rows: int = 1
    block_cols: int = 128
    iterations: int = 8
    version: int = 1

    def __post_init__(self):
        if self.block_rows < 1 or self.block_cols < 2 or self.block_cols % 2:
            raise QuantizationError(
                f"block shape {self.block_rows}x{self.block_cols} is invalid: rows >= 1, columns even and >= 2"
            )

    @property
    def block(self) -> tuple[int, int]:
        return self.block_rows, self.block_cols

    def to_json(self) -> dict:
        return {"quant_method": "a3b", "version": self.version, "block_shape": [self.block_rows, self.block_cols],
                "bits": 4, "base_levels": LEVELS, "metadata": METADATA}

    @classmethod
    def from_json(cls, config: dict) -> "A3BConfig":
        """The checkpoint's `quantization_config`, checked field by field."""
        def bad(field: str, allowed: str):
            return QuantizationError(
                f"quantization_config.{field} = {config.get(field)!r} is not supported; allowed: {allowed}")

        if config.get("quant_method") != "a3b":
            raise bad("quant_method", "'a3b'")
        if config.get("version") not in SUPPORTED_VERSIONS:
            raise bad("version", " or ".join(map(str, SUPPORTED_VERSIONS)) + " (this build's A3B readers)")
        shape = config.get("block_shape")
        if not (isinstance(shape, list) and len(shape) == 2 and all(type(v) is int for v in shape)):
            raise bad("block_shape", "[rows, columns], two integers")
        if config.get("bits", 4) != 4:
            raise bad("bits", "4")
        if config.get("base_levels", LEVELS) != LEVELS:
            raise bad("base_levels", str(LEVELS))
        if config.get("metadata", METADATA) != METADATA:
            raise bad("metadata", repr(METADATA))
        try:
            return cls(shape[0], shape[1], version=config["version"])
        except QuantizationError as exc:
            raise QuantizationError(f"quantization_config.block_shape: {exc}") from None


def gpu_block_problem(block: tuple[int, int]) -> str | None:
    """Why the GPU kernels cannot run `block`, or None: they read 1-row blocks whose columns are a
    power of two >= 128 (their dot products' K is a block's columns / 8, and Triton's tensor-core
    dots need K >= 16)."""
    rows, cols = block
    if rows == 1 and cols >= 128 and cols & (cols - 1) == 0:
        return None
    return (f"the GPU kernels need 1-row blocks whose columns are a power of two >= 128 "
            f"(1x128, 1x256, ...), not {rows}x{cols}")


def ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    dtype: torch.dtype
    shape: tuple[int, ...]


def stored_tensors(out_features: int, in_features: int, block: tuple[int, int]) -> dict[Kind, StoredTensor]:
    """The stored A3B tensors of one [out, in] weight in blocks of `block` (rows, columns)."""
    rows, cols = block
    block_rows, block_cols = ceil_div(out_features, rows), ceil_div(in_features, cols)
    return {
        "packed": StoredTensor(torch.uint8, (out_features, ceil_div(in_features, 2))),
        "lo": StoredTensor(torch.int8, (block_rows, block_cols)),
        "step": StoredTensor(torch.uint8, (block_rows, block_cols)),
        "delta": StoredTensor(torch.uint8, (block_rows, block_cols)),
        "lo_scale": StoredTensor(torch.bfloat16, (block_rows,)),
        "step_scale": StoredTensor(torch.bfloat16, (block_rows,)),
        "shape": StoredTensor(torch.int32, (2,)),
    }


@dataclasses.dataclass
class A3BWeight:
    """One weight's stored tensors; with a leading expert dimension on every
    field, a stack of same-shaped experts (`stack`, `expert`)."""

    packed: torch.Tensor
    lo: torch.Tensor
    step: torch.Tensor
    delta: torch.Tensor
    lo_scale: torch.Tensor
    step_scale: torch.Tensor
    shape: torch.Tensor

    @classmethod
    def for_kernels(cls, tensors: Mapping[Kind, torch.Tensor], out_features: int, in_features: int) -> "A3BWeight":
        """The weight (or a stack of experts) from its kernel tensors, as loaded into a layer, and its known shape."""
        experts = tensors["packed"].shape[:-2]
        shape = torch.tensor([out_features, in_features], dtype=torch.int32).expand(*experts, 2)
        return cls(**{kind: tensors[kind] for kind in KERNEL_KINDS}, shape=shape)

    @property
    def out_features(self) -> int:
        return int(self.shape.reshape(-1, 2)[0, 0])

    @property
    def in_features(self) -> int:
        return int(self.shape.reshape(-1, 2)[0, 1])

    def kernel_tensors(self) -> tuple[torch.Tensor, ...]:
        """packed, lo, step, delta, lo_scale, step_scale: the kernels' argument order."""
        return tuple(getattr(self, kind) for kind in KERNEL_KINDS)

    def to(self, device: torch.device | str) -> "A3BWeight":
        """The kernel tensors on `device`; the shape record stays on the host, where it is read."""
        return A3BWeight(*(getattr(self, kind).to(device) for kind in KERNEL_KINDS), shape=self.shape)

    def expert(self, index: int) -> "A3BWeight":
        return A3BWeight(*(getattr(self, kind)[index] for kind in KINDS))

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}_{kind}": getattr(self, kind) for kind in KINDS}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], prefix: str) -> "A3BWeight":
        missing = [f"{prefix}_{kind}" for kind in KINDS if f"{prefix}_{kind}" not in tensors]
        if missing:
            raise QuantizationError(f"A3B weight '{prefix}' lacks metadata tensors: {', '.join(missing)}")
        return cls(**{kind: tensors[f"{prefix}_{kind}"] for kind in KINDS})

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (getattr(self, kind) for kind in KINDS))


def stack(weights: list[A3BWeight]) -> A3BWeight:
    """Same-shaped experts' weights in the stacked layout the MoE kernels read."""
    return A3BWeight(*(torch.stack([getattr(w, kind) for w in weights]) for kind in KINDS))


# ---------------------------------------------------------------------------
# Block layout
def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out, inp = x.shape
    return torch.nn.functional.pad(x, (0, (-inp) % cols, 0, (-out) % rows))


def to_blocks(matrix: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[rows*nbr, cols*nbc] -> [nbr*nbc, rows*cols], blocks in row-major block order."""
    nbr, nbc = matrix.shape[0] // rows, matrix.shape[1] // cols
    return matrix.reshape(nbr, rows, nbc, cols).permute(0, 2, 1, 3).reshape(nbr * nbc, rows * cols)


def from_blocks(blocks: torch.Tensor, nbr: int, nbc: int, rows: int, cols: int) -> torch.Tensor:
    return blocks.reshape(nbr, nbc, rows, cols).permute(0, 2, 1, 3).reshape(nbr * rows, nbc * cols)


def weighted_blocks(w: torch.Tensor, col_importance: torch.Tensor | None, block: tuple[int, int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] and its per-weight fit weights (col_importance [in] or per row [out, in], or 1)
    as blocks; the padding of partial blocks weighs 0."""
    rows, cols = block
    out, inp = w.shape
    h_cols = torch.ones(inp) if col_importance is None else col_importance.detach().float().clamp_min(0) + 1e-8
    return (to_blocks(_padded(w, rows, cols), rows, cols),
            to_blocks(_padded(h_cols.expand(out, inp), rows, cols), rows, cols))


# ---------------------------------------------------------------------------
# Fitting
def assign(values: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, delta: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest table entry per value: (level k in 0..7, sign bit s in {0, 1})."""
    safe = step.clamp_min(TINY)
    k_minus = ((values - lo + delta) / safe).round().clamp(0, LEVELS - 1)
    k_plus = ((values - lo - delta) / safe).round().clamp(0, LEVELS - 1)
    err_minus = (values - (lo + k_minus * step - delta)).abs()
    err_plus = (values - (lo + k_plus * step + delta)).abs()
    plus = err_plus < err_minus
    return torch.where(plus, k_plus, k_minus), plus


Table = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (lo, step, delta), each [blocks, 1]


def _nearest(blocks: torch.Tensor, table: Table) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`assign` in units of the step, for the fit: (level, plus, the residual in steps)."""
    lo, step, delta = table
    inverse = 1 / step.clamp_min(TINY)
    u = (blocks - lo) * inverse
    d = delta * inverse
    k_minus = (u + d).round_().clamp_(0, LEVELS - 1)
    k_plus = (u - d).round_().clamp_(0, LEVELS - 1)
    e_minus = u - k_minus + d
    e_plus = u - k_plus - d
    plus = e_plus.abs() < e_minus.abs()
    return torch.where(plus, k_plus, k_minus), plus, torch.where(plus, e_plus, e_minus)


def _error(importance: torch.Tensor, residual: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Each block's importance-weighted squared error, from `_nearest`'s residuals."""
    return (importance * residual.square()).sum(1, keepdim=True) * step.square()


def _refit(blocks: torch.Tensor, importance: torch.Tensor, level: torch.Tensor, plus: torch.Tensor, table: Table,
           sums: tuple[torch.Tensor, torch.Tensor], delta_within_step: bool) -> Table:
    """Weighted least squares of (lo, step, delta) for fixed code assignments; `sums`: the
    assignment-free sums of importance and importance * value per block."""
    sign = plus.to(blocks.dtype) * 2 - 1
    weighted_level, weighted_sign = importance * level, importance * sign
    total, total_value = sums
    gram = torch.stack([
        torch.cat([total, weighted_level.sum(1, keepdim=True), weighted_sign.sum(1, keepdim=True)], 1),
        torch.cat([weighted_level.sum(1, keepdim=True), (weighted_level * level).sum(1, keepdim=True),
                   (weighted_level * sign).sum(1, keepdim=True)], 1),
        torch.cat([weighted_sign.sum(1, keepdim=True), (weighted_level * sign).sum(1, keepdim=True), total], 1),
    ], 1) + 1e-9 * torch.eye(3, dtype=blocks.dtype)
    rhs = torch.cat([total_value, (weighted_level * blocks).sum(1, keepdim=True),
                     (weighted_sign * blocks).sum(1, keepdim=True)], 1)
    sol, info = torch.linalg.solve_ex(gram, rhs)
    # Singular systems (constant blocks, a single code in use) keep their fit.
    ok = (info == 0).unsqueeze(-1) & torch.isfinite(sol).all(-1, keepdim=True) & (sol[:, 1:2] >= 0)
    lo, step, delta = table
    fitted_delta = sol[:, 2:3].abs()
    if delta_within_step:
        fitted_delta = fitted_delta.minimum(sol[:, 1:2])
    return (torch.where(ok, sol[:, 0:1], lo), torch.where(ok, sol[:, 1:2], step), torch.where(ok, fitted_delta, delta))


def fit_blocks(blocks: torch.Tensor, importance: torch.Tensor, iterations: int, delta_within_step: bool = True
               ) -> Table:
    """Weighted Lloyd fit of (lo, step, delta) per row of blocks [nb, n]; importance >= 0.

    delta_within_step: the weight format stores delta as a fraction of the step (uint8 / 255),
    so each refit keeps delta <= step and every table judged is one the checkpoint holds (a
    block with an outlier otherwise fits a larger delta, which storing cuts to the step). The
    KV cache stores delta in fp16 and fits without the bound.

    A block whose refit did not lower its error has converged (the same table gives the
    same assignment, so the same refit): each iteration works on the blocks that improved
    in the last, about half the work of refitting all of them every time."""
    live = importance > 0
    big = torch.finfo(blocks.dtype).max
    wmin = torch.where(live, blocks, torch.full_like(blocks, big)).amin(1, keepdim=True)
    wmax = torch.where(live, blocks, torch.full_like(blocks, -big)).amax(1, keepdim=True)
    empty = ~live.any(1, keepdim=True)
    wmin, wmax = torch.where(empty, 0.0, wmin), torch.where(empty, 0.0, wmax)
    unit = (wmax - wmin) / (2 * LEVELS)
    # The uniform 16-level grid over [min, max] at bin centres = INT4 RTN.
    table = (wmin + unit, 2 * unit, unit / 2)
    level, plus, residual = _nearest(blocks, table)
    err = _error(importance, residual, table[1])
    active = torch.arange(blocks.shape[0])
    current = table
    sums = (importance.sum(1, keepdim=True), (importance * blocks).sum(1, keepdim=True))
    for _ in range(iterations):
        candidate = _refit(blocks, importance, level, plus, current, sums, delta_within_step)
        level, plus, residual = _nearest(blocks, candidate)
        candidate_err = _error(importance, residual, candidate[1])
        better = (candidate_err < err[active]).squeeze(1)
        if not better.any():
            break
        active = active[better]
        current = tuple(t[better] for t in candidate)
        for full, value in zip(table, current):
            full[active] = value
        err[active] = candidate_err[better]
        blocks, importance, level, plus = blocks[better], importance[better], level[better], plus[better]
        sums = tuple(s[better] for s in sums)
    return table


# ---------------------------------------------------------------------------
# Metadata double quantization
def _quantize_metadata(table: Table, nbr: int, nbc: int) -> tuple[torch.Tensor, ...]:
    lo, step, delta = (t.reshape(nbr, nbc) for t in table)
    # bf16 scales: fp32's range (huge and tiny weights survive) at half the bytes;
    # the int8/uint8 values are computed against the rounded scale.
    lo_scale = (lo.abs().amax(1) / 127).clamp_min(TINY).to(torch.bfloat16).float()
    step_scale = (step.amax(1) / 255).clamp_min(TINY).to(torch.bfloat16).float()
    lo_q, step_q, delta_q = metadata_codes((lo, step, delta), lo_scale, step_scale)
    return lo_q, lo_scale, step_q, step_scale, delta_q


def metadata_codes(table: Table, lo_scale: torch.Tensor, step_scale: torch.Tensor) -> Table:
    """Stored (lo, step, delta) values of tables [nbr, k] against their rows' scales [nbr]."""
    lo, step, delta = table
    lo_q = (lo / lo_scale[:, None]).round().clamp(*CODE_RANGES["lo"])
    step_q = (step / step_scale[:, None]).round().clamp(*CODE_RANGES["step"])
    delta_q = (delta / (step_q * step_scale[:, None]).clamp_min(TINY) * 255).round().clamp(*CODE_RANGES["delta"])
    return lo_q, step_q, delta_q


def table_params(weight: A3BWeight) -> Table:
    """Per-block float (lo, step, delta), each [nbr, nbc] (of a stack: [E, nbr, nbc])."""
    lo = weight.lo.float() * weight.lo_scale.float()[..., None]
    step = weight.step.float() * weight.step_scale.float()[..., None]
    delta = step * weight.delta.float() / 255
    return lo, step, delta


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.uint8, device=packed.device)
    out[:, 0::2] = packed & 0xF
    out[:, 1::2] = packed >> 4
    return out


def quantize(weight: torch.Tensor, config: A3BConfig = A3BConfig(), col_importance: torch.Tensor | None = None,
             name: str = "weight") -> A3BWeight:
    """W[out, in] -> A3B; col_importance[in] (e.g. mean x^2 per input channel) weights the fit."""
    if weight.ndim != 2:
        raise QuantizationError(f"tensor '{name}' has shape {list(weight.shape)}; A3B quantizes 2-D weights only")
    if not torch.isfinite(weight).all():
        bad = (~torch.isfinite(weight)).nonzero()[0].tolist()
        raise QuantizationError(f"tensor '{name}' holds NaN or Inf (first at index {bad}); refusing to quantize")
    rows, cols = config.block
    w = weight.detach().float()
    out, inp = w.shape
    nbr, nbc = ceil_div(out, rows), ceil_div(inp, cols)
    wb, hb = weighted_blocks(w, col_importance, config.block)
    lo_q, lo_scale, step_q, step_scale, delta_q = _quantize_metadata(fit_blocks(wb, hb, config.iterations), nbr, nbc)
    q = A3BWeight(
        packed=torch.empty(0), lo=lo_q.to(torch.int8), step=step_q.to(torch.uint8), delta=delta_q.to(torch.uint8),
        lo_scale=lo_scale.to(torch.bfloat16), step_scale=step_scale.to(torch.bfloat16),
        shape=torch.tensor([out, inp], dtype=torch.int32),
    )
    # Codes are assigned against the stored (rounded) table, so dequantize is exact.
    level, plus = assign(wb, *(t.reshape(-1, 1) for t in table_params(q)))
    codes = from_blocks((level.to(torch.uint8) << 1) | plus.to(torch.uint8), nbr, nbc, rows, cols)
    # Padding codes are not stored: a partial last block costs only its metadata.
    q.packed = pack_codes(codes[:out, : inp + inp % 2])
    return q


def quantize_stack(weights: torch.Tensor, config: A3BConfig = A3BConfig(),
                   col_importance: torch.Tensor | None = None, name: str = "experts") -> A3BWeight:
    """Same-shaped experts' W [E, out, in] -> their stacked A3B weight (`stack`'s layout), fitted in
    one pass over all their blocks; col_importance [E, in]: each expert's own. Equal to quantizing
    each expert alone: blocks never span two experts (out is a multiple of the block's rows,
    else each is quantized alone)."""
    experts, out, inp = weights.shape
    if out % config.block_rows:
        return stack([quantize(w, config, None if col_importance is None else col_importance[e], f"{name}.{e}")
                      for e, w in enumerate(weights)])
    rows = None if col_importance is None else col_importance[:, None, :].expand(experts, out, inp).reshape(-1, inp)
    q = quantize(weights.reshape(experts * out, inp), config, rows, name=f"{name} (experts stacked along rows)")
    return A3BWeight(*(getattr(q, kind).reshape(experts, -1, *getattr(q, kind).shape[1:]) for kind in KERNEL_KINDS),
                     shape=torch.tensor([out, inp], dtype=torch.int32).repeat(experts, 1))


def check_stored_shape(name: str, kind: Kind, shape: tuple[int, ...], weight_shape: tuple[int, int],
                       block: tuple[int, int], block_from: str = "") -> None:
    """Refuse a stored tensor that does not fit an [out, in] weight in `block` blocks
    (`block_from`: where the block shape was read, for the message)."""
    out, inp = weight_shape
    expected = stored_tensors(out, inp, block)[kind].shape
    if tuple(shape) != expected:
        source = f" ({block_from})" if block_from else ""
        raise QuantizationError(f"{name} has shape {list(shape)}; a [{out}, {inp}] weight in {block[0]}x{block[1]} "
                                f"blocks{source} needs {list(expected)}")


def check_shapes(weight: A3BWeight, block: tuple[int, int], name: str = "weight") -> None:
    """Refuse tensors that do not fit the weight's recorded shape in `block` blocks."""
    for kind in KINDS:
        check_stored_shape(f"{name}_{kind}", kind, tuple(getattr(weight, kind).shape),
                           (weight.out_features, weight.in_features), block)


def dequantize(weight: A3BWeight, config: A3BConfig) -> torch.Tensor:
    """A3B -> float32 W[out, in]: one 16-entry table lookup per weight."""
    check_shapes(weight, config.block)
    return lookup(weight.packed, *table_params(weight), config.block, (weight.out_features, weight.in_features))


def lookup(packed: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, delta: torch.Tensor,
           block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """W[out, in] of `shape` from its packed 4-bit codes and per-block float lo, step and delta
    ([nbr, nbc] each): each block's 16-entry table, then one lookup per weight. Differentiable in
    lo, step and delta (quant/tune.py tunes them through it)."""
    rows, cols = block
    nbr, nbc = lo.shape
    codes = _padded(unpack_codes(packed), rows, cols)
    level = torch.arange(16, device=packed.device) >> 1
    sign = (torch.arange(16, device=packed.device) & 1).float() * 2 - 1
    tables = lo.reshape(-1, 1) + level.float() * step.reshape(-1, 1) + sign * delta.reshape(-1, 1)  # [nb, 16]
    values = torch.gather(tables, 1, to_blocks(codes.long(), rows, cols))
    return from_blocks(values, nbr, nbc, rows, cols)[:shape[0], :shape[1]]

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

On-disk tensors for a linear weight `NAME.weight` (see docs/a3b_format.md):
  NAME.weight_packed      uint8 [out, ceil(in/2)] codes, low nibble = even column
  NAME.weight_lo          int8  [out_p/R, in_p/C]
  NAME.weight_step        uint8 [out_p/R, in_p/C]
  NAME.weight_delta       uint8 [out_p/R, in_p/C]
  NAME.weight_lo_scale    bf16  [out_p/R]
  NAME.weight_step_scale  bf16  [out_p/R]
  NAME.weight_shape       int32 [2]               (out, in) before padding
"""
from __future__ import annotations

import dataclasses

import torch

LEVELS = 8
TINY = 1e-12
SUFFIXES = ("packed", "lo", "step", "delta", "lo_scale", "step_scale", "shape")
METADATA = "int8-lo/uint8-step/uint8-delta+bf16-row-scales"
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


@dataclasses.dataclass
class A3BWeight:
    packed: torch.Tensor
    lo: torch.Tensor
    step: torch.Tensor
    delta: torch.Tensor
    lo_scale: torch.Tensor
    step_scale: torch.Tensor
    shape: torch.Tensor

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}_{name}": getattr(self, name) for name in SUFFIXES}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> "A3BWeight":
        missing = [f"{prefix}_{n}" for n in SUFFIXES if f"{prefix}_{n}" not in tensors]
        if missing:
            raise QuantizationError(f"A3B weight '{prefix}' lacks metadata tensors: {', '.join(missing)}")
        return cls(**{n: tensors[f"{prefix}_{n}"] for n in SUFFIXES})

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (getattr(self, n) for n in SUFFIXES))


# ---------------------------------------------------------------------------
# Block layout
def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out, inp = x.shape
    return torch.nn.functional.pad(x, (0, (-inp) % cols, 0, (-out) % rows))


def to_blocks(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[R*nbr, C*nbc] -> [nbr*nbc, R*C], blocks in row-major block order."""
    nbr, nbc = x.shape[0] // rows, x.shape[1] // cols
    return x.reshape(nbr, rows, nbc, cols).permute(0, 2, 1, 3).reshape(nbr * nbc, rows * cols)


def from_blocks(b: torch.Tensor, nbr: int, nbc: int, rows: int, cols: int) -> torch.Tensor:
    return b.reshape(nbr, nbc, rows, cols).permute(0, 2, 1, 3).reshape(nbr * rows, nbc * cols)


# ---------------------------------------------------------------------------
# Fitting
def assign(w: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest table entry per weight: (k in 0..7, s in {0, 1})."""
    safe = step.clamp_min(TINY)
    k_minus = ((w - lo + d) / safe).round().clamp(0, LEVELS - 1)
    k_plus = ((w - lo - d) / safe).round().clamp(0, LEVELS - 1)
    err_minus = (w - (lo + k_minus * step - d)).abs()
    err_plus = (w - (lo + k_plus * step + d)).abs()
    plus = err_plus < err_minus
    return torch.where(plus, k_plus, k_minus), plus


def _refit(w, h, k, plus, lo, step, d):
    sign = plus.to(w.dtype) * 2 - 1
    feats = torch.stack([torch.ones_like(w), k, sign], dim=-1)  # [nb, n, 3]
    weighted = feats * h.unsqueeze(-1)
    gram = weighted.transpose(1, 2) @ feats + 1e-9 * torch.eye(3, dtype=w.dtype)
    rhs = (weighted * w.unsqueeze(-1)).sum(1)
    sol, info = torch.linalg.solve_ex(gram, rhs)
    # Singular systems (constant blocks, a single code in use) keep their fit.
    ok = (info == 0).unsqueeze(-1) & torch.isfinite(sol).all(-1, keepdim=True) & (sol[:, 1:2] >= 0)
    new_lo, new_step, new_d = sol[:, 0:1], sol[:, 1:2], sol[:, 2:3].abs()
    return torch.where(ok, new_lo, lo), torch.where(ok, new_step, step), torch.where(ok, new_d, d)


def _block_error(w, h, lo, step, d):
    k, plus = assign(w, lo, step, d)
    value = lo + k * step + torch.where(plus, d, -d)
    return (h * (w - value) ** 2).sum(1, keepdim=True)


def fit_blocks(w: torch.Tensor, h: torch.Tensor, iterations: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted Lloyd fit of (lo, step, d) per block row of w [nb, n]; h >= 0 weights."""
    live = h > 0
    big = torch.finfo(w.dtype).max
    wmin = torch.where(live, w, torch.full_like(w, big)).amin(1, keepdim=True)
    wmax = torch.where(live, w, torch.full_like(w, -big)).amax(1, keepdim=True)
    empty = ~live.any(1, keepdim=True)
    wmin, wmax = torch.where(empty, 0.0, wmin), torch.where(empty, 0.0, wmax)
    unit = (wmax - wmin) / (2 * LEVELS)
    # The uniform 16-level grid over [min, max] at bin centres = INT4 RTN.
    lo, step, d = wmin + unit, 2 * unit, unit / 2
    err = _block_error(w, h, lo, step, d)
    for _ in range(iterations):
        k, plus = assign(w, lo, step, d)
        cand = _refit(w, h, k, plus, lo, step, d)
        cand_err = _block_error(w, h, *cand)
        better = cand_err < err
        lo, step, d = (torch.where(better, c, o) for c, o in zip(cand, (lo, step, d)))
        err = torch.where(better, cand_err, err)
    return lo, step, d


# ---------------------------------------------------------------------------
# Metadata double quantization
def _quantize_metadata(lo, step, d, nbr, nbc):
    lo, step, d = lo.reshape(nbr, nbc), step.reshape(nbr, nbc), d.reshape(nbr, nbc)
    # bf16 scales: fp32's range (huge and tiny weights survive) at half the bytes;
    # the int8/uint8 values are computed against the rounded scale.
    lo_scale = (lo.abs().amax(1) / 127).clamp_min(TINY).to(torch.bfloat16).float()
    lo_q = (lo / lo_scale[:, None]).round().clamp(-127, 127)
    step_scale = (step.amax(1) / 255).clamp_min(TINY).to(torch.bfloat16).float()
    step_q = (step / step_scale[:, None]).round().clamp(0, 255)
    step_deq = step_q * step_scale[:, None]
    d_q = (d / step_deq.clamp_min(TINY) * 255).round().clamp(0, 255)
    return lo_q, lo_scale, step_q, step_scale, d_q


def table_params(q: A3BWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-block float (lo, step, d), each [nbr, nbc]."""
    lo = q.lo.float() * q.lo_scale.float()[:, None]
    step = q.step.float() * q.step_scale.float()[:, None]
    d = step * q.delta.float() / 255
    return lo, step, d


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.uint8, device=packed.device)
    out[:, 0::2] = packed & 0xF
    out[:, 1::2] = packed >> 4
    return out


def quantize(w: torch.Tensor, config: A3BConfig = A3BConfig(), col_importance: torch.Tensor | None = None,
             name: str = "weight") -> A3BWeight:
    """W[out, in] -> A3B; col_importance[in] (e.g. mean x^2 per input channel) weights the fit."""
    if w.ndim != 2:
        raise QuantizationError(f"tensor '{name}' has shape {list(w.shape)}; A3B quantizes 2-D weights only")
    if not torch.isfinite(w).all():
        bad = (~torch.isfinite(w)).nonzero()[0].tolist()
        raise QuantizationError(f"tensor '{name}' holds NaN or Inf (first at index {bad}); refusing to quantize")
    R, C = config.block_rows, config.block_cols
    w = w.detach().float()
    out, inp = w.shape
    h_cols = torch.ones(inp) if col_importance is None else col_importance.detach().float().clamp_min(0) + 1e-8
    h = h_cols.expand(out, inp)
    mask = _padded(torch.ones_like(w), R, C)
    wp, hp = _padded(w, R, C), _padded(h, R, C) * mask
    nbr, nbc = wp.shape[0] // R, wp.shape[1] // C
    wb, hb = to_blocks(wp, R, C), to_blocks(hp, R, C)
    lo, step, d = fit_blocks(wb, hb, config.iterations)
    lo_q, lo_scale, step_q, step_scale, d_q = _quantize_metadata(lo, step, d, nbr, nbc)
    q = A3BWeight(
        packed=torch.empty(0), lo=lo_q.to(torch.int8), step=step_q.to(torch.uint8), delta=d_q.to(torch.uint8),
        lo_scale=lo_scale.to(torch.bfloat16), step_scale=step_scale.to(torch.bfloat16),
        shape=torch.tensor([out, inp], dtype=torch.int32),
    )
    # Codes are assigned against the stored (rounded) table, so dequantize is exact.
    flo, fstep, fd = (t.reshape(-1, 1) for t in table_params(q))
    k, plus = assign(wb, flo, fstep, fd)
    codes = from_blocks((k.to(torch.uint8) << 1) | plus.to(torch.uint8), nbr, nbc, R, C)
    # Padding codes are not stored: a partial last block costs only its metadata.
    q.packed = pack_codes(codes[:out, : inp + inp % 2])
    return q


def dequantize(q: A3BWeight, config: A3BConfig) -> torch.Tensor:
    """A3B -> float32 W[out, in]: one 16-entry table lookup per weight."""
    R, C = config.block_rows, config.block_cols
    out, inp = q.shape.tolist()
    nbr, nbc = q.lo.shape
    if q.packed.shape != (out, (inp + 1) // 2) or (nbr, nbc) != (-(-out // R), -(-inp // C)):
        raise QuantizationError(
            f"A3B tensors disagree: codes {list(q.packed.shape)} and {nbr}x{nbc} blocks of {R}x{C} "
            f"for a weight of shape [{out}, {inp}]"
        )
    codes = _padded(unpack_codes(q.packed), R, C)
    lo, step, d = table_params(q)
    k = torch.arange(16, device=q.packed.device) >> 1
    sign = (torch.arange(16, device=q.packed.device) & 1).float() * 2 - 1
    tables = lo.reshape(-1, 1) + k.float() * step.reshape(-1, 1) + sign * d.reshape(-1, 1)  # [nb, 16]
    block_codes = to_blocks(codes.long(), R, C)
    values = torch.gather(tables, 1, block_codes)
    return from_blocks(values, nbr, nbc, R, C)[:out, :inp]

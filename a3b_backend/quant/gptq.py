"""Error-compensating rounding onto the A3B table (GPTQ's column order and update).

`format.quantize` fits each block's table (lo, step, delta) by an
importance-weighted Lloyd fit and rounds every weight to its nearest entry.
Here the codes are chosen one input column at a time, and each column's
rounding error is pushed onto the columns not yet rounded through the inverse
Hessian H = E[x x^T] of the layer's inputs, so they absorb it (GPTQ, Frantar
et al. 2022: W[:, j+1:] -= err_j * Hinv[j, j+1:] / Hinv[j, j], with Hinv
taken as its upper Cholesky factor). Each column block's table is refitted
(the same importance-weighted fit, importance = diag H) on the weights as
the earlier blocks' errors left them, just before its codes are chosen, and
stored against the row scales of the first fit.
"""
from __future__ import annotations

import torch

from a3b_backend.quant.format import (A3BConfig, A3BWeight, assign, fit_blocks, metadata_codes, pack_codes, quantize,
                                     table_params, weighted_blocks)

# Added to H's diagonal, as a share of its mean: keeps the Cholesky factorization stable.
DAMPING = 0.01


def hessian_inverse_factor(hessian: torch.Tensor, damping: float = DAMPING) -> torch.Tensor:
    """Upper Cholesky factor of (H + damping * mean(diag H) * I)^-1; dead inputs (never active) get 1."""
    h = hessian.double().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1
    h.diagonal().add_(damping * h.diagonal().mean())
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True).float()


def _refit_block(q: A3BWeight, config: A3BConfig, w: torch.Tensor, importance: torch.Tensor, block: int) -> None:
    """Refits column block `block` of q's tables to w [out, in] and stores it against q's row scales."""
    cols = config.block[1]
    start, end = block * cols, min((block + 1) * cols, w.shape[1])
    table = fit_blocks(*weighted_blocks(w[:, start:end], importance[start:end], config.block), config.iterations)
    nbr = q.lo.shape[0]
    lo_q, step_q, delta_q = metadata_codes(tuple(t.reshape(nbr, 1) for t in table), q.lo_scale.float(),
                                           q.step_scale.float())
    for stored, value in ((q.lo, lo_q), (q.step, step_q), (q.delta, delta_q)):
        stored[:, block] = value[:, 0].to(stored.dtype)


def _block_table(q: A3BWeight, config: A3BConfig, block: int, out: int) -> tuple[torch.Tensor, ...]:
    """Column block `block`'s stored (lo, step, delta), one value per output row."""
    rows, _ = config.block
    return tuple(t[:, block].repeat_interleave(rows)[:out] for t in table_params(q))


def quantize_gptq(weight: torch.Tensor, config: A3BConfig, hessian: torch.Tensor, name: str = "weight") -> A3BWeight:
    """W[out, in] -> A3B with codes chosen in column order against H[in, in] (inputs' second moments)."""
    importance = hessian.diagonal()
    q = quantize(weight, config, col_importance=importance, name=name)
    out, inp = weight.shape
    cols = config.block[1]
    w = weight.detach().float().clone()
    w[:, hessian.diagonal() == 0] = 0
    factor = hessian_inverse_factor(hessian)
    codes = torch.zeros(out, inp + inp % 2, dtype=torch.uint8)
    for start in range(0, inp, cols):
        end = min(start + cols, inp)
        _refit_block(q, config, w, importance, start // cols)
        lo, step, delta = _block_table(q, config, start // cols, out)
        batch, errors = w[:, start:end].clone(), torch.zeros(out, end - start)
        for i, col in enumerate(range(start, end)):
            level, plus = assign(batch[:, i], lo, step, delta)
            value = lo + level * step + torch.where(plus, delta, -delta)
            errors[:, i] = (batch[:, i] - value) / factor[col, col]
            batch[:, i:] -= errors[:, i:i + 1] * factor[col, col:end].unsqueeze(0)
            codes[:, col] = (level.to(torch.uint8) << 1) | plus.to(torch.uint8)
        w[:, end:] -= errors @ factor[start:end, end:]
    q.packed = pack_codes(codes)
    return q

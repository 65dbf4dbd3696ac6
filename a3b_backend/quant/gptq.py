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

Experts of one MoE layer are rounded together (`quantize_gptq_stack`): each has
its own Hessian, and the column loop runs once for all of them, so its
per-column cost is paid once per group of experts, not once per expert.
"""
from __future__ import annotations

import torch

from a3b_backend.quant.format import (A3BConfig, A3BWeight, assign, fit_blocks, metadata_codes, pack_codes,
                                      quantize_stack, stack, table_params, weighted_blocks)

# Added to H's diagonal, as a share of its mean: keeps the Cholesky factorization stable.
DAMPING = 0.01


def hessian_inverse_factor(hessian: torch.Tensor, damping: float = DAMPING) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damping * mean(diag H) * I)^-1 = U^T U, of H [in, in] or
    each of a stack [E, in, in]; a dead input (never active) gets 1 on the diagonal.

    With J the reversal, J H J = L L^T gives H = (J L J)(J L J)^T, J L J upper, so U = (J L J)^-1:
    one Cholesky and one triangular solve instead of inverting H and factoring the inverse."""
    if hessian.ndim == 3:  # one at a time: float64 copies of a whole stack would not stay in cache
        return torch.stack([hessian_inverse_factor(h, damping) for h in hessian])
    h = hessian.double().flip(0, 1)
    diagonal = h.diagonal()
    diagonal[diagonal == 0] = 1
    diagonal.add_(damping * diagonal.mean())
    upper = torch.linalg.cholesky(h).flip(0, 1)
    return torch.linalg.solve_triangular(upper, torch.eye(h.shape[0], dtype=h.dtype), upper=True).float()


def _refit_block(q: A3BWeight, config: A3BConfig, w: torch.Tensor, importance: torch.Tensor, block: int) -> None:
    """Refits column block `block` of the stacked q's tables to w [E, out, in] (importance [E, in])
    and stores it against q's row scales."""
    cols = config.block[1]
    experts, out, _ = w.shape
    start, end = block * cols, min((block + 1) * cols, w.shape[2])
    rows_importance = importance[:, None, start:end].expand(experts, out, end - start).reshape(-1, end - start)
    table = fit_blocks(*weighted_blocks(w[:, :, start:end].reshape(-1, end - start), rows_importance, config.block),
                       config.iterations)
    nbr = q.lo.shape[-2]
    lo_q, step_q, delta_q = metadata_codes(tuple(t.reshape(experts * nbr, 1) for t in table),
                                           q.lo_scale.float().reshape(-1), q.step_scale.float().reshape(-1))
    for stored, value in ((q.lo, lo_q), (q.step, step_q), (q.delta, delta_q)):
        stored[:, :, block] = value.reshape(experts, nbr).to(stored.dtype)


def _block_table(q: A3BWeight, config: A3BConfig, block: int, out: int) -> tuple[torch.Tensor, ...]:
    """Column block `block`'s stored (lo, step, delta), one value per expert and output row: [E, out]."""
    rows, _ = config.block
    return tuple(t[:, :, block].repeat_interleave(rows, dim=-1)[:, :out] for t in table_params(q))


def quantize_gptq_stack(weights: torch.Tensor, config: A3BConfig, hessians: torch.Tensor,
                        name: str = "experts") -> A3BWeight:
    """Same-shaped W [E, out, in] -> their stacked A3B weight, each expert's codes chosen in column
    order against its own H [E, in, in] (its inputs' second moments)."""
    experts, out, inp = weights.shape
    importance = hessians.diagonal(dim1=1, dim2=2)
    q = quantize_stack(weights, config, importance, name)
    if experts > 1 and out % config.block_rows:  # blocks would span two experts' rows: one at a time
        return stack([quantize_gptq(w, config, h, f"{name}.{e}") for e, (w, h) in enumerate(zip(weights, hessians))])
    cols = config.block[1]
    w = weights.detach().float().clone()
    w.masked_fill_((importance == 0)[:, None, :], 0)
    factor = hessian_inverse_factor(hessians)
    codes = torch.zeros(experts, out, inp + inp % 2, dtype=torch.uint8)
    for start in range(0, inp, cols):
        end = min(start + cols, inp)
        _refit_block(q, config, w, importance, start // cols)
        lo, step, delta = _block_table(q, config, start // cols, out)
        batch, errors = w[:, :, start:end].clone(), torch.zeros(experts, out, end - start)
        for i, col in enumerate(range(start, end)):
            level, plus = assign(batch[:, :, i], lo, step, delta)
            value = lo + level * step + torch.where(plus, delta, -delta)
            errors[:, :, i] = (batch[:, :, i] - value) / factor[:, col, col, None]
            batch[:, :, i:] -= errors[:, :, i:i + 1] * factor[:, None, col, col:end]
            codes[:, :, col] = (level.to(torch.uint8) << 1) | plus.to(torch.uint8)
        w[:, :, end:] -= errors @ factor[:, start:end, end:]
    q.packed = pack_codes(codes.reshape(experts * out, -1)).reshape(experts, out, -1)
    return q


def quantize_gptq(weight: torch.Tensor, config: A3BConfig, hessian: torch.Tensor, name: str = "weight") -> A3BWeight:
    """W[out, in] -> A3B with codes chosen in column order against H[in, in] (inputs' second moments)."""
    return quantize_gptq_stack(weight[None], config, hessian[None], name).expert(0)

"""Error-compensating rounding onto the A3B table (GPTQ's column order and update).

`format.quantize` fits each block's table (lo, step, delta) by an
importance-weighted Lloyd fit and rounds every weight to its nearest entry.
Here the tables come from the same fit (importance = the diagonal of the
layer's input Hessian H = E[x x^T]); then the codes are chosen one input
column at a time, and each column's rounding error is pushed onto the columns
not yet rounded through the inverse Hessian, so they absorb it (GPTQ, Frantar
et al. 2022: W[:, j+1:] -= err_j * Hinv[j, j+1:] / Hinv[j, j], with Hinv
taken as its upper Cholesky factor). The stored tables are the fitted ones;
only the codes differ from nearest rounding.
"""
from __future__ import annotations

import torch

from a3b_backend.quant.format import A3BConfig, A3BWeight, assign, pack_codes, quantize, table_params

# Added to H's diagonal, as a share of its mean: keeps the Cholesky factorization stable.
DAMPING = 0.01
# Columns updated together before their error is pushed onto the rest.
COLUMN_BATCH = 128


def hessian_inverse_factor(hessian: torch.Tensor, damping: float = DAMPING) -> torch.Tensor:
    """Upper Cholesky factor of (H + damping * mean(diag H) * I)^-1; dead inputs (never active) get 1."""
    h = hessian.double().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1
    h.diagonal().add_(damping * h.diagonal().mean())
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True).float()


def _per_element(table: torch.Tensor, config: A3BConfig, out: int, inp: int) -> torch.Tensor:
    rows, cols = config.block
    return table.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:out, :inp]


def quantize_gptq(weight: torch.Tensor, config: A3BConfig, hessian: torch.Tensor, name: str = "weight") -> A3BWeight:
    """W[out, in] -> A3B with codes chosen in column order against H[in, in] (inputs' second moments)."""
    q = quantize(weight, config, col_importance=hessian.diagonal(), name=name)
    out, inp = weight.shape
    lo, step, delta = (_per_element(t, config, out, inp) for t in table_params(q))
    w = weight.detach().float().clone()
    w[:, hessian.diagonal() == 0] = 0
    factor = hessian_inverse_factor(hessian)
    codes = torch.zeros(out, inp + inp % 2, dtype=torch.uint8)
    for start in range(0, inp, COLUMN_BATCH):
        end = min(start + COLUMN_BATCH, inp)
        batch, errors = w[:, start:end].clone(), torch.zeros(out, end - start)
        for i, col in enumerate(range(start, end)):
            level, plus = assign(batch[:, i], lo[:, col], step[:, col], delta[:, col])
            value = lo[:, col] + level * step[:, col] + torch.where(plus, delta[:, col], -delta[:, col])
            errors[:, i] = (batch[:, i] - value) / factor[col, col]
            batch[:, i:] -= errors[:, i:i + 1] * factor[col, col:end].unsqueeze(0)
            codes[:, col] = (level.to(torch.uint8) << 1) | plus.to(torch.uint8)
        w[:, end:] -= errors @ factor[start:end, end:]
    q.packed = pack_codes(codes)
    return q

"""How many programs a launch wants on the GPUs we target (H100/H200: 132 SMs).
Decode-sized kernels have few independent output tiles, so they split their
long dimension (K of a GEMV, the pages of a sequence) until the GPU is full."""
from __future__ import annotations

from a3b_backend.quant.format import ceil_div

SMS = 132


def splits_to_fill(tiles: int, max_splits: int, per_sm: int) -> int:
    """Splits of each of `tiles` independent tiles that bring the launch to
    about `per_sm` programs per SM (at least 1, at most `max_splits`)."""
    return max(1, min(max_splits, ceil_div(per_sm * SMS, tiles)))


def whole_wave_splits(tiles: int, kblocks: int, blocks_per_sm: int) -> int:
    """Splits of each of `tiles` tiles' `kblocks` K blocks that run in one wave of `blocks_per_sm`
    programs on each of SMS SMs: as many as fit (so each split holds the fewest K blocks, its
    programs all running at once), then as few as give that many K blocks a split (no split left
    short or empty). 1 when the tiles alone fill a wave."""
    fit = max(1, min(kblocks, blocks_per_sm * SMS // tiles))
    return ceil_div(kblocks, ceil_div(kblocks, fit))

"""The flat block butterfly of Pixelated Butterfly: blocks at XOR-distance zero or a power of two."""

from __future__ import annotations

import math

import torch

from ..mask import BlockMask
from ..mask_index import BlockRuns
from ._common import GridError, check_device, geometry, joined_runs, make_from_runs, pattern_runs, positive_int

MAX_FACTORS = 31  # a mask has fewer than 2**31 blocks a side (MAX_LAYOUT_BLOCKS), so at most 31 factors


def butterfly(
    seq_len: int,
    block_size=128,
    *,
    n_factors: int | None = None,
    butterfly_size: int | None = None,
    num_global_blocks: int = 0,
    seq_len_k: int | None = None,
    device=None,
) -> BlockMask:
    """The flat block butterfly: block (i, j) is on iff `i XOR j` is 0 or `2**k` for some `k < n_factors`.

    With all factors, density is `(1 + log2 nb) / nb` for `nb` blocks a side (1.95% at 65,536 tokens
    with block 128). Built from its nonzero coordinates, so it costs time proportional to the number of
    nonzero blocks plus one pass over the layout.

    Args:
        seq_len: query length in tokens, from 1.
        block_size: int or `(block_q, block_k)`, in tokens, from 1.
        n_factors: how many butterfly factors to union, from 0 to 31; default all, `ceil(log2(size))`.
            Factors past those of the grid add no block (their partners lie outside it).
        butterfly_size: compute the pattern on a `butterfly_size`-square grid and blow each cell up to the
            blocks that map to it (query block i to cell `i * size // Mq`, key blocks likewise). Where the size
            is a power of two that divides both block counts, the cells are equal squares and the density is
            `(1 + n_factors) / butterfly_size`; otherwise cells differ in size by one block, and partners past a
            size that is not a power of two fall off the grid. From 1 to the number of blocks of the longer side.
        num_global_blocks: the first rows and columns made dense as well, from 0.
        seq_len_k: key length (cross attention); defaults to `seq_len`.
        device: where the layout lives.

    Returns:
        BlockMask `(1, 1, Mq, Mk)`.

    Raises:
        TypeError, ValueError: an argument outside the ranges above.

    Example:
        >>> from sparse_flash import masks
        >>> m = masks.butterfly(65536, 128)
        >>> round(m.density, 4)
        0.0195
    """
    device = check_device(device)
    n = None if n_factors is None else positive_int(n_factors, "n_factors", minimum=0, maximum=MAX_FACTORS)
    if butterfly_size is not None:
        butterfly_size = positive_int(butterfly_size, "butterfly_size")
    num_global_blocks = positive_int(num_global_blocks, "num_global_blocks", minimum=0)
    geo = geometry(seq_len, block_size, seq_len_k)
    Mq, Mk = geo.num_blocks_q, geo.num_blocks_k
    if butterfly_size is not None and butterfly_size > max(Mq, Mk):
        raise GridError(f"butterfly_size must be at most the number of blocks ({max(Mq, Mk)}), got {butterfly_size}")
    size = max(Mq, Mk) if butterfly_size is None else butterfly_size
    all_factors = math.ceil(math.log2(size))
    n = all_factors if n is None else n

    name = "butterfly" if n_factors is None else f"butterfly(n_factors={n})"
    if butterfly_size is None:  # one grid cell per block: listed on the host block by block (no device wait)
        return make_from_runs(_host_butterfly(size, min(n, all_factors), geo, num_global_blocks), geo, name, device)
    # each cell of a butterfly_size grid blown up to the blocks that map to it, listed on the host too (no device
    # wait): per query block, one run of key blocks per partner cell (key block j maps to cell j * size // Mk:
    # cell b holds a contiguous range)
    _, cells = _coordinates(size, min(n, all_factors), "cpu")  # (1 + factors, size)
    partner = cells[:, torch.arange(Mq) * size // Mq].T  # (Mq, 1 + factors): the partners of each row's cell
    on = partner < size  # partners past a size that is not a power of two fall off the grid: empty runs at 0
    start = torch.where(on, (partner * Mk + size - 1) // size, 0)  # the first key block of the cell
    end = torch.where(on, ((partner + 1) * Mk + size - 1) // size, 0)
    g = num_global_blocks
    i = torch.arange(Mq)[:, None]
    start = torch.where(i >= g, start.clamp(min=min(g, Mk)), end)  # global rows and columns whole below (no block twice)
    grid = BlockRuns(i.expand_as(start).flatten(), start.flatten(), torch.maximum(start, end).flatten())
    runs = joined_runs(grid, pattern_runs(geo, columns=[(0, g)], rows=[(0, g)])) if g else grid
    return make_from_runs(runs, geo, f"{name}[size {butterfly_size}]", device)


def _host_butterfly(size: int, factors: int, geo, num_global_blocks: int) -> BlockRuns:
    """The nonzero blocks of an `Mq x Mk` butterfly as runs on the host (`BlockRuns`, each block once): the grid's
    blocks one by one, then the first `num_global_blocks` rows and columns whole (the grid's blocks in them
    left out: empty runs)."""
    Mq, Mk = geo.num_blocks_q, geo.num_blocks_k
    rows, cols = _coordinates(size, factors, "cpu")
    keep = (rows < Mq) & (cols < Mk)
    if bool(keep.all()):  # a square grid of a power of two: every partner on it (no selection, a slow operator)
        i, j = rows.flatten(), cols.flatten()
    else:
        i, j = rows[keep], cols[keep]
    g = num_global_blocks
    if not g:
        return BlockRuns(i, j, j + 1)
    grid = BlockRuns(i, j, torch.where((i >= g) & (j >= g), j + 1, j))
    return joined_runs(grid, pattern_runs(geo, columns=[(0, g)], rows=[(0, g)]))


def _coordinates(size: int, factors: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The butterfly's nonzero coordinates on a `size`-square grid, `(rows, cols)` int64 `(1 + factors, size)`:
    (r, r), then (r, r ^ 2**k) for each factor k (partners may fall past the grid)."""
    r = torch.arange(size, device=device)
    powers = torch.arange(factors, device=device)
    cols = torch.cat([r[None], r[None] ^ (1 << powers)[:, None]])
    return r.expand_as(cols), cols

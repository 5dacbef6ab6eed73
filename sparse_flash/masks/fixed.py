"""Sparse Transformer's fixed pattern: local windows plus a global column per window."""

from __future__ import annotations

import torch

from ..mask import BlockMask
from ._common import (MAX_LISTED_RUNS, as_bool, block_coords, check_device, gpu_builders, joined_runs, make,
                      make_from_runs, optional_heads, pattern_runs, pattern_sizes, positive_int, square_geometry)


def fixed(
    seq_len: int,
    block_size=128,
    *,
    num_local_blocks: int = 4,
    num_global_blocks: int = 1,
    causal: bool = False,
    horizontal_global_attention: bool = False,
    num_different_global_patterns: int = 1,
    num_heads: int | None = None,
    device=None,
) -> BlockMask:
    """The fixed pattern of the Sparse Transformer, with DeepSpeed's defaults.

    Blocks are grouped in windows of `num_local_blocks`; all blocks inside a window are on (lower
    triangle when `causal`). In each window the last `num_global_blocks` blocks are global columns, seen by
    every query block (by those at or after them when `causal`), and with `horizontal_global_attention`
    also full rows. With `num_different_global_patterns > 1`, head h takes its global blocks
    `h % num_different_global_patterns` positions earlier in each window. A partial last window takes
    its own last blocks as global.

    Args:
        seq_len: sequence length in tokens (self-attention), from 1.
        block_size: int, or a pair `(b, b)` of equal ints, in tokens, from 1.
        num_local_blocks: window size in blocks, from 1.
        num_global_blocks: global blocks per window, from 1 to `num_local_blocks`.
        causal: unidirectional variant (a bool).
        horizontal_global_attention: global blocks also attend everywhere (a bool; bidirectional only).
        num_different_global_patterns: how many global positions the heads cycle through, from 1, with
            `num_different_global_patterns * num_global_blocks <= num_local_blocks`.
        num_heads: number of heads, from 1 (needed with `num_different_global_patterns > 1`).
        device: where the layout lives.

    Returns:
        BlockMask `(1, num_heads or 1, M, M)`.

    Raises:
        TypeError, ValueError: an argument outside the ranges above.

    Example:
        >>> from sparse_flash import masks
        >>> masks.fixed(2048, 128).shape
        (1, 1, 16, 16)
    """
    device = check_device(device)
    L = positive_int(num_local_blocks, "num_local_blocks")
    G = positive_int(num_global_blocks, "num_global_blocks")
    P = positive_int(num_different_global_patterns, "num_different_global_patterns")
    heads = optional_heads(num_heads)
    causal = as_bool(causal, "causal")
    horizontal_global_attention = as_bool(horizontal_global_attention, "horizontal_global_attention")
    if G > L:
        raise ValueError(f"num_global_blocks ({G}) must be at most num_local_blocks ({L})")
    if P * G > L:
        raise ValueError(
            f"num_different_global_patterns * num_global_blocks ({P * G}) must be at most num_local_blocks ({L})"
        )
    if P > 1 and num_heads is None:
        raise ValueError("num_different_global_patterns > 1 needs num_heads")
    if causal and horizontal_global_attention:
        raise ValueError("horizontal_global_attention is defined for the bidirectional pattern only (causal=False)")
    geo = square_geometry("fixed", seq_len, block_size, heads=heads)
    M = geo.num_blocks_q
    name = f"fixed(L={L}, G={G}{', causal' if causal else ''})"
    # head h takes pattern h % P: its global blocks start `first` blocks into each window (the last window's
    # clamped to the grid's end)
    columns = [[(min(w + L - (1 + p) * G, max(M - G, 0)), min(w + L - (1 + p) * G, max(M - G, 0)) + G)
                for w in range(0, M, L)] for p in range(min(P, heads))]
    i = torch.arange(M)
    window = (i - i % L, torch.clamp(i - i % L + min(L, M), max=M))
    patterns = [dict(band=window, columns=cols, rows=cols if horizontal_global_attention else (), causal=causal)
                for cols in columns]
    if heads * M * (2 * len(columns[0]) + 1) <= MAX_LISTED_RUNS:  # few runs: listed on the host
        per_pattern = [pattern_runs(geo, **pattern) for pattern in patterns]
        runs = joined_runs(*(per_pattern[h % P]._replace(row=per_pattern[h % P].row + h * M) for h in range(heads)))
        return make_from_runs(runs, geo, name, device, heads)
    # many runs (short windows on a long grid: a global column every few blocks): the layout made on the device,
    # its lists' sizes counted from the pattern; neither waits for the device
    layout = _layout(geo, heads, L, G, P, causal, horizontal_global_attention, device)
    return make(layout, geo, name, pattern_sizes(geo, patterns, [h % P for h in range(heads)]))


def _layout(geo, heads: int, L: int, G: int, P: int, causal: bool, horizontal: bool, device) -> torch.Tensor:
    """bool `(heads, M, M)`: the fixed pattern's layout on `device`, by arithmetic on the block numbers (no list
    of blocks copied to the device): one Triton launch where the GPU builders run (`index_gpu.fixed_layout`),
    else the torch operators."""
    M = geo.num_blocks_q
    layout = torch.empty((heads, M, M), dtype=torch.bool, device=device)
    index_gpu = gpu_builders(layout)
    if index_gpu is not None:
        return index_gpu.fixed_layout(layout, L, G, P, causal, horizontal)
    i, j = block_coords(geo, device)  # (M, 1) and (1, M)
    local_ = (i // L) == (j // L)
    if causal:
        local_ &= j <= i
    layout.copy_(local_)
    for h in range(heads):
        cols = _global_columns(j, M, L, G, h % P)  # (1, M)
        if causal:
            layout[h] |= cols & (i >= j)
        else:
            layout[h] |= cols
            if horizontal:
                layout[h] |= cols.view(M, 1)
    return layout


def _global_columns(j: torch.Tensor, M: int, L: int, G: int, p: int) -> torch.Tensor:
    """bool like `j` (key block numbers): the global columns of pattern `p`, `G` blocks starting `(1 + p) * G`
    before the end of each window of `L` (those of a partial last window clamped to the grid's end), as `fixed`
    lists them, by arithmetic on `j`."""
    offset = j % L
    first = L - (1 + p) * G
    cols = (j - offset + L <= M) & (offset >= first) & (offset < first + G)  # windows that fit the grid
    last = (M - 1) // L * L  # the last window's first block
    if last + L > M:  # a partial last window
        start = min(last + L - (1 + p) * G, max(M - G, 0))
        cols |= (j >= start) & (j < start + G)
    return cols

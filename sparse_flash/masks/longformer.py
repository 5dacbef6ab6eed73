"""Longformer: a sliding window plus chosen global blocks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..mask import BlockMask
from ._common import (as_bool, block_indices, check_device, check_on_grid, geometry, make_from_runs, odd_int,
                      pattern_runs)


def longformer(
    seq_len: int,
    block_size=128,
    *,
    num_sliding_window_blocks: int = 3,
    global_block_indices: Sequence[int] = (0,),
    global_block_end_indices: Sequence[int] | None = None,
    causal: bool = False,
    seq_len_k: int | None = None,
    device=None,
) -> BlockMask:
    """Longformer's pattern: the window `|i - j| <= num_sliding_window_blocks // 2` united with a dense row
    and column for each global block.

    The defaults match DeepSpeed's BSLongformer sparsity config.

    Args:
        seq_len: query length in tokens, from 1.
        block_size: int or `(block_q, block_k)`, in tokens, from 1.
        num_sliding_window_blocks: width of the window in blocks, odd (3 means +-1); a window wider than the
            mask covers all of it.
        global_block_indices: the global blocks, distinct indices below the number of blocks (of the longer
            side); with `global_block_end_indices`, the starts of global ranges.
        global_block_end_indices: exclusive ends of the global ranges, one per start, each after its start and
            at most the number of blocks.
        causal: keep only the blocks that hold a (query, key) pair with key <= query, top-left aligned (a bool;
            `masks.causal`'s blocks: with square blocks the block lower triangle j <= i).
        seq_len_k: key length (cross attention); defaults to `seq_len`.
        device: where the layout lives.

    Returns:
        BlockMask `(1, 1, Mq, Mk)`.

    Raises:
        TypeError, ValueError: an argument outside the ranges above.

    Example:
        >>> from sparse_flash import masks
        >>> masks.longformer(4096, 128, global_block_indices=[0, 16]).shape
        (1, 1, 32, 32)
    """
    device = check_device(device)
    w = odd_int(num_sliding_window_blocks, "num_sliding_window_blocks")
    causal = as_bool(causal, "causal")
    starts = block_indices(global_block_indices, "global_block_indices")
    if global_block_end_indices is None:
        ends = [s + 1 for s in starts]
    else:
        ends = block_indices(global_block_end_indices, "global_block_end_indices", distinct=False)
        if len(ends) != len(starts) or any(e <= s for s, e in zip(starts, ends)):
            raise ValueError(
                "global_block_end_indices must give one end after each start, got "
                f"starts {starts} and ends {ends}"
            )
    geo = geometry(seq_len, block_size, seq_len_k)
    check_on_grid(starts, geo, "global_block_indices")
    if global_block_end_indices is not None:
        check_on_grid(ends, geo, "global_block_end_indices", ends=True)
    i = torch.arange(geo.num_blocks_q)
    half = min(w // 2, max(geo.num_blocks_q, geo.num_blocks_k))  # past the grid: all of it (no int64 overflow)
    ranges = list(zip(starts, ends))
    runs = pattern_runs(geo, band=(i - half, i + half + 1), columns=ranges, rows=ranges, causal=causal)
    return make_from_runs(runs, geo, f"longformer(w={w}, global={starts}{', causal' if causal else ''})", device)

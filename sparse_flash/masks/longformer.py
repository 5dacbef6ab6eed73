"""Longformer: a sliding window plus chosen global blocks."""

from __future__ import annotations

from collections.abc import Sequence

from ..layout import BlockMask
from ._common import block_coords, causal_blocks, geometry, make, positive_int


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
        seq_len: query length in tokens.
        block_size: int or `(block_q, block_k)`, in tokens.
        num_sliding_window_blocks: width of the window, in blocks (3 means +-1).
        global_block_indices: the global blocks; with `global_block_end_indices`, the starts of global ranges.
        global_block_end_indices: exclusive ends of the global ranges, one per start.
        causal: restrict to the block lower triangle.
        seq_len_k: key length (cross attention); defaults to `seq_len`.
        device: where the layout lives.

    Returns:
        BlockMask `(1, 1, Mq, Mk)`.

    Example:
        >>> from sparse_flash import masks
        >>> masks.longformer(4096, 128, global_block_indices=[0, 16]).shape
        (1, 1, 32, 32)
    """
    w = positive_int(num_sliding_window_blocks, "num_sliding_window_blocks", minimum=0)
    geo = geometry(seq_len, block_size, seq_len_k)
    starts = [positive_int(s, "global_block_indices", minimum=0) for s in global_block_indices]
    if global_block_end_indices is None:
        ends = [s + 1 for s in starts]
    else:
        ends = [positive_int(e, "global_block_end_indices", minimum=0) for e in global_block_end_indices]
        if len(ends) != len(starts) or any(e <= s for s, e in zip(starts, ends)):
            raise ValueError(
                "global_block_end_indices must give one end after each start, got "
                f"starts {starts} and ends {ends}"
            )
    i, j = block_coords(geo, device)
    layout = (i - j).abs() <= w // 2
    for s, e in zip(starts, ends):
        layout[s:e, :] = True
        layout[:, s:e] = True
    if causal:
        layout &= causal_blocks(geo, device)
    return make(layout, geo, f"longformer(w={w}, global={starts}{', causal' if causal else ''})")

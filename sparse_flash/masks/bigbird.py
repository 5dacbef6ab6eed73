"""BigBird: random blocks, a sliding window and global blocks."""

from __future__ import annotations

import torch

from ..mask import BlockMask
from ._common import (as_bool, block_coords, causal_blocks, check_device, geometry, hash_draws, make, odd_int,
                     optional_heads, positive_int, seed_value, uniform_draws)


def bigbird(
    seq_len: int,
    block_size=128,
    *,
    num_random_blocks: int = 1,
    num_sliding_window_blocks: int = 3,
    num_global_blocks: int = 1,
    causal: bool = False,
    seed: int | torch.Generator = 0,
    num_heads: int | None = None,
    seq_len_k: int | None = None,
    device=None,
) -> BlockMask:
    """BigBird's pattern: `num_random_blocks` random blocks per row, drawn without replacement, united with
    the window `|i - j| <= num_sliding_window_blocks // 2` and `num_global_blocks` global rows and columns.

    The defaults match DeepSpeed's BigBird sparsity config. With `causal` everything is restricted to
    `masks.causal`'s blocks (random blocks are drawn among them).

    Args:
        seq_len: query length in tokens, from 1.
        block_size: int or `(block_q, block_k)`, in tokens, from 1.
        num_random_blocks: random key blocks per query block, from 0 (more than the row holds: all of it).
        num_sliding_window_blocks: width of the sliding window in blocks, odd (3 means +-1).
        num_global_blocks: leading global blocks, from 0 (more than the mask has: all of them).
        causal: keep only the blocks that hold a (query, key) pair with key <= query, top-left aligned (a bool;
            `masks.causal`'s blocks: with square blocks the block lower triangle j <= i).
        seed: an int seed in [0, 2**64 - 1] (one mask on every device: a hash of the seed and the block's position) or a `torch.Generator`.
        num_heads: draw the random part independently per head, from 1.
        seq_len_k: key length (cross attention); defaults to `seq_len`.
        device: where the layout lives.

    Returns:
        BlockMask `(1, num_heads or 1, Mq, Mk)`.

    Raises:
        TypeError, ValueError: an argument outside the ranges above.

    Example:
        >>> from sparse_flash import masks
        >>> masks.bigbird(8192, 128, num_heads=4).shape
        (1, 4, 64, 64)
    """
    device = check_device(device)
    r = positive_int(num_random_blocks, "num_random_blocks", minimum=0)
    w = odd_int(num_sliding_window_blocks, "num_sliding_window_blocks")
    g = positive_int(num_global_blocks, "num_global_blocks", minimum=0)
    causal = as_bool(causal, "causal")
    seed = seed_value(seed)
    heads = optional_heads(num_heads)
    geo = geometry(seq_len, block_size, seq_len_k, heads=heads)
    i, j = block_coords(geo, device)
    allowed = causal_blocks(geo, device) if causal else None  # None: every block

    shape = (heads, geo.num_blocks_q, geo.num_blocks_k)
    if isinstance(seed, torch.Generator):
        scores = uniform_draws(seed, shape, device)
    else:  # distinct integer scores (draw, then key block): no tie, so every device keeps the same blocks
        scores = hash_draws(seed, shape, device) * geo.num_blocks_k + j
    if causal:
        scores = scores.masked_fill(~allowed, -1)  # disallowed keys sort last and are dropped below
    layout = torch.zeros_like(scores, dtype=torch.bool)
    if r:
        top = scores.topk(min(r, geo.num_blocks_k), dim=-1).indices
        layout.scatter_(-1, top, True)
    layout |= (i - j).abs() <= w // 2
    layout[:, :g, :] = True
    layout[:, :, :g] = True
    if causal:
        layout &= allowed
    return make(layout, geo, f"bigbird(r={r}, w={w}, g={g}{', causal' if causal else ''})")

"""I.i.d. random blocks."""

from __future__ import annotations

import torch

from ..mask import BlockMask
from ._common import check_device, geometry, make, optional_heads, probability, seed_value, uniform_draws


def random(
    seq_len: int,
    block_size=128,
    *,
    density: float,
    seed: int | torch.Generator = 0,
    num_heads: int | None = None,
    seq_len_k: int | None = None,
    device=None,
) -> BlockMask:
    """Each block on independently with probability `density`.

    Reproducible: one int seed gives one mask on every device (a hash of the seed and the block's position). With `num_heads` each head draws
    its own layout. Rows may come out empty; such queries output 0 (add `masks.local(..., window=0)` to
    keep the diagonal).

    Args:
        seq_len: query length in tokens, from 1.
        block_size: int or `(block_q, block_k)`, in tokens, from 1.
        density: probability of each block, a float in [0, 1].
        seed: an int seed in [0, 2**64 - 1] or a `torch.Generator` (never the global RNG).
        num_heads: draw one independent layout per head, from 1; default one layout shared by all heads.
        seq_len_k: key length (cross attention); defaults to `seq_len`.
        device: where the layout lives.

    Returns:
        BlockMask `(1, num_heads or 1, Mq, Mk)`.

    Raises:
        TypeError, ValueError: an argument outside the ranges above.

    Example:
        >>> from sparse_flash import masks
        >>> masks.random(4096, 128, density=0.1, seed=1, num_heads=8).shape
        (1, 8, 32, 32)
    """
    device = check_device(device)
    density = probability(density, "density")
    seed = seed_value(seed)
    heads = optional_heads(num_heads)
    geo = geometry(seq_len, block_size, seq_len_k, heads=heads)
    draws = uniform_draws(seed, (heads, geo.num_blocks_q, geo.num_blocks_k), device)
    name = f"random(density={density:g}, seed={seed if isinstance(seed, int) else 'gen'})"
    return make(draws < density, geo, name)

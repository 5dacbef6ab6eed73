"""The all-ones mask: dense attention."""

from __future__ import annotations

from ..mask import BlockMask
from ._common import check_device, geometry, make_from_runs, pattern_runs


def dense(seq_len: int, block_size=128, *, seq_len_k: int | None = None, device=None) -> BlockMask:
    """Every block on: dense attention, served by the same kernels.

    Args:
        seq_len: query length in tokens, from 1.
        block_size: int or `(block_q, block_k)`, in tokens, from 1.
        seq_len_k: key length (cross attention); defaults to `seq_len`.
        device: where the layout lives.

    Returns:
        BlockMask `(1, 1, Mq, Mk)` with density 1.

    Example:
        >>> from sparse_flash import masks
        >>> masks.dense(1024, 128).density
        1.0
    """
    device = check_device(device)
    geo = geometry(seq_len, block_size, seq_len_k)
    return make_from_runs(pattern_runs(geo, rows=[(0, geo.num_blocks_q)]), geo, "dense", device)

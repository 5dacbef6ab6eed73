"""Global blocks: the first rows attend everywhere and the first columns are attended by all."""

from __future__ import annotations

from ..mask import BlockMask
from ._common import check_device, geometry, make_from_runs, pattern_runs, positive_int


def global_(
    seq_len: int, block_size=128, *, num_global_blocks: int = 1, seq_len_k: int | None = None, device=None
) -> BlockMask:
    """Rows and columns `0 .. num_global_blocks - 1` dense, everything else off.

    Args:
        seq_len: query length in tokens, from 1.
        block_size: int or `(block_q, block_k)`, in tokens, from 1.
        num_global_blocks: how many leading blocks are global, from 0 (more than the mask has: all of them).
        seq_len_k: key length (cross attention); defaults to `seq_len`.
        device: where the layout lives.

    Returns:
        BlockMask `(1, 1, Mq, Mk)`.

    Raises:
        TypeError, ValueError: an argument outside the ranges above.

    Example:
        >>> from sparse_flash import masks
        >>> masks.global_(512, 128).nnz
        7
    """
    device = check_device(device)
    g = positive_int(num_global_blocks, "num_global_blocks", minimum=0)
    geo = geometry(seq_len, block_size, seq_len_k)
    return make_from_runs(pattern_runs(geo, columns=[(0, g)], rows=[(0, g)]), geo, f"global({g})", device)

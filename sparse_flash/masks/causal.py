"""The block lower triangle: causal attention at block granularity."""

from __future__ import annotations

from ..mask import BlockMask
from ._common import check_device, geometry, make_from_runs, pattern_runs


def causal(seq_len: int, block_size=128, *, seq_len_k: int | None = None, device=None) -> BlockMask:
    """Blocks that hold at least one (query, key) pair with key index <= query index.

    Diagonal blocks are kept whole: for exact causal attention pass `causal=True` to
    `block_sparse_attention`, which masks inside them (top-left aligned, like
    `F.scaled_dot_product_attention(is_causal=True)`).

    Args:
        seq_len: query length in tokens, from 1.
        block_size: int or `(block_q, block_k)`, in tokens, from 1.
        seq_len_k: key length (cross attention); defaults to `seq_len`.
        device: where the layout lives.

    Returns:
        BlockMask `(1, 1, Mq, Mk)`.

    Example:
        >>> from sparse_flash import masks
        >>> masks.causal(512, 128).nnz
        10
    """
    device = check_device(device)
    geo = geometry(seq_len, block_size, seq_len_k)
    return make_from_runs(pattern_runs(geo, rows=[(0, geo.num_blocks_q)], causal=True), geo, "causal", device)

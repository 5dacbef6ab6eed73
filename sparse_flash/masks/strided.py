"""Sparse Transformer's strided pattern, at block level."""

from __future__ import annotations

import math

import torch

from ..mask import BlockMask
from ._common import check_device, diagonal_runs, joined_runs, make_from_runs, pattern_runs, positive_int, square_geometry


def strided(
    seq_len: int, block_size=128, *, stride: int | None = None, bandwidth: int | None = None, device=None
) -> BlockMask:
    """Causal strided attention: block (i, j), j <= i, is on iff `(i - j) % stride == 0` or `i - j < bandwidth`.

    Args:
        seq_len: sequence length in tokens (self-attention), from 1.
        block_size: int, or a pair `(b, b)` of equal ints, in tokens, from 1.
        stride: stride in blocks, from 1; default `round(sqrt(M))` for M blocks, as in the Sparse Transformer.
        bandwidth: width of the local band in blocks, from 1; default `stride`.
        device: where the layout lives.

    Returns:
        BlockMask `(1, 1, M, M)`; pass `causal=True` to the attention call for exact causality.

    Raises:
        TypeError, ValueError: an argument outside the ranges above.

    Example:
        >>> from sparse_flash import masks
        >>> masks.strided(4096, 128, stride=4).shape
        (1, 1, 32, 32)
    """
    device = check_device(device)
    stride = None if stride is None else positive_int(stride, "stride")
    bandwidth = None if bandwidth is None else positive_int(bandwidth, "bandwidth")
    geo = square_geometry("strided", seq_len, block_size)
    stride = max(1, round(math.sqrt(geo.num_blocks_q))) if stride is None else stride
    bandwidth = stride if bandwidth is None else bandwidth
    i = torch.arange(geo.num_blocks_q)  # the band i - j < bandwidth, then the diagonals i - j = k * stride past it
    runs = joined_runs(pattern_runs(geo, band=(i - bandwidth + 1, i + 1)),
                       diagonal_runs(geo, [d for d in range(0, geo.num_blocks_q, stride) if d >= bandwidth]))
    return make_from_runs(runs, geo, f"strided(stride={stride}, bandwidth={bandwidth})", device)

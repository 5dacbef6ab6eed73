"""Sliding-window (local band) attention."""

from __future__ import annotations

import torch

from ..mask import BlockMask
from ._common import as_bool, check_device, geometry, make_from_runs, pattern_runs, positive_int


def local(
    seq_len: int, block_size=128, *, window: int = 1, causal: bool = False, seq_len_k: int | None = None, device=None
) -> BlockMask:
    """A band of blocks around the diagonal.

    Block (i, j) is on iff `|i - j| <= window`, or `0 <= i - j <= window` when `causal`. The band is one of block
    indices: with `block_q != block_k` it does not follow the token diagonal (with `causal`, a query block can
    miss the keys at its own positions); `masks.causal(...) & masks.local(..., window=w)` with a wide enough `w`
    gives a band that does.

    Args:
        seq_len: query length in tokens, from 1.
        block_size: int or `(block_q, block_k)`, in tokens, from 1.
        window: half-width of the band in blocks, from 0 (0 keeps only the diagonal); a band wider than the
            mask covers all of it.
        causal: keep only the lower half of the band (a bool).
        seq_len_k: key length (cross attention); defaults to `seq_len`.
        device: where the layout lives.

    Returns:
        BlockMask `(1, 1, Mq, Mk)`.

    Raises:
        TypeError, ValueError: an argument outside the ranges above.

    Example:
        >>> from sparse_flash import masks
        >>> print(masks.local(512, 128, window=1))  # doctest: +ELLIPSIS
        BlockMask(local(window=1), ...
    """
    device = check_device(device)
    window = positive_int(window, "window", minimum=0)
    causal = as_bool(causal, "causal")
    geo = geometry(seq_len, block_size, seq_len_k)
    name = f"local(window={window}{', causal' if causal else ''})"
    i = torch.arange(geo.num_blocks_q)  # one run per row: j from i - window to i (+ window)
    window = min(window, max(geo.num_blocks_q, geo.num_blocks_k))  # past the grid: all of it (no int64 overflow)
    return make_from_runs(pattern_runs(geo, band=(i - window, i + 1 + (0 if causal else window))), geo, name, device)


"""Sliding-window (local band) attention."""

from __future__ import annotations

import itertools

import torch

from ..mask import BlockMask
from ._common import as_bool, block_coords, check_device, geometry, make, make_from_coordinates, positive_int

MAX_COORDINATES, MAX_DIAGONALS = 1 << 18, 256  # bands listed on the host: blocks of their diagonals, diagonals


def local(
    seq_len: int, block_size=128, *, window: int = 1, causal: bool = False, seq_len_k: int | None = None, device=None
) -> BlockMask:
    """A band of blocks around the diagonal.

    Block (i, j) is on iff `|i - j| <= window`, or `0 <= i - j <= window` when `causal`.

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
    Mq, Mk = geo.num_blocks_q, geo.num_blocks_k
    lowest, highest = (0 if causal else -min(window, Mk - 1)), min(window, Mq - 1)  # the diagonals i - j kept
    width = highest - lowest + 1
    if width <= MAX_DIAGONALS and Mq * width <= MAX_COORDINATES:  # a narrow band: its blocks, listed on the host
        return make_from_coordinates(*_host_band(Mq, Mk, lowest, highest), geo, name, device)
    i, j = block_coords(geo, device)
    d = i - j
    layout = (d >= 0) & (d <= window) if causal else d.abs() <= window
    return make(layout, geo, name)


def _host_band(Mq: int, Mk: int, lowest: int, highest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks `(i, j)` of an `Mq x Mk` grid with `lowest <= i - j <= highest` (int64 CPU tensors), one
    diagonal after another: a few operators whatever the width (no selection by a bool tensor, a slow one)."""
    diagonals = range(lowest, highest + 1)
    firsts = [max(0, d) for d in diagonals]  # each diagonal's rows: firsts[n] to firsts[n] + lengths[n]
    lengths = [max(0, min(Mq, Mk + d) - first) for d, first in zip(diagonals, firsts)]
    total, starts = sum(lengths), list(itertools.accumulate(lengths, initial=0))
    lengths = torch.tensor(lengths)
    i = torch.arange(total) + torch.repeat_interleave(torch.tensor([f - s for f, s in zip(firsts, starts)]), lengths,
                                                      output_size=total)
    return i, i - torch.repeat_interleave(torch.tensor(diagonals), lengths, output_size=total)

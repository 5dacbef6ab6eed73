"""2-D and 3-D patterns over image and video tiles: a neighbourhood of tiles, and a butterfly along each tile axis.

Each mask block is one tile of tokens in tile-major order (`masks.to_tiles`), so block (a, b) says whether the
pixels of tile a attend the pixels of tile b. The masks carry their `Tiling`; `mask.plot()` draws them on the
pixel grid.
"""

from __future__ import annotations

import math

import torch

from ..mask import BlockMask, Tiling
from ._common import check_device, optional_heads
from .butterfly import butterfly_layout
from .tiles import per_axis, tiling_of


def _band(n: int, window: int, device) -> torch.Tensor:
    """`(n, n)`: positions along one tile axis within `window` of each other."""
    i = torch.arange(n, device=device)
    return (i[:, None] - i[None, :]).abs() <= window


def _kron(*factors: torch.Tensor) -> torch.Tensor:
    """The layout over tiles in tile-major order whose (a, b) entry is the AND of the per-axis factors at the
    tiles' (t, h, w) coordinates: a Kronecker product, the last axis varying fastest."""
    out = factors[0]
    for f in factors[1:]:
        out = torch.kron(out, f)
    return out


def _windows(window, axes: tuple[str, ...], num_heads) -> list[tuple[int, int, int]]:
    """One `(t, h, w)` window per head: a list gives one per head, anything else one for all heads."""
    if isinstance(window, list):
        if not window:
            raise ValueError("window: a per-head list needs at least one window, got []")
        if num_heads is not None and optional_heads(num_heads) != len(window):
            raise ValueError(f"window lists {len(window)} per-head windows but num_heads={num_heads}")
        return [per_axis(w, f"window[{k}]", axes, 0, 0) for k, w in enumerate(window)]
    return [per_axis(window, "window", axes, 0, 0)] * optional_heads(num_heads)


def _describe(window) -> str:
    if isinstance(window, list):
        return "[" + ", ".join(map(_describe, window)) + "]"
    return str(tuple(window)) if isinstance(window, (tuple, list)) else str(window)


def _tiled_mask(layout: torch.Tensor, tiling: Tiling, name: str) -> BlockMask:
    return BlockMask.from_layout(layout, math.prod(tiling.tile), name=name, tiling=tiling)


def _neighborhood(tiling: Tiling, windows, device, name: str) -> BlockMask:
    layouts = {}  # heads with the same window share one layout
    for w in windows:
        if w not in layouts:
            layouts[w] = _kron(*(_band(n, r, device) for n, r in zip(tiling.tiles, w)))
    return _tiled_mask(torch.stack([layouts[w] for w in windows]), tiling, name)


def neighborhood_2d(height: int, width: int, tile, window=1, *, num_heads: int | None = None,
                    device=None) -> BlockMask:
    """Each image tile attends the tiles within a 2-D window: Chebyshev distance in tile units.

    Block (a, b) is on iff `|row_a - row_b| <= window_h` and `|col_a - col_b| <= window_w`, with (row, col) a
    tile's position on the tile grid. Tokens must be in tile-major order (`masks.to_tiles`): block `i` is tile
    `i`, `block_size = tile_h * tile_w`, `seq_len = height * width`. Density is at most
    `(2 window_h + 1)(2 window_w + 1) / num_tiles` (less at the borders): 1.6% for a 256 x 256 image in 16 x 8
    tiles, window 1.

    Args:
        height, width: image size in pixels.
        tile: int (square) or `(tile_h, tile_w)`, in pixels; each divides the matching image side.
        window: int (both axes) or a tuple `(window_h, window_w)`, in tiles, >= 0 (0: each tile only
            itself); or a *list* with one such window per head (a tuple is per axis, a list per head).
        num_heads: heads of the layout; with a single window every head gets it, with a list it must equal
            the list's length. Default: one layout shared by all heads (or one per listed window).
        device: where the layout lives.

    Returns:
        BlockMask `(1, H, M, M)` with `M = (height // tile_h) * (width // tile_w)`, block size
        `tile_h * tile_w`, and `tiling = Tiling((1, height, width), (1, tile_h, tile_w))`.

    Example (Path-256's image is `neighborhood_2d(256, 256, (16, 8))`: 512 tiles of 128 pixels):
        >>> m = masks.neighborhood_2d(64, 64, (8, 8), window=1) | masks.global_(4096, 64)  # 64 tiles
        >>> x = masks.to_tiles(torch.randn(1, 2, 4096, 32), 64, 64, (8, 8))  # row-major pixels -> tiles
        >>> out = masks.from_tiles(sparse_flash.block_sparse_attention(x, x, x, m), 64, 64, (8, 8))
        >>> out.shape
        torch.Size([1, 2, 4096, 32])
    """
    device = check_device(device)
    tiling = tiling_of(height, width, tile)
    windows = _windows(window, ("h", "w"), num_heads)
    _, th, tw = tiling.tile
    return _neighborhood(tiling, windows, device, f"neighborhood_2d({th}x{tw} tiles, window={_describe(window)})")


def neighborhood_3d(frames: int, height: int, width: int, tile, window=1, *, num_heads: int | None = None,
                    device=None) -> BlockMask:
    """Each video tile attends the tiles within a 3-D window: Chebyshev distance in tile units, per axis.

    Block (a, b) is on iff the tiles' positions on the `(frames, rows, columns)` tile grid differ by at most
    `(window_t, window_h, window_w)`. Tokens must be in tile-major order (`masks.to_tiles(..., frames=)`):
    `block_size = tile_t * tile_h * tile_w`, `seq_len = frames * height * width`.

    Args:
        frames, height, width: video size in frames and pixels.
        tile: int (a cube) or `(tile_t, tile_h, tile_w)`; each divides the matching video side.
        window: int (every axis) or a tuple `(window_t, window_h, window_w)`, in tiles, >= 0; or a *list*
            with one such window per head (a tuple is per axis, a list per head).
        num_heads: as for `neighborhood_2d`.
        device: where the layout lives.

    Returns:
        BlockMask `(1, H, M, M)` with `M` the number of tiles, block size `tile_t * tile_h * tile_w`, and
        `tiling = Tiling((frames, height, width), (tile_t, tile_h, tile_w))`.

    Example (16 frames of 64 x 64 in (2, 8, 8) tiles would be 512 tiles of 128 tokens):
        >>> m = masks.neighborhood_3d(4, 32, 32, (2, 8, 8), window=(1, 1, 1))  # 32 tiles of 128 tokens
        >>> x = masks.to_tiles(torch.randn(1, 2, 4 * 32 * 32, 32), 32, 32, (2, 8, 8), frames=4)
        >>> sparse_flash.block_sparse_attention(x, x, x, m).shape
        torch.Size([1, 2, 4096, 32])
    """
    device = check_device(device)
    tiling = tiling_of(height, width, tile, frames)
    windows = _windows(window, ("t", "h", "w"), num_heads)
    tt, th, tw = tiling.tile
    return _neighborhood(tiling, windows, device,
                         f"neighborhood_3d({tt}x{th}x{tw} tiles, window={_describe(window)})")


def butterfly_2d(height: int, width: int, tile, *, n_factors: int | None = None, device=None) -> BlockMask:
    """The flat block butterfly along each axis of the tile grid, and each tile itself.

    Tiles in the same tile row are connected by the 1-D butterfly (`masks.butterfly`) of their column
    indices, tiles in the same tile column by that of their row indices: block (a, b) is on iff
    `row_a == row_b` and `col_a XOR col_b` is 0 or `2**k`, or `col_a == col_b` and `row_a XOR row_b` is 0 or
    `2**k` (`k < n_factors`). Union it with `neighborhood_2d` for local context. Tokens in tile-major order.

    Args:
        height, width: image size in pixels.
        tile: int (square) or `(tile_h, tile_w)`, in pixels; each divides the matching image side.
        n_factors: butterfly factors per axis; default all (`ceil(log2(tiles along that axis))`).
        device: where the layout lives.

    Returns:
        BlockMask `(1, 1, M, M)`, block size `tile_h * tile_w`, `tiling = Tiling((1, height, width),
        (1, tile_h, tile_w))`.

    Example:
        >>> m = masks.butterfly_2d(256, 256, (16, 8)) | masks.neighborhood_2d(256, 256, (16, 8), window=1)
        >>> m.tiling.tiles
        (1, 16, 32)
    """
    device = check_device(device)
    tiling = tiling_of(height, width, tile)
    _, rows, cols = tiling.tiles

    def axis(n: int) -> torch.Tensor:
        return butterfly_layout(n, n_factors, device)

    def same(n: int) -> torch.Tensor:  # the tile's own row (column) only
        return torch.eye(n, dtype=torch.bool, device=device)

    layout = _kron(same(rows), axis(cols)) | _kron(axis(rows), same(cols))
    _, th, tw = tiling.tile
    name = f"butterfly_2d({th}x{tw} tiles{'' if n_factors is None else f', n_factors={n_factors}'})"
    return _tiled_mask(layout, tiling, name)

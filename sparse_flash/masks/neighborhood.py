"""2-D and 3-D patterns over image and video tiles: a neighbourhood of tiles, and a butterfly along each tile axis.

Each mask block is one tile of tokens in tile-major order (`masks.to_tiles`), so block (a, b) says whether the
pixels of tile a attend the pixels of tile b. The masks carry their `Tiling`; `mask.plot()` draws them on the
pixel grid.
"""

from __future__ import annotations

import math

import torch

from ..mask import BlockMask, Tiling
from ..mask_index import BlockRuns
from ._common import MAX_INT, MAX_LAYOUT_BLOCKS, Geometry, check_device, geometry, joined_runs, make_from_runs, optional_heads, positive_int
from .butterfly import MAX_FACTORS
from .tiles import per_axis, tiling_of


def _tile_positions(tiles: tuple[int, ...]) -> list[torch.Tensor]:
    """int64 `(M,)` per axis: each tile's position along it, tiles in tile-major order (the last axis fastest)."""
    grid = torch.meshgrid(*(torch.arange(n) for n in tiles), indexing="ij")
    return [g.flatten() for g in grid]


def _neighborhood_runs(tiles: tuple[int, int, int], window: tuple[int, int, int]) -> BlockRuns:
    """The runs (`BlockRuns`) of one head's neighbourhood on the host: for each tile and each (frame, row)
    offset within the window, the tiles of that row within the window along the last axis, one run (off the
    grid: empty)."""
    (T, H, W), (wt, wh, ww) = tiles, (min(w, n) for w, n in zip(window, tiles))
    t, h, w = _tile_positions(tiles)
    dt, dh = (g.flatten() for g in torch.meshgrid(torch.arange(-wt, wt + 1), torch.arange(-wh, wh + 1), indexing="ij"))
    t2, h2 = t[:, None] + dt, h[:, None] + dh  # (M, offsets)
    on = (t2 >= 0) & (t2 < T) & (h2 >= 0) & (h2 < H)
    base = (t2 * H + h2) * W
    start = torch.where(on, base + (w - ww).clamp(min=0)[:, None], 0)
    end = torch.where(on, base + (w + ww + 1).clamp(max=W)[:, None], 0)
    return BlockRuns(torch.arange(T * H * W)[:, None].expand_as(start).flatten(), start.flatten(), end.flatten())


def _tile_geometry(tiling: Tiling, heads: int) -> Geometry:
    """The geometry of a `(1, heads, M, M)` mask over these tiles, checked before any run is built: its layout
    must fit the int32 index lists (`_common.geometry`), said in tiles."""
    M, tokens = math.prod(tiling.tiles), math.prod(tiling.tile)
    if heads * M * M > MAX_LAYOUT_BLOCKS:
        raise ValueError(
            f"{M} tiles ({' x '.join(map(str, tiling.tiles))} of {' x '.join(map(str, tiling.tile))} tokens) and "
            f"{heads} head(s) give {heads} x {M} x {M} = "
            f"{heads * M * M} blocks, more than the {MAX_LAYOUT_BLOCKS} that the mask's int32 index lists address; "
            "use larger tiles or a smaller grid"
        )
    if M * tokens > MAX_INT:
        raise ValueError(f"the grid {tiling.grid} holds {M * tokens} tokens, more than {MAX_INT}")
    return geometry(M * tokens, tokens, heads=heads)


def _tiled_mask(runs: BlockRuns, geo: Geometry, heads: int, tiling: Tiling, name: str, device) -> BlockMask:
    """The `(1, heads, M, M)` mask of these runs over the tiles, listed on the host (no device wait)."""
    return make_from_runs(runs, geo, name, device, heads, tiling)


def _neighborhood(tiling: Tiling, windows: list, geo: Geometry, device, name: str) -> BlockMask:
    per_window = {}  # heads with the same window share one head's runs
    for w in windows:
        if w not in per_window:
            per_window[w] = _neighborhood_runs(tiling.tiles, w)
    M = math.prod(tiling.tiles)
    runs = joined_runs(*(per_window[w]._replace(row=per_window[w].row + h * M) for h, w in enumerate(windows)))
    return _tiled_mask(runs, geo, len(windows), tiling, name, device)


def _windows(window, axes: tuple[str, ...], num_heads, tiling: Tiling) -> tuple[list[tuple[int, int, int]], Geometry]:
    """One `(t, h, w)` window per head (a list gives one per head, anything else one for all heads), and the
    mask's geometry, checked before a window is repeated per head."""
    if isinstance(window, list):
        if not window:
            raise ValueError("window: a per-head list needs at least one window, got []")
        if num_heads is not None and optional_heads(num_heads) != len(window):
            raise ValueError(f"window lists {len(window)} per-head windows but num_heads={num_heads}")
        windows = [per_axis(w, f"window[{k}]", axes, 0, 0) for k, w in enumerate(window)]
        return windows, _tile_geometry(tiling, len(windows))
    one, heads = per_axis(window, "window", axes, 0, 0), optional_heads(num_heads)
    geo = _tile_geometry(tiling, heads)
    return [one] * heads, geo


def _describe(window) -> str:
    if isinstance(window, list):
        return "[" + ", ".join(map(_describe, window)) + "]"
    return str(tuple(window)) if isinstance(window, (tuple, list)) else str(window)


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
    windows, geo = _windows(window, ("h", "w"), num_heads, tiling)
    _, th, tw = tiling.tile
    return _neighborhood(tiling, windows, geo, device, f"neighborhood_2d({th}x{tw} tiles, window={_describe(window)})")


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
    windows, geo = _windows(window, ("t", "h", "w"), num_heads, tiling)
    tt, th, tw = tiling.tile
    return _neighborhood(tiling, windows, geo, device,
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
    if n_factors is not None:
        n_factors = positive_int(n_factors, "n_factors", minimum=0, maximum=MAX_FACTORS)
    tiling = tiling_of(height, width, tile)
    geo = _tile_geometry(tiling, 1)
    _, rows, cols = tiling.tiles

    # tile (r, c) attends (r, c') for c' among c's butterfly partners (itself included) and (r', c) for r' among
    # r's other partners: one block per run, the partners past the grid's side as empty runs
    factors = [all_factors if n_factors is None else min(n_factors, all_factors)
               for all_factors in (math.ceil(math.log2(n)) for n in (rows, cols))]
    r, c = _tile_positions((rows, cols))
    along_row = c[:, None] ^ _partners(factors[1])  # (M, 1 + factors): self first
    along_col = r[:, None] ^ _partners(factors[0])[1:]
    start = torch.cat([r[:, None] * cols + along_row.clamp(max=cols - 1), along_col.clamp(max=rows - 1) * cols + c[:, None]], 1)
    end = torch.where(torch.cat([along_row < cols, along_col < rows], 1), start + 1, start)
    runs = BlockRuns(torch.arange(rows * cols)[:, None].expand_as(start).flatten(), start.flatten(), end.flatten())
    _, th, tw = tiling.tile
    name = f"butterfly_2d({th}x{tw} tiles{'' if n_factors is None else f', n_factors={n_factors}'})"
    return _tiled_mask(runs, geo, 1, tiling, name, device)


def _partners(factors: int) -> torch.Tensor:
    """int64 `(1 + factors,)`: 0, then 2**k for each factor: XOR a position with them for its partners."""
    return torch.cat([torch.zeros(1, dtype=torch.int64), 1 << torch.arange(factors)])

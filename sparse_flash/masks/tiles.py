"""Tile-major token order for images and video, so that one mask block is one 2-D (or 3-D) tile.

In row-major pixel order a block of 128 tokens of a 256-px image is half an image row: a 1-D band of blocks
never reaches the pixel above. Reordered tile by tile (tiles row-major over the tile grid, pixels row-major
inside each tile), block `i` holds exactly tile `i`, and the patterns of `masks.neighborhood` are 2-D
locality in image space.
"""

from __future__ import annotations

import math

import torch

from ..mask import Tiling
from ._common import positive_int


def per_axis(value, name: str, axes: tuple[str, ...], minimum: int, pad: int) -> tuple[int, int, int]:
    """An int (the same on every axis) or a tuple/list of one int per named axis, as a `(t, h, w)` triple;
    for two axes the leading time axis is `pad`."""
    noun = name.split("[")[0]
    expected = f"{name} must be an int or a ({', '.join(f'{noun}_{a}' for a in axes)}) tuple, got {value!r}"
    if isinstance(value, (tuple, list)):
        if len(value) != len(axes):
            raise TypeError(expected)
        return ((pad,) * (3 - len(axes))) + tuple(
            positive_int(v, f"{name}[{k}] ({axis})", minimum) for k, (v, axis) in enumerate(zip(value, axes)))
    try:
        value = positive_int(value, name, minimum)
    except TypeError:
        raise TypeError(expected) from None
    return ((pad,) * (3 - len(axes))) + (value,) * len(axes)


def tiling_of(height, width, tile, frames=None) -> Tiling:
    """The `Tiling` of an image (`frames=None`) or a video, checked: sizes positive, the tile dividing them."""
    height, width = positive_int(height, "height"), positive_int(width, "width")
    if frames is None:
        grid, axes = (1, height, width), ("h", "w")
    else:
        grid, axes = (positive_int(frames, "frames"), height, width), ("t", "h", "w")
    sizes = per_axis(tile, "tile", axes, 1, 1)
    if any(g % t for g, t in zip(grid, sizes)):
        names = ", ".join(("frames", "height", "width")[-len(axes):])
        raise ValueError(f"tile {sizes[-len(axes):]} must divide ({names}) = {grid[-len(axes):]} along every axis")
    return Tiling(grid, sizes)


def _check_tokens(x, tiling: Tiling, fn: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (3, 4):
        raise ValueError(f"{fn}: x must have shape (B, N, C) or (B, H, N, D), got shape {tuple(x.shape)}")
    n = math.prod(tiling.grid)
    if x.shape[-2] != n:
        what = "frames * height * width" if tiling.grid[0] > 1 else "height * width"
        raise ValueError(f"{fn}: x has {x.shape[-2]} tokens (axis -2 of shape {tuple(x.shape)}), but {what} = "
                         f"{' * '.join(map(str, tiling.grid if tiling.grid[0] > 1 else tiling.grid[1:]))} = {n}")


def _split(tiling: Tiling) -> list[int]:
    """`(Tt, tt, Th, th, Tw, tw)`: every axis of the grid split into (tiles, pixels of a tile)."""
    return [s for n, t in zip(tiling.tiles, tiling.tile) for s in (n, t)]


def _to_tiles(x: torch.Tensor, tiling: Tiling) -> torch.Tensor:
    lead, k = x.shape[:-2], x.dim() - 2
    y = x.reshape(*lead, *_split(tiling), x.shape[-1])  # (..., Tt, tt, Th, th, Tw, tw, C)
    y = y.permute(*range(k), k, k + 2, k + 4, k + 1, k + 3, k + 5, k + 6)  # (..., Tt, Th, Tw, tt, th, tw, C)
    return y.reshape(x.shape)  # (no -1: a tensor with no elements has no size to infer)


def _from_tiles(x: torch.Tensor, tiling: Tiling) -> torch.Tensor:
    lead, k = x.shape[:-2], x.dim() - 2
    y = x.reshape(*lead, *tiling.tiles, *tiling.tile, x.shape[-1])  # (..., Tt, Th, Tw, tt, th, tw, C)
    y = y.permute(*range(k), k, k + 3, k + 1, k + 4, k + 2, k + 5, k + 6)  # (..., Tt, tt, Th, th, Tw, tw, C)
    return y.reshape(x.shape)


def to_tiles(x: torch.Tensor, height: int, width: int, tile, *, frames: int | None = None) -> torch.Tensor:
    """Reorder image or video tokens from row-major pixel order to tile-major order.

    Tile-major: tiles row-major over the tile grid (frame-tiles, then tile rows, then tile columns), pixels
    row-major inside each tile. With `block_size = tile_t * tile_h * tile_w` mask block `i` is tile `i`, as the
    masks of `masks.neighborhood_2d` and `masks.neighborhood_3d` expect. A pure reshape and permute:
    differentiable, and traceable by `torch.compile`. `from_tiles` is its exact inverse.

    Args:
        x: `(B, N, C)` or `(B, H, N, D)`, any dtype and device, tokens on axis -2 in row-major pixel order
            (`N = height * width`, or `frames * height * width` for video: frame, row, column).
        height, width: image size in pixels.
        tile: int (square, or a cube for video) or `(tile_h, tile_w)`; `(tile_t, tile_h, tile_w)` for video.
            Each side divides the matching image side.
        frames: number of video frames; None for an image.

    Returns:
        A tensor of x's shape, dtype and device with the tokens in tile-major order.

    Raises:
        TypeError: x is not a tensor, or a size or `tile` is not an int (tuple).
        ValueError: x's shape or token count does not match, or `tile` does not divide the image.

    Example:
        >>> x = torch.randn(2, 256 * 256, 32)  # a 256 x 256 image, row-major
        >>> y = masks.to_tiles(x, 256, 256, (16, 8))  # 512 tiles of 128 pixels
        >>> torch.equal(masks.from_tiles(y, 256, 256, (16, 8)), x)
        True
    """
    tiling = tiling_of(height, width, tile, frames)
    _check_tokens(x, tiling, "to_tiles")
    return _to_tiles(x, tiling)


def from_tiles(x: torch.Tensor, height: int, width: int, tile, *, frames: int | None = None) -> torch.Tensor:
    """Reorder tokens from tile-major order back to row-major pixel order: the exact inverse of `to_tiles`.

    Args:
        x: `(B, N, C)` or `(B, H, N, D)`, tokens on axis -2 in tile-major order (the output of `to_tiles`).
        height, width, tile, frames: as given to `to_tiles`.

    Returns:
        A tensor of x's shape, dtype and device with the tokens in row-major pixel order.

    Raises:
        TypeError, ValueError: as `to_tiles`.

    Example:
        >>> y = masks.to_tiles(torch.randn(1, 4, 64 * 64, 16), 64, 64, 8)  # (B, H, N, D): 64 tiles of 8 x 8
        >>> x = masks.from_tiles(y, 64, 64, 8)  # row-major pixels again
        >>> x.shape
        torch.Size([1, 4, 4096, 16])
    """
    tiling = tiling_of(height, width, tile, frames)
    _check_tokens(x, tiling, "from_tiles")
    return _from_tiles(x, tiling)


def tile_order(height: int, width: int, tile, *, frames: int | None = None, inverse: bool = False,
               device=None) -> torch.Tensor:
    """The permutation behind `to_tiles` as an index tensor, e.g. to reorder a positional table.

    `to_tiles(x, ...) == x.index_select(-2, tile_order(...))`: position `i` of the tile-major sequence holds
    row-major token `tile_order(...)[i]`. With `inverse=True` the inverse permutation, behind `from_tiles`.

    Args:
        height, width, tile, frames: as for `to_tiles`.
        inverse: return the permutation from tile-major back to row-major order.
        device: where the index tensor lives.

    Returns:
        int64 `(N,)`, a permutation of `0 .. N - 1`.

    Example:
        >>> order = masks.tile_order(4, 4, 2)
        >>> order.tolist()
        [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]
    """
    tiling = tiling_of(height, width, tile, frames)
    index = torch.arange(math.prod(tiling.grid), device=device)[None, :, None]
    convert = _from_tiles if inverse else _to_tiles
    return convert(index, tiling).reshape(-1)

"""Pictures of masks (needs matplotlib: the `viz` extra).

`plot_mask` draws a mask's block layout, one panel per (batch, head) layout. Masks built for images or
video (`BlockMask.tiling` set) are also drawn as the picture they stand for.
"""

from __future__ import annotations


import torch

from .checks import picture_path, positive_int
from .mask import BlockMask, Tiling

_MAX_GRID_LINES = 64  # tile borders are drawn up to this many tiles per side


def _pyplot(interactive: bool):
    try:
        import matplotlib

        if not interactive:
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - exercised only without matplotlib
        raise ImportError(
            "BlockMask.plot needs matplotlib: install the viz extra with `pip install sparse-flash[viz]`"
        ) from e
    return plt


def plot_mask(mask: BlockMask, path=None, *, heads: int = 4, ax=None):
    """Draw the block layout; write a PNG when `path` is given.

    A mask with a `tiling` (image or video tiles in tile-major order, e.g. `masks.neighborhood_2d`) is also
    drawn on the pixel grid: beside each layout, for a corner, an edge and the centre query tile of the first
    frame, the image with the key tiles that query attends shaded (the query tile in red).

    Args:
        mask: the BlockMask to draw.
        path: file to write (PNG), or None to only return the figure.
        heads: the number of (batch, head) layouts to draw, at most: side by side, or one row each for a
            tiled mask.
        ax: a matplotlib Axes to draw the first layout into (for galleries); then only that block layout is
            drawn, tiled or not.

    Returns:
        The matplotlib Figure.

    Raises:
        ImportError: matplotlib is missing (install the `viz` extra: `pip install sparse-flash[viz]`).
        TypeError, ValueError: `heads` is not an int from 1, or `path` is not a file name in an existing
            folder, a path or a writable binary file.

    Example:
        >>> fig = sparse_flash.masks.butterfly(4096, 128).plot("butterfly.png")
    """
    heads = positive_int(heads, "heads")
    path = picture_path(path)
    if ax is not None and not callable(getattr(ax, "imshow", None)):
        raise TypeError(f"ax must be a matplotlib Axes or None, got {type(ax).__name__}")
    plt = _pyplot(interactive=ax is not None)
    B, H, Mq, Mk = mask.shape
    layouts = mask.layout.reshape(B * H, Mq, Mk).cpu()
    title = f"{mask.name}\n{Mq}x{Mk} blocks of {mask.block_size[0]}x{mask.block_size[1]}, density {mask.density:.1%}"
    if ax is not None:
        ax.imshow(layouts[0].numpy(), cmap="Greys", interpolation="nearest", vmin=0, vmax=1)
        ax.set_title(title, fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
        return ax.figure
    n = min(B * H, heads)
    if mask.tiling is None:
        fig, axes = plt.subplots(1, n, figsize=(3.2 * n, 3.4), squeeze=False)
    else:
        queries = _query_tiles(mask.tiling)
        fig, axes = plt.subplots(n, 1 + len(queries), figsize=(3.2 * (1 + len(queries)), 3.2 * n + 0.6),
                                 squeeze=False, layout="constrained")  # room for the suptitle and every label
    for idx in range(n):
        a = axes[0][idx] if mask.tiling is None else axes[idx][0]
        a.imshow(layouts[idx].numpy(), cmap="Greys", interpolation="nearest", vmin=0, vmax=1)
        a.set_xlabel("key block")
        a.set_ylabel("query block")
        if B * H > 1:
            a.set_title(f"batch {idx // H}, head {idx % H}", fontsize=9)
        if mask.tiling is not None:
            for picture_ax, (where, tile) in zip(axes[idx][1:], queries):
                _draw_tiles(picture_ax, layouts[idx][tile], mask.tiling, tile, where)
    fig.suptitle(title, fontsize=10)
    if mask.tiling is None:
        fig.tight_layout()
    if path is not None:
        try:
            fig.savefig(path, dpi=120, format="png")
        finally:  # written or not, the figure is not left open
            plt.close(fig)
    return fig


def _query_tiles(tiling: Tiling) -> list[tuple[str, int]]:
    """The query tiles drawn on the pixel grid: a corner, the middle of the top edge and the centre, all in
    the first frame (tile numbers in tile-major order), without repeats."""
    _, rows, cols = tiling.tiles
    picks = {}
    for where, (r, c) in (("corner", (0, 0)), ("edge", (0, cols // 2)), ("centre", (rows // 2, cols // 2))):
        picks.setdefault(r * cols + c, where)
    return [(where, tile) for tile, where in picks.items()]


def _draw_tiles(ax, keys, tiling: Tiling, query: int, where: str) -> None:
    """One query tile's row of the layout on the first frame's pixel grid: attended tiles shaded, the query
    tile marked, tile borders drawn while they stay readable."""
    from matplotlib.colors import ListedColormap

    frames, height, width = tiling.grid
    _, rows, cols = tiling.tiles
    picture = keys.reshape(tiling.tiles)[0].to(torch.uint8)  # (rows, cols): key tiles of the first frame
    picture[query // cols, query % cols] += 2  # 2: the query tile, not attended; 3: attended
    cmap = ListedColormap(["white", "#6baed6", "#fcbba1", "#cb181d"])
    ax.imshow(picture.numpy(), cmap=cmap, vmin=0, vmax=3, interpolation="nearest", extent=(0, width, height, 0))
    if max(rows, cols) <= _MAX_GRID_LINES:
        _, th, tw = tiling.tile
        ax.hlines(range(0, height + 1, th), 0, width, colors="0.75", linewidths=0.4)
        ax.vlines(range(0, width + 1, tw), 0, height, colors="0.75", linewidths=0.4)
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    frame = f", frame 0 of {frames}" if frames > 1 else ""
    ax.set_title(f"{where} tile ({query // cols}, {query % cols}){frame}", fontsize=9)
    ax.set_xlabel("x (pixels)")
    ax.set_ylabel("y (pixels)")

"""Pictures of masks (needs matplotlib: the `viz` extra).

`plot_mask` draws a mask's block layout, one panel per (batch, head) layout. Masks built for images or
video (`BlockMask.tiling` set) are also drawn as the picture they stand for.
"""

from __future__ import annotations

from .layout import BlockMask


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

    Args:
        mask: the BlockMask to draw.
        path: file to write (PNG), or None to only return the figure.
        heads: the number of (batch, head) layouts to draw side by side, at most.
        ax: a matplotlib Axes to draw the first layout into (for galleries); then only that one is drawn.

    Returns:
        The matplotlib Figure.

    Raises:
        ImportError: matplotlib is missing (install the `viz` extra: `pip install sparse-flash[viz]`).

    Example:
        >>> sparse_flash.masks.butterfly(4096, 128).plot("butterfly.png")
    """
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
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n, 3.4), squeeze=False)
    for idx, a in enumerate(axes[0]):
        a.imshow(layouts[idx].numpy(), cmap="Greys", interpolation="nearest", vmin=0, vmax=1)
        a.set_xlabel("key block")
        a.set_ylabel("query block")
        if B * H > 1:
            a.set_title(f"batch {idx // H}, head {idx % H}", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return fig

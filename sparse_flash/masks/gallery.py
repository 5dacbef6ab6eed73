"""Patterns by name, and a picture of all of them side by side."""

from __future__ import annotations


from ..checks import picture_path
from ._common import geometry
from .bigbird import bigbird
from .butterfly import butterfly
from .causal import causal
from .dense import dense
from .fixed import fixed
from .global_blocks import global_
from .local import local
from .longformer import longformer
from .random_blocks import random
from .strided import strided

PATTERNS = {
    "dense": dense,
    "causal": causal,
    "local": local,
    "butterfly": butterfly,
    "random": random,
    "global": global_,
    "bigbird": bigbird,
    "longformer": longformer,
    "fixed": fixed,
    "strided": strided,
}



def _gallery_args(name: str, num_blocks: int) -> dict:
    """Parameters that make each pattern readable at gallery size (a global block in the middle)."""
    return {
        "local": {"window": 2},
        "random": {"density": 0.15, "seed": 0},
        "global": {"num_global_blocks": 2},
        "longformer": {"global_block_indices": sorted({0, num_blocks // 2})},
    }.get(name, {})


def build(name: str, seq_len: int, block_size=128, **params):
    """Build the pattern called `name` (a key of `PATTERNS`) with its keyword parameters.

    Raises:
        TypeError, ValueError: an unknown name, or a parameter the pattern refuses.

    Example:
        >>> from sparse_flash.masks.gallery import build
        >>> build("local", 4096, 128, window=2).nnz  # 32 rows of 5 blocks, less 6 past the corners
        154
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a pattern name (str), got {type(name).__name__} {name!r}")
    if name not in PATTERNS:
        raise ValueError(f"unknown mask pattern {name!r}; expected one of {sorted(PATTERNS)}")
    return PATTERNS[name](seq_len, block_size, **params)


def gallery(path=None, *, seq_len: int = 4096, block_size: int = 128):
    """Draw every pattern side by side (matplotlib); write a PNG when `path` is given. Returns the Figure.

    `seq_len` and `block_size` (ints from 1) are checked before matplotlib is imported. The PNG is written to
    `path` as named, whatever its suffix.

    Example:
        >>> from sparse_flash import masks
        >>> fig = masks.gallery("masks.png")  # doctest: +SKIP
    """
    geo = geometry(seq_len, block_size)
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        raise TypeError(f"block_size must be an int (square blocks: some patterns take no other), got "
                        f"{type(block_size).__name__} {block_size!r}")
    path = picture_path(path)
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - exercised only without matplotlib
        raise ImportError(
            "masks.gallery needs matplotlib: install the viz extra, `pip install sparse-flash[viz]`"
        ) from e
    names = list(PATTERNS)
    cols = 5
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.4 * rows), squeeze=False)
    try:
        for ax, name in zip(axes.flat, names):
            build(name, seq_len, block_size, **_gallery_args(name, geo.num_blocks_q)).plot(ax=ax)
        for ax in list(axes.flat)[len(names):]:
            ax.axis("off")
        fig.suptitle(f"sparse_flash mask patterns, {seq_len} tokens, block {block_size}", fontsize=12)
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=110, format="png")
    except BaseException:
        plt.close(fig)  # no half-drawn figure left open
        raise
    if path is not None:
        plt.close(fig)
    return fig

"""Patterns by name, and a picture of all of them side by side."""

from __future__ import annotations

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

# Parameters that make each pattern readable at gallery size.
_GALLERY_ARGS = {
    "local": {"window": 2},
    "random": {"density": 0.15, "seed": 0},
    "global": {"num_global_blocks": 2},
    "longformer": {"global_block_indices": (0, 16)},
}


def build(name: str, seq_len: int, block_size=128, **params):
    """Build the pattern called `name` (a key of `PATTERNS`) with its keyword parameters.

    Example:
        >>> from sparse_flash.masks.gallery import build
        >>> build("local", 4096, 128, window=2).nnz
        156
    """
    if name not in PATTERNS:
        raise ValueError(f"unknown mask pattern {name!r}; expected one of {sorted(PATTERNS)}")
    return PATTERNS[name](seq_len, block_size, **params)


def gallery(path=None, *, seq_len: int = 4096, block_size: int = 128):
    """Draw every pattern side by side (matplotlib); write a PNG when `path` is given. Returns the Figure.

    Example:
        >>> from sparse_flash import masks
        >>> fig = masks.gallery("masks.png")  # doctest: +SKIP
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - exercised only without matplotlib
        raise ImportError("masks.gallery needs matplotlib: install the viz extra, `pip install sparse-flash[viz]`") from e
    names = list(PATTERNS)
    cols = 5
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.4 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        build(name, seq_len, block_size, **_GALLERY_ARGS.get(name, {})).plot(ax=ax)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle(f"sparse_flash mask patterns, {seq_len} tokens, block {block_size}", fontsize=12)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig

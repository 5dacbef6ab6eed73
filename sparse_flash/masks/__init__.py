"""Block-sparse attention patterns. Every constructor returns a `sparse_flash.BlockMask`.

Lengths are in tokens, pattern parameters in blocks. Definitions follow the butterfly of Pixelated
Butterfly, the Sparse Transformer, BigBird and Longformer (DeepSpeed-compatible defaults).

Example:
    >>> from sparse_flash import masks
    >>> m = masks.butterfly(4096, 128) | masks.local(4096, 128, window=1)
"""

from .bigbird import bigbird
from .butterfly import butterfly
from .causal import causal
from .dense import dense
from .fixed import fixed
from .gallery import PATTERNS, build, gallery
from .global_blocks import global_
from .local import local
from .longformer import longformer
from .neighborhood import butterfly_2d, neighborhood_2d, neighborhood_3d
from .random_blocks import random
from .strided import strided
from .tiles import from_tiles, tile_order, to_tiles

__all__ = sorted(
    ["PATTERNS", "bigbird", "build", "butterfly", "causal", "dense", "fixed", "gallery", "global_", "local", "longformer",
     "random", "strided"]
    + ["butterfly_2d", "from_tiles", "neighborhood_2d", "neighborhood_3d", "tile_order", "to_tiles"]
)

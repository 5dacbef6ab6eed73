"""Deprecated: `sparse_flash.layout` split into `sparse_flash.mask` (BlockMask, Tiling) and
`sparse_flash.mask_index` (index lists, work plans and their scheduling constants). Import from those."""

import warnings

from .mask import BlockMask, Tiling  # noqa: F401
from .mask_index import (HEAVY_FACTOR, ITEM_FIELDS, LONG_LIST_BLOCKS, SPLIT_FACTOR, SPLIT_MAX_CHUNKS,  # noqa: F401
                         SPLIT_MIN_CHUNK, BlockIndex, KernelIndex, MaskGeometry, WorkPlan)

warnings.warn("sparse_flash.layout is deprecated: import BlockMask and Tiling from sparse_flash.mask (or "
              "sparse_flash), index records from sparse_flash.mask_index", DeprecationWarning, stacklevel=2)

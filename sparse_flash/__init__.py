"""sparse_flash: block-sparse FlashAttention for PyTorch.

Exact softmax attention over the nonzero blocks of a block mask, with Triton kernels that never touch the
zero blocks, a plain-PyTorch block-sparse backend and a dense oracle.

Example:
    >>> import torch, sparse_flash
    >>> from sparse_flash import masks
    >>> q = k = v = torch.randn(1, 2, 512, 64)
    >>> out = sparse_flash.block_sparse_attention(q, k, v, masks.local(512, 128, window=1))
"""

from . import masks
from .api import block_sparse_attention, flash_attention, merge_attention
from .mask import BlockMask
from .mask_index import BlockIndex, KernelIndex

__version__ = "0.1.0"

__all__ = sorted(
    ["BlockIndex", "BlockMask", "KernelIndex", "__version__", "block_sparse_attention", "flash_attention", "masks",
     "merge_attention", "nn"]
)


def __getattr__(name):
    # `sparse_flash.nn` (it needs einops) loads on first use, so `import sparse_flash` needs torch alone.
    if name == "nn":
        import importlib

        return importlib.import_module(".nn", __name__)
    raise AttributeError(f"module 'sparse_flash' has no attribute {name!r}")

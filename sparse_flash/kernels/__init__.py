"""Triton kernels (internal). Importing this package needs triton; `import sparse_flash` does not."""

from .function import BlockSparseAttentionFunction, attention_triton

__all__ = ["BlockSparseAttentionFunction", "attention_triton"]

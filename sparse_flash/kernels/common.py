"""Pieces shared by the forward and backward kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # scores are kept in log2 units so that the kernels can use exp2


@triton.jit
def load_unmasked_rows(ptrs, d_ok, EVEN_D: tl.constexpr):
    """Load a tile whose only bound is the head dimension: no mask at all when D is a power of two."""
    if EVEN_D:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=d_ok, other=0.0)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use full-precision IEEE dots (not TF32), so fp32 results match fp32 PyTorch."""
    return "ieee" if dtype == torch.float32 else "tf32"

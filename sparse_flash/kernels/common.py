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


@triton.jit
def schedule(pid, H, BH, Order, mask_stride_b, mask_stride_h, head_scale, num_tiles,
             MASK_BLOCK: tl.constexpr, BLOCK: tl.constexpr, DENSE: tl.constexpr, REVERSE: tl.constexpr):
    """Map a program id to (batch, head, tile, mask block) so that long lists start first.

    Sparse: program ids run over (rank, batch x head), batch x head fastest, and rank r takes the mask
    block with the r-th longest list of its (batch, head) (`Order`, mask head `h * head_scale`), so every
    head's heaviest rows (global rows, dense columns) run in the first wave instead of the last.
    Dense: tiles run fastest within a head, so K and V stay in L2; in reverse when REVERSE (causal rows
    grow with the tile index).
    """
    if DENSE:
        bh = pid // num_tiles
        tile = pid % num_tiles
        if REVERSE:
            tile = num_tiles - 1 - tile
        block = tile
    else:
        SUB: tl.constexpr = MASK_BLOCK // BLOCK
        bh = pid % BH
        rank = pid // BH
        block = tl.load(Order + (bh // H) * mask_stride_b + (bh % H) * head_scale * mask_stride_h + rank // SUB)
        tile = block * SUB + rank % SUB
    return bh // H, bh % H, tile, block


@triton.jit
def list_tile_start(Idx, t, end, SUB: tl.constexpr, MASK_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """First token of sub-tile `t` of a block list (sub-tile t is tile t % SUB of block Idx[t // SUB]).

    Loops fetch the start of tile t + 1 while tile t computes, so the index load never stalls the K/V
    loads that depend on it. Past the end (`t >= end`) it returns 0 and loads nothing.
    """
    j = tl.load(Idx + t // SUB, mask=t < end, other=0)
    return j * MASK_BLOCK + (t % SUB) * BLOCK


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use full-precision IEEE dots (not TF32), so fp32 results match fp32 PyTorch."""
    return "ieee" if dtype == torch.float32 else "tf32"

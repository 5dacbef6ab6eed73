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
def schedule(pid, H, BH, Items, Lead, item_stride_b, item_stride_h, head_scale, num_tiles, head_group,
             MASK_BLOCK: tl.constexpr, BLOCK: tl.constexpr, DENSE: tl.constexpr, REVERSE: tl.constexpr):
    """Map a program id to (batch, head, tile, mask block, chunk, valid).

    Sparse: rank r of a (batch, head) takes work item r // SUB of its plan (`Items`, mask head
    `h * head_scale`): a (mask block, chunk) pair, longest first. The first `Lead` items (the heavy ones,
    such as global rows) of every (batch, head) run first, batch x head fastest, so that no long program
    starts late. The rest run in groups of `head_group` (batch x head) pairs, one group after another,
    batch x head fastest within a group: the programs in flight then read the K and V (or Q and dO) of a
    few heads, which stay in L2. Padding items (block -1) are not valid: their programs walk nothing and
    store nothing.
    Dense: tiles run fastest within a head, so K and V stay in L2; in reverse when REVERSE (causal rows
    grow with the tile index).
    """
    if DENSE:
        bh = pid // num_tiles
        tile = pid % num_tiles
        if REVERSE:
            tile = num_tiles - 1 - tile
        block = tile
        chunk = 0
        valid = True
    else:
        SUB: tl.constexpr = MASK_BLOCK // BLOCK
        ranks = tl.num_programs(0) // BH  # programs per (batch, head)
        lead = tl.load(Lead) * SUB  # ranks that every (batch, head) starts with
        rest = tl.maximum(ranks - lead, 1)
        p = pid - lead * BH
        first = (p // (head_group * rest)) * head_group  # first (batch x head) of this program's group
        size = tl.minimum(head_group, BH - first)  # the last group may be smaller
        r = p - first * rest
        in_lead = pid < lead * BH
        bh = tl.where(in_lead, pid % BH, first + r % tl.maximum(size, 1))
        rank = tl.where(in_lead, pid // BH, lead + r // tl.maximum(size, 1))
        item = Items + (bh // H) * item_stride_b + (bh % H) * head_scale * item_stride_h + (rank // SUB) * 2
        block = tl.load(item)
        chunk = tl.load(item + 1)
        valid = block >= 0
        block = tl.maximum(block, 0)
        tile = block * SUB + rank % SUB
    return bh // H, bh % H, tile, block, chunk, valid


@triton.jit
def chunk_range(FullOff, PartOff, row, chunk, num_chunks, valid):
    """The slice of list `row` that one chunk walks, as [lo, hi) ranges into the full and partial lists.

    A list is its full blocks followed by its partial blocks; chunk c of n takes positions
    [c * L // n, (c + 1) * L // n) of the L blocks. An invalid program gets empty ranges.
    """
    full_lo = tl.load(FullOff + row)
    n_full = tl.load(FullOff + row + 1) - full_lo
    part_lo = tl.load(PartOff + row)
    length = n_full + tl.load(PartOff + row + 1) - part_lo
    start = chunk * length // num_chunks
    end = tl.where(valid, (chunk + 1) * length // num_chunks, start)
    return (full_lo + tl.minimum(start, n_full), full_lo + tl.minimum(end, n_full),
            part_lo + tl.maximum(start - n_full, 0), part_lo + tl.maximum(end - n_full, 0))


@triton.jit
def list_tile_start(Idx, t, end, SUB: tl.constexpr, MASK_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """First token of sub-tile `t` of a block list (sub-tile t is tile t % SUB of block Idx[t // SUB]).

    Loops fetch the start of tile t + 1 while tile t computes, so the index load never stalls the K/V
    loads that depend on it. Past the end (`t >= end`) it returns 0 and loads nothing.
    """
    j = tl.load(Idx + t // SUB, mask=t < end, other=0)
    return j * MASK_BLOCK + (t % SUB) * BLOCK


@triton.jit
def chunk_scratch_rows(Slots, row, chunk, copies, copy, tile, valid, MASK_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """Where a chunk program of a split list stores its partial tile: scratch row numbers (BLOCK,) and which
    of them to store (none for a padding program). Slot order: (list's first slot + chunk, copy)."""
    slot = (tl.load(Slots + row) + chunk) * copies + copy
    rows = slot.to(tl.int64) * MASK_BLOCK + (tile % (MASK_BLOCK // BLOCK)) * BLOCK + tl.arange(0, BLOCK)
    keep = tl.arange(0, BLOCK) < tl.where(valid, BLOCK, 0)
    return rows, keep


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use full-precision IEEE dots (not TF32), so fp32 results match fp32 PyTorch."""
    return "ieee" if dtype == torch.float32 else "tf32"

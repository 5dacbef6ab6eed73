"""Pieces shared by the forward and backward kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # scores are kept in log2 units so that the kernels can use exp2

# Field offsets of a work item record (`mask_index.ITEM_FIELDS`; tests/test_layout.py checks that they agree).
ITEM_WIDTH = tl.constexpr(10)
ITEM_BLOCK = tl.constexpr(0)
ITEM_CHUNK = tl.constexpr(1)
ITEM_CHUNKS = tl.constexpr(2)
ITEM_SLOT = tl.constexpr(3)
ITEM_FULL_LO = tl.constexpr(4)
ITEM_FULL_HI = tl.constexpr(5)
ITEM_PART_LO = tl.constexpr(6)
ITEM_PART_HI = tl.constexpr(7)
ITEM_FULL_FIRST = tl.constexpr(8)
ITEM_PART_FIRST = tl.constexpr(9)


@triton.jit
def load_unmasked_rows(ptrs, d_ok, EVEN_D: tl.constexpr):
    """Load a tile whose only bound is the head dimension: no mask at all when D is a power of two."""
    if EVEN_D:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=d_ok, other=0.0)


@triton.jit
def store_rows(Ptr, offs_r, stride_r, offs_d, x, mask):
    """Store tile `x` (rows offs_r, columns offs_d) at Ptr, in Ptr's dtype."""
    tl.store(Ptr + offs_r[:, None] * stride_r + offs_d[None, :], x.to(Ptr.dtype.element_ty), mask=mask)


@triton.jit
def schedule(pid, programs, H, BH, Items, Lead, item_stride_b, item_stride_h, head_scale, num_tiles, head_group,
             MASK_BLOCK: tl.constexpr, BLOCK: tl.constexpr, DENSE: tl.constexpr, REVERSE: tl.constexpr):
    """Map program `pid` of a launch's `programs` to (batch, head, tile, work item record, valid).

    Sparse: rank r of a (batch, head) takes work item r // SUB of its plan (`Items`, mask head
    `h * head_scale`; the item's record is returned for `item_ranges`): a (mask block, chunk) pair, longest
    first. The first `Lead` items (the heavy ones, such as global rows) of every (batch, head) run first,
    batch x head fastest, so that no long program starts late. The rest run in groups of `head_group` (batch x head) pairs, one group after another,
    batch x head fastest within a group: the programs in flight then read the K and V (or Q and dO) of a
    few heads, which stay in L2. Padding items (block -1) are not valid: their programs walk nothing and
    store nothing.
    Dense: tiles run fastest within a head, so K and V stay in L2; in reverse when REVERSE (causal rows
    grow with the tile index). The record returned is `Items` itself, unused.
    """
    if DENSE:
        bh = pid // num_tiles
        tile = pid % num_tiles
        if REVERSE:
            tile = num_tiles - 1 - tile
        item = Items
        valid = True
    else:
        SUB: tl.constexpr = MASK_BLOCK // BLOCK
        ranks = programs // BH  # work units per (batch, head)
        lead = tl.load(Lead) * SUB  # ranks that every (batch, head) starts with
        rest = tl.maximum(ranks - lead, 1)
        p = pid - lead * BH
        first = (p // (head_group * rest)) * head_group  # first (batch x head) of this program's group
        size = tl.minimum(head_group, BH - first)  # the last group may be smaller
        r = p - first * rest
        in_lead = pid < lead * BH
        bh = tl.where(in_lead, pid % BH, first + r % tl.maximum(size, 1))
        rank = tl.where(in_lead, pid // BH, lead + r // tl.maximum(size, 1))
        item = Items + (bh // H) * item_stride_b + (bh % H) * head_scale * item_stride_h
        item += (rank // SUB) * ITEM_WIDTH
        block = tl.load(item + ITEM_BLOCK)
        valid = block >= 0
        tile = tl.maximum(block, 0) * SUB + rank % SUB
    return bh // H, bh % H, tile, item, valid


@triton.jit
def dense_key_tiles(start_m, Nk, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key tiles of a dense-path query tile starting at row `start_m`: (n_full, n_end). Tiles
    [0, n_full) need no element mask (wholly inside the keys and, when causal, below the diagonal); tiles
    [n_full, n_end) do (the key tail, the tiles on the diagonal)."""
    n_full = Nk // BLOCK_N
    n_end = tl.cdiv(Nk, BLOCK_N)
    if CAUSAL:
        n_full = tl.minimum(n_full, (start_m + 1) // BLOCK_N)
        n_end = tl.minimum(n_end, tl.cdiv(start_m + BLOCK_M, BLOCK_N))
    return n_full, n_end


@triton.jit
def item_ranges(item):
    """A work item's share of its list, read from its record in one round trip: (full_lo, full_hi, part_lo,
    part_hi, full_first, part_first, slot); [lo, hi) index the full and partial lists, `*_first` is the
    first block of each range, `slot` the chunk's scratch slot (-1: the list is not split). Padding items
    have empty ranges."""
    return (tl.load(item + ITEM_FULL_LO), tl.load(item + ITEM_FULL_HI), tl.load(item + ITEM_PART_LO),
            tl.load(item + ITEM_PART_HI), tl.load(item + ITEM_FULL_FIRST), tl.load(item + ITEM_PART_FIRST),
            tl.load(item + ITEM_SLOT))


@triton.jit
def list_ranges(FullOff, FullIdx, PartOff, PartIdx, row, item, valid):
    """`item_ranges` for list `row` of another head, chunked like the item's own list (the dK/dV pass of
    grouped heads walks every query head's column): chunk c of n takes positions [c * L // n,
    (c + 1) * L // n) of the list's L blocks, full blocks first. An invalid program gets empty ranges."""
    chunk = tl.load(item + ITEM_CHUNK)
    num_chunks = tl.maximum(tl.load(item + ITEM_CHUNKS), 1)  # padding items hold 0
    full_lo = tl.load(FullOff + row)
    n_full = tl.load(FullOff + row + 1) - full_lo
    part_lo = tl.load(PartOff + row)
    length = n_full + tl.load(PartOff + row + 1) - part_lo
    start = chunk * length // num_chunks
    end = tl.where(valid, (chunk + 1) * length // num_chunks, start)
    full_lo, full_hi = full_lo + tl.minimum(start, n_full), full_lo + tl.minimum(end, n_full)
    part_lo, part_hi = part_lo + tl.maximum(start - n_full, 0), part_lo + tl.maximum(end - n_full, 0)
    full_first = tl.load(FullIdx + full_lo, mask=full_lo < full_hi, other=0)
    part_first = tl.load(PartIdx + part_lo, mask=part_lo < part_hi, other=0)
    return full_lo, full_hi, part_lo, part_hi, full_first, part_first, tl.load(item + ITEM_SLOT)


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

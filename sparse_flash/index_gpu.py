"""The work plan of a set of lists that no program splits, built on the GPU by one Triton program per (batch,
head): the one launch that takes the place of `mask_index._plan_items`' 40-odd small torch operators per plan
(sorts, counts, gathers, scatters), each a kernel launch of its own.

`mask_index` calls `unsplit_plan` for lists on a CUDA device outside torch.compile (inside, inductor fuses the
torch operators itself); it is the only module of the mask layer that imports Triton, and only then. The plan
is the one `mask_index._plan_items` builds (tests/test_layout.py compares them under TRITON_INTERPRET=1):
items ordered by (batch, head), longest list first within, ties in list order; every item a whole list.

Example (on the CPU under TRITON_INTERPRET=1, as the tests run it):
    >>> counts = torch.tensor([[[1, 3, 2]]], dtype=torch.int32)  # (B, H, M): live blocks of 3 lists
    >>> full = (counts, torch.tensor([0, 1, 4, 6], dtype=torch.int32), torch.arange(6, dtype=torch.int32))
    >>> part = (torch.zeros_like(counts), torch.zeros(4, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    >>> items, chunks, slots, lead = unsplit_plan(counts, full, part, heavy_above=4.0, longest=3)
    >>> items[0, 0, :, 0].tolist()  # the lists by rank: longest first
    [1, 2, 0]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FIELDS = 10  # int32 fields of a work item: `mask_index.ITEM_FIELDS`, in that order
MAX_LISTS = 8192  # lists of one (batch, head) that a program sorts in its registers


def supported(lists_per_head: int, longest: int) -> bool:
    """Whether one program can order `lists_per_head` lists of at most `longest` blocks (its sort key, the
    length and the list number, must fit in 31 bits)."""
    block = triton.next_power_of_2(lists_per_head)
    return block <= MAX_LISTS and (longest + 1) * block < 2**31


def unsplit_plan(counts: torch.Tensor, full: tuple, part: tuple, heavy_above: float, longest: int):
    """The work plan of lists that no program splits, on the lists' device.

    Args:
        counts: int32 `(B, H, M)`: live blocks of each list.
        full, part: `(counts, offsets, indices)` of the full and the partial lists (a `BlockIndex`).
        heavy_above: a list longer than this is heavy (`HEAVY_FACTOR` x the mean length).
        longest: an upper bound of the lists' lengths (the block count of the other side).

    Returns:
        `(items, chunks, slots, lead)`: int32 `(B, H, M, FIELDS)` items, `(B * H * M,)` chunks (all 1) and
        slots (all -1), and `(1,)` the most heavy lists of one (batch, head).
    """
    B, H, M = counts.shape
    device = counts.device
    items = torch.empty((B, H, M, FIELDS), dtype=torch.int32, device=device)
    chunks = torch.empty(B * H * M, dtype=torch.int32, device=device)
    slots = torch.empty(B * H * M, dtype=torch.int32, device=device)
    lead = torch.zeros(1, dtype=torch.int32, device=device)
    _unsplit_plan_kernel[(B * H, )](counts, *full[:3], *part[:3], items, chunks, slots, lead, M, longest,
                                    float(heavy_above), BLOCK=triton.next_power_of_2(M), FIELDS=FIELDS,
                                    num_warps=4 if M <= 1024 else 8)
    return items, chunks, slots, lead


@triton.jit
def _unsplit_plan_kernel(Counts, FullCounts, FullOffsets, FullIndices, PartCounts, PartOffsets, PartIndices, Items,
                         Chunks, Slots, Lead, lists_per_head, longest, heavy_above, BLOCK: tl.constexpr,
                         FIELDS: tl.constexpr):
    """Program bh: the items of lists [bh * lists_per_head, (bh + 1) * lists_per_head), sorted longest first (a
    stable order: the key is (longest - length, list)); item fields as `mask_index.ITEM_FIELDS`; its heavy lists
    counted into Lead."""
    bh = tl.program_id(0)
    idx = tl.arange(0, BLOCK)
    valid = idx < lists_per_head
    lists = bh * lists_per_head + idx
    length = tl.load(Counts + lists, mask=valid, other=0)
    key = tl.where(valid, (longest - length) * BLOCK + idx, 2147483647)  # unused slots sort last
    order = tl.sort(key) % BLOCK  # the list at each rank
    at = bh * lists_per_head + order
    full_lo = tl.load(FullOffsets + at, mask=valid, other=0)
    full_n = tl.load(FullCounts + at, mask=valid, other=0)
    part_lo = tl.load(PartOffsets + at, mask=valid, other=0)
    part_n = tl.load(PartCounts + at, mask=valid, other=0)
    full_first = tl.load(FullIndices + full_lo, mask=valid & (full_n > 0), other=0)
    part_first = tl.load(PartIndices + part_lo, mask=valid & (part_n > 0), other=0)
    item = Items + lists.to(tl.int64) * FIELDS
    one = tl.zeros_like(order) + 1
    tl.store(item + 0, order, mask=valid)  # block
    tl.store(item + 1, tl.zeros_like(order), mask=valid)  # chunk
    tl.store(item + 2, one, mask=valid)  # chunks
    tl.store(item + 3, -one, mask=valid)  # slot
    tl.store(item + 4, full_lo, mask=valid)
    tl.store(item + 5, full_lo + full_n, mask=valid)
    tl.store(item + 6, part_lo, mask=valid)
    tl.store(item + 7, part_lo + part_n, mask=valid)
    tl.store(item + 8, full_first, mask=valid)
    tl.store(item + 9, part_first, mask=valid)
    tl.store(Chunks + lists, one, mask=valid)
    tl.store(Slots + lists, -one, mask=valid)
    heavy = tl.sum((valid & (length.to(tl.float32) > heavy_above)).to(tl.int32), 0)
    tl.atomic_max(Lead, heavy)

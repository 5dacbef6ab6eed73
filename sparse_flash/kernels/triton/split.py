"""Long lists split across programs: scratch for the chunks, and how the last chunk combines them.

A mask's work plan (`mask_index.WorkPlan`) cuts lists much longer than average (the global rows and columns
of BigBird or Longformer) into chunks, each walked by its own program, so one list no longer sets the
running time. Each chunk program stores its partial result in a scratch slot and counts itself done on an
atomic counter of its tile; the program that counts last combines the chunks (forward: by their
log-sum-exp; gradients: by summing, in chunk order, so results do not depend on which program is last),
writes the result where an unsplit program would, and resets the counter for the next launch. No second
launch, and no atomics on the results themselves.

Scratch slots exist per split list and per *copy*: a mask shared by several batch entries or heads is
walked once per (batch, head) that uses it. The scratch is allocated per call; the counters once per launch
plan and stream (each launch leaves them at zero).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...mask_index import MaskGeometry, WorkPlan
from ..memory import new_output
from .common import ITEM_CHUNK, ITEM_CHUNKS
from .configs import MIN_TILE, block_d


class SplitPlan:
    """Launch parameters of the split lists of one kernel launch, and their scratch buffers.

    Args:
        device: where the scratch lives.
        plan: the mask's `WorkPlan` of the lists the launch walks, or None for the dense path (nothing split,
            no items).
        batch, heads: of the tensor the launch writes (query heads for rows, KV heads for columns).
        geometry: the mask's `MaskGeometry` (None for the dense path).
        head_dim: D.
        along: "rows" (the plan walks row lists: blocks of block_q) or "cols" (column lists: block_k).
        parts: number of partial tensors per slot (1 for out or dQ, 2 for dK and dV).
        with_lse: also keep a log-sum-exp per row (the forward).
    """

    def __init__(self, device, plan: WorkPlan | None = None, batch=1, heads=1, geometry: MaskGeometry | None = None,
                 head_dim=1, *, along="rows", parts=1, with_lse=False):
        items, split, slot_list = (None, None, None) if plan is None else (plan.items, plan.split, plan.slot_list)
        mask_batch, mask_heads = (1, 1) if geometry is None else (geometry.batch, geometry.heads)
        mask_block = 1 if geometry is None else geometry.block_q if along == "rows" else geometry.block_k
        self.device = device
        self.dummy = placeholder(device, torch.int32)
        self.num_split = 0 if split is None else split.shape[0]
        self.item_strides = (0, 0) if items is None else (
            items.stride(0) if mask_batch > 1 else 0, items.stride(1) if mask_heads > 1 else 0)
        # copy index of (b, h) = b * copy_stride_b + h * copy_stride_h: one copy per (batch, head) sharing
        # the mask's layout
        self.head_copies = heads if mask_heads == 1 else 1
        self.copies = (batch if mask_batch == 1 else 1) * self.head_copies
        self.copy_strides = (self.head_copies if mask_batch == 1 else 0, 1 if mask_heads == 1 else 0)
        self.mask_batch, self.mask_heads, self.mask_block = mask_batch, mask_heads, mask_block
        self.num_parts, self.with_lse = parts, with_lse
        self.rows = 0 if not self.num_split else slot_list.shape[0] * self.copies * mask_block
        self.width = block_d(head_dim)
        self._counters: dict = {}  # per stream: launches on different streams must not share counts

    def scratch(self) -> tuple:
        """`(part_0, part_1, lse_part)` for one launch: new buffers where lists are split (part_1 is part_0
        when the launch keeps one part, lse_part is part_0 when it keeps no lse), placeholders otherwise,
        which keep the kernels' signatures and are never touched."""
        if not self.num_split:
            empty = placeholder(self.device, torch.float32)
            return empty, empty, empty
        parts = [new_output((self.rows, self.width), torch.float32, self.device) for _ in range(self.num_parts)]
        lse_part = new_output((self.rows,), torch.float32, self.device) if self.with_lse else parts[0]
        return parts[0], parts[-1], lse_part

    def counters(self) -> torch.Tensor:
        """int32 chunk counters, one per (split list, copy, tile of a mask block) for the current stream: zero
        before a launch and after it (the last chunk of each tile resets its counter); a placeholder where
        nothing is split."""
        if not self.num_split:
            return self.dummy
        key = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else None
        counters = self._counters.get(key)
        if counters is None:
            counters = self._counters[key] = torch.zeros(self.rows // MIN_TILE, dtype=torch.int32, device=self.device)
        return counters


_PLACEHOLDERS: dict = {}


def placeholder(device, dtype: torch.dtype) -> torch.Tensor:
    """A tiny tensor, allocated once per device and dtype, for pointer arguments a launch never touches."""
    key = (device, dtype)
    t = _PLACEHOLDERS.get(key)
    if t is None:
        t = _PLACEHOLDERS[key] = torch.zeros(2, dtype=dtype, device=device)
    return t


@triton.jit
def chunk_rows(slot, copies, copy, tile, MASK_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """Scratch rows (BLOCK,) of a program's tile (tile `tile % (MASK_BLOCK // BLOCK)` of its mask block) in
    chunk slot `slot`, copy `copy`. Slot order: (slot, copy), then the mask block's rows."""
    SUB: tl.constexpr = MASK_BLOCK // BLOCK
    return (slot * copies + copy).to(tl.int64) * MASK_BLOCK + (tile % SUB) * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def last_chunk(Counters, item, slot, copies, copy, tile, MASK_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """Count this program's chunk of a split list as done, once its partial result is stored.

    Returns (last, first slot of the list, number of chunks): `last` is true in the one program that counts
    the tile's last chunk; it then reads every chunk's partial result (`sum_chunks`, `merge_chunks`) and
    writes the tile. The count is released after every thread's stores (barrier, then an acq_rel atomic at
    GPU scope) and acquired before the last program reads; that program resets the counter to 0.
    """
    SUB: tl.constexpr = MASK_BLOCK // BLOCK
    first = slot - tl.load(item + ITEM_CHUNK)
    num_chunks = tl.load(item + ITEM_CHUNKS)
    counter = Counters + (first * copies + copy) * SUB + tile % SUB
    tl.debug_barrier()  # the partial result of every thread is stored before the count
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_chunks - 1
    tl.store(counter, 0, mask=last)
    return last, first, num_chunks


MERGE_ROWS = tl.constexpr(16)  # rows combined at a time: the merge must not add to the kernels' register peak


@triton.jit
def store_chunk_sum(Dst, stride_r, start_r, limit_r, Part, first, num_chunks, copies, copy, tile,
                    MASK_BLOCK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Write the sum, in chunk order, of a tile's partial results (slots first, first + 1, ...) to rows
    [start_r, start_r + BLOCK) of Dst (those below limit_r), MERGE_ROWS rows at a time."""
    SUB: tl.constexpr = MASK_BLOCK // BLOCK
    offs_p = tl.arange(0, MERGE_ROWS)  # (MERGE_ROWS,)
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    for r in tl.static_range(0, BLOCK, MERGE_ROWS):
        acc = tl.zeros([MERGE_ROWS, BLOCK_D], dtype=tl.float32)
        for c in range(0, num_chunks):
            base = ((first + c) * copies + copy).to(tl.int64) * MASK_BLOCK + (tile % SUB) * BLOCK + r  # scratch row
            acc += tl.load(Part + (base + offs_p)[:, None] * BLOCK_D + offs_d[None, :], cache_modifier=".cg")  # L2
        rows = start_r + r + offs_p  # (MERGE_ROWS,)
        tl.store(Dst + rows[:, None] * stride_r + offs_d[None, :], acc.to(Dst.dtype.element_ty),
                 mask=(rows < limit_r)[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit
def store_chunk_merge(Dst, stride_r, DstLse, start_r, limit_r, Part, LsePart, first, num_chunks, copies, copy, tile,
                      MASK_BLOCK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The forward's `store_chunk_sum`: chunks (normalised output, natural-log lse) combined by their
    log-sum-exp into Dst and DstLse. A row empty in every chunk gets output 0 and lse -inf."""
    SUB: tl.constexpr = MASK_BLOCK // BLOCK
    offs_p = tl.arange(0, MERGE_ROWS)  # (MERGE_ROWS,)
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    for r in tl.static_range(0, BLOCK, MERGE_ROWS):
        first_row = (tile % SUB) * BLOCK + r
        m = tl.full([MERGE_ROWS], float("-inf"), dtype=tl.float32)
        for c in range(0, num_chunks):
            base = ((first + c) * copies + copy).to(tl.int64) * MASK_BLOCK + first_row
            m = tl.maximum(m, tl.load(LsePart + base + offs_p, cache_modifier=".cg"))
        m_use = tl.where(m == float("-inf"), 0.0, m)  # a row empty in every chunk stays at weight 0
        acc = tl.zeros([MERGE_ROWS, BLOCK_D], dtype=tl.float32)
        total = tl.zeros([MERGE_ROWS], dtype=tl.float32)
        for c in range(0, num_chunks):
            base = ((first + c) * copies + copy).to(tl.int64) * MASK_BLOCK + first_row
            w = tl.exp(tl.load(LsePart + base + offs_p, cache_modifier=".cg") - m_use)  # (MERGE_ROWS,)
            acc += w[:, None] * tl.load(Part + (base + offs_p)[:, None] * BLOCK_D + offs_d[None, :],
                                        cache_modifier=".cg")
            total += w
        empty = total == 0.0
        rows = start_r + r + offs_p  # (MERGE_ROWS,)
        ok = rows < limit_r
        tl.store(Dst + rows[:, None] * stride_r + offs_d[None, :],
                 (acc / tl.where(empty, 1.0, total)[:, None]).to(Dst.dtype.element_ty),
                 mask=ok[:, None] & (offs_d < HEAD_DIM)[None, :])
        tl.store(DstLse + rows, tl.where(empty, float("-inf"), m_use + tl.log(tl.where(empty, 1.0, total))), mask=ok)

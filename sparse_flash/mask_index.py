"""The index lists and work plans of a block mask: what the kernels walk, and which program walks what.

Built from a `BlockMask`'s layout once, when the mask is made (torch only, no kernel code): for each query
block the sorted key blocks of its row, and for each key block the sorted query blocks of its column, in
compressed (CSR) form so that they take memory proportional to the number of nonzero blocks, split into full
blocks (no element mask needed) and partial ones (causal diagonal, sequence tails); and the work plans that
say which program walks which list, or which chunk of a list much longer than the others.

This module holds the one scheduling policy of the lists (the `SPLIT_*`, `HEAVY_FACTOR` and
`LONG_LIST_BLOCKS` constants) and the records that carry a mask to the kernels (`MaskGeometry`,
`KernelIndex`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["BlockIndex", "KernelIndex", "MaskGeometry", "MaskIndex", "WorkPlan", "build_index"]

# The int32 fields of one work item (`WorkPlan.items`): everything a program needs to start walking its share of
# a list, read in one round trip. [lo, hi) ranges index the full and the partial lists; `*_first` is the first
# block of that range (0 when it is empty); `slot` is the scratch slot of a chunk of a split list (-1: the list
# is not split, so the program writes its result directly).
ITEM_FIELDS = ("block", "chunk", "chunks", "slot", "full_lo", "full_hi", "part_lo", "part_hi", "full_first",
               "part_first")

class BlockIndex(NamedTuple):
    """Compressed index lists of a block layout, one list per row.

    Attributes:
        counts: int32 `(B|1, H|1, M)`: number of nonzero blocks in each row.
        offsets: int32 `(B|1 * H|1 * M + 1,)`: row r's entries are `indices[offsets[r]:offsets[r + 1]]`,
            with rows numbered `(b * H + h) * M + i`.
        indices: int32 `(nnz,)`: the block indices of each row, sorted ascending.
    """

    counts: torch.Tensor
    offsets: torch.Tensor
    indices: torch.Tensor


class WorkPlan(NamedTuple):
    """Which program walks which part of each list, so that no single long list sets the running time.

    A list longer than max(SPLIT_MIN_CHUNK, SPLIT_FACTOR x the mean length) blocks (a global row or
    column) is cut into `ceil(length / chunk)` nearly equal chunks, at most SPLIT_MAX_CHUNKS, each walked
    by its own program into a scratch slot; the list's last chunk to finish combines the slots. Programs
    start longest chunk first within each (batch, head). The first `lead` ranks of every head hold its heavy items (longer than
    HEAVY_FACTOR x the mean list length): the kernels start those of all heads together, before running
    the rest head group by head group.

    Attributes:
        items: int32 `(B|1, H|1, W, len(ITEM_FIELDS))`: what program rank w walks: its (block, chunk), the
            list's number of chunks, its scratch slot and its ranges of the full and partial lists
            (`ITEM_FIELDS`); block -1 pads heads with fewer items (their ranges are empty).
        chunks: int32 `(B|1 * H|1 * M,)`: number of chunks of each list (1: not split).
        slots: int32 `(B|1 * H|1 * M,)`: first scratch slot of a split list (-1: not split).
        lead: int32 `(1,)`: the number of leading ranks that hold a heavy item in some head.
        split: int32 `(S,)`: the flat numbers `(b * H + h) * M + i` of the split lists.
        slot_list: int32 `(num_slots,)`: the list each scratch slot belongs to.
    """

    items: torch.Tensor
    chunks: torch.Tensor
    slots: torch.Tensor
    lead: torch.Tensor
    split: torch.Tensor
    slot_list: torch.Tensor


class KernelIndex(NamedTuple):
    """The index lists one attention call walks, split into full and partial blocks.

    A *partial* block needs an element mask (it touches the causal diagonal or a sequence tail); a *full*
    block does not. Blocks lying entirely above the causal diagonal are dropped. Row lists (by query block)
    serve the forward and dQ passes, column lists (by key block) the dK/dV pass.
    """

    row_full: BlockIndex
    row_partial: BlockIndex
    col_full: BlockIndex
    col_partial: BlockIndex
    row_plan: WorkPlan  # programs over query blocks (forward, dQ)
    col_plan: WorkPlan  # programs over key blocks (dK/dV)

    def nbytes(self) -> int:
        """Device memory held by these lists and plans."""
        return sum(t.numel() * t.element_size() for part in self for t in part)


class MaskGeometry(NamedTuple):
    """The sizes of a mask that the kernels need, with the index lists of one call (`KernelIndex`).

    Attributes:
        batch, heads: the layout's batch and head sizes (1 broadcasts).
        blocks_q, blocks_k: blocks along the query and key sides (`Mq`, `Mk`).
        block_q, block_k: the block size in tokens.
        long_lists: rows of this call average `LONG_LIST_BLOCKS` live blocks or more (wider kernel tiles).
    """

    batch: int
    heads: int
    blocks_q: int
    blocks_k: int
    block_q: int
    block_k: int
    long_lists: bool


def _unbacked(*tensor_dims) -> None:
    """For each (tensor, dim): masks of one geometry differ in these sizes (their number of nonzero blocks,
    of split lists). torch.compile treats such a size as one it never specialises (not even to 0 or 1), so
    a new mask reuses the compiled graph."""
    if not torch.compiler.is_compiling():
        from torch._dynamo.decorators import mark_unbacked

        for t, dim in tensor_dims:
            mark_unbacked(t, dim)


FULL, PARTIAL, DEAD = 0, 1, 2  # what a nonzero block is for one causal flag: no element mask needed, one
# needed (causal diagonal, sequence tail), or no allowed pair at all (above the causal diagonal)


def _class_lists(keys: torch.Tensor, values: torch.Tensor, cls: torch.Tensor, sizes: tuple[int, int],
                 shape: tuple[int, int, int]) -> tuple[BlockIndex, BlockIndex, BlockIndex]:
    """The live, full and partial index lists of entries sorted by (list, value).

    `keys` numbers each entry's list (`(b * H + h) * M + i` for `shape` (B, H, M)), `values` holds its block
    index and `cls` its class (FULL, PARTIAL or DEAD); `sizes` are the numbers of FULL and PARTIAL entries,
    known on the host, so that nothing here waits for the device.
    """
    n_full, n_part = sizes
    lists = math.prod(shape)
    full_count, part_count = torch.bincount(cls * lists + keys, minlength=3 * lists)[: 2 * lists].view(2, lists)
    # A stable sort keeps the (list, value) order within each class: full entries, then partial, then dead.
    sorted_values = values[torch.argsort(cls, stable=True)].to(torch.int32)
    if n_full + n_part == values.numel():
        live = values.to(torch.int32)
    else:
        live = values[torch.argsort((cls == DEAD).to(torch.uint8), stable=True)[: n_full + n_part]].to(torch.int32)
    # Separate tensors, none a view of another: torch.compile guards on how its inputs alias, and the slices'
    # offsets differ from mask to mask.
    lists_of = []
    for count, indices in ((full_count + part_count, live), (full_count, sorted_values[:n_full].clone()),
                           (part_count, sorted_values[n_full:n_full + n_part].clone())):
        offsets = torch.zeros(lists + 1, dtype=torch.int32, device=keys.device)
        torch.cumsum(count, dim=0, out=offsets[1:])
        _unbacked((indices, 0))
        lists_of.append(BlockIndex(count.to(torch.int32).reshape(shape), offsets, indices))
    return tuple(lists_of)


SPLIT_MIN_CHUNK = 32  # lists up to this many blocks are never split
SPLIT_FACTOR = 4  # ... nor lists up to this many times the mean length
SPLIT_MAX_CHUNKS = 64  # more chunks add scratch memory but no parallelism that a GPU could use
HEAVY_FACTOR = 2  # items longer than this many times the mean list length start first in every head
LONG_LIST_BLOCKS = 16  # rows averaging this many live blocks or more count as long (kernels pick wider tiles)


def _item_ranges(lists, chunk_id, n, full: BlockIndex, part: BlockIndex) -> list[torch.Tensor]:
    """Per item: its ranges of the full and partial lists (chunk c of n takes positions [c·L//n, (c+1)·L//n)
    of a list's L blocks, full blocks first) and the first block of each range."""
    n_full = full.counts.reshape(-1)[lists].long()
    length = n_full + part.counts.reshape(-1)[lists].long()
    start, end = chunk_id * length // n, (chunk_id + 1) * length // n
    full_off, part_off = full.offsets[lists].long(), part.offsets[lists].long()
    full_lo, full_hi = full_off + torch.clamp(start, max=n_full), full_off + torch.clamp(end, max=n_full)
    part_lo, part_hi = part_off + torch.clamp(start - n_full, min=0), part_off + torch.clamp(end - n_full, min=0)

    def first(index, lo, hi):
        if index.indices.numel() == 0:
            return torch.zeros_like(lo)
        return torch.where(hi > lo, index.indices[torch.clamp(lo, max=index.indices.numel() - 1)].long(), 0)

    return [full_lo, full_hi, part_lo, part_hi, first(full, full_lo, full_hi), first(part, part_lo, part_hi)]


def _plan_work(counts: torch.Tensor, chunk: int, mean: float, full: BlockIndex,
               part: BlockIndex) -> tuple[WorkPlan, int]:
    """Programs for lists of `counts` (B, H, M) blocks (`mean` long on average; `full` and `part` are the
    lists' full and partial blocks): lists longer than `chunk` split, longest first. Also returns the length
    of the longest list."""
    B, H, M = counts.shape
    flat = counts.reshape(-1).long()
    n = torch.where(flat > chunk, torch.clamp((flat + chunk - 1) // chunk, max=SPLIT_MAX_CHUNKS), 1)  # chunks per list
    is_split = n > 1
    # The sizes below, fetched from the device together: items, the most items of one (b, h), split lists, slots
    num_items, width, num_split, num_slots, longest = torch.stack(
        [n.sum(), n.view(B * H, M).sum(1).max(), is_split.sum(), (n * is_split).sum(), flat.max()]).tolist()
    lists = torch.repeat_interleave(torch.arange(flat.numel(), device=flat.device), n, output_size=num_items)
    starts = torch.cumsum(n, 0) - n
    chunk_id = torch.arange(lists.numel(), device=flat.device) - starts[lists]
    length = flat[lists] // n[lists]  # every chunk of a list has this length or one more
    bh = lists // M
    by_head = torch.argsort(bh * (1 << 32) - length, stable=True)  # by (b, h), longest first within
    per_head = torch.bincount(bh, minlength=B * H)
    rank = torch.arange(lists.numel(), device=flat.device) - (torch.cumsum(per_head, 0) - per_head)[bh[by_head]]
    heavy_bh = torch.where(length > HEAVY_FACTOR * mean, bh, B * H)  # light items count in a bin past the end
    lead = torch.bincount(heavy_bh, minlength=B * H + 1)[: B * H].max().reshape(1).to(torch.int32)
    split = torch.argsort((~is_split).to(torch.uint8), stable=True)[:num_split]  # the split lists, in order
    slots = torch.full_like(flat, -1)
    slots[split] = torch.cumsum(n[split], 0) - n[split]
    fields = [lists % M, chunk_id, n[lists], torch.where(n[lists] > 1, slots[lists] + chunk_id, -1),
              *_item_ranges(lists, chunk_id, n[lists], full, part)]
    items = torch.zeros((B * H, width, len(ITEM_FIELDS)), dtype=torch.int32, device=flat.device)
    items[..., [ITEM_FIELDS.index("block"), ITEM_FIELDS.index("slot")]] = -1  # padding: no block, no slot
    items[bh[by_head], rank] = torch.stack(fields, 1)[by_head].to(torch.int32)
    slot_list = torch.repeat_interleave(split, n[split], output_size=num_slots).to(torch.int32)
    plan = WorkPlan(items.reshape(B, H, -1, len(ITEM_FIELDS)), n.to(torch.int32), slots.to(torch.int32), lead,
                    split.to(torch.int32), slot_list)
    _unbacked((plan.items, 2), (plan.split, 0), (plan.slot_list, 0))
    return plan, longest


def _causal_blocks(Mq: int, Mk: int, bq: int, bk: int, seq_len_q: int) -> int:
    """Blocks of a full Mq x Mk layout that hold a causal pair (key <= query): per query block i, the key
    blocks starting at or before its last query."""
    q_last = torch.clamp(torch.arange(1, Mq + 1) * bq, max=seq_len_q) - 1
    return int(torch.clamp(q_last // bk + 1, max=Mk).sum())


def _chunk_size(total: int, num_lists: int) -> int:
    """The split threshold of lists: max(SPLIT_MIN_CHUNK, SPLIT_FACTOR x their mean length)."""
    return max(SPLIT_MIN_CHUNK, math.ceil(SPLIT_FACTOR * total / num_lists))


@dataclass(frozen=True)
class MaskIndex:
    """Everything derived from a layout for the kernels and the torch backend, per causal flag.

    Attributes:
        nnz: nonzero blocks of the layout.
        is_dense: every block is on (the kernels' dense path loads no index).
        covers_causal: every block holding a causal pair is on (with `causal=True`, the dense causal path).
        rows, cols: per causal flag, the live row (column) lists, `BlockIndex`.
        kernel: per causal flag, the full/partial lists and work plans, `KernelIndex`.
        long_lists: per causal flag, whether rows average `LONG_LIST_BLOCKS` live blocks or more.
        longest_row: per causal flag, the most live key blocks of one row.
    Python ints and bools, so that torch.compile guards on them rather than on tensor data.
    """

    nnz: int
    is_dense: bool
    covers_causal: bool
    rows: dict
    cols: dict
    kernel: dict
    long_lists: dict
    longest_row: dict


def build_index(layout: torch.Tensor, block_size: tuple[int, int], seq_len_q: int, seq_len_k: int) -> MaskIndex:
    """Every index list of a bool layout `(B, H, Mq, Mk)`, from one pass over it; the rest costs O(nnz).

    Built eagerly (when a mask is made) so that attention calls inside `torch.compile` only read them. On a GPU
    the host waits for the device six times: for the nonzero blocks, for the class sizes of both causal flags,
    and once per work plan; every other size is known on the host.
    """
    B, H, Mq, Mk = layout.shape
    bq, bk = block_size
    coords = layout.nonzero()  # (nnz, 4), row-major order: sorted by (b, h, i, j)
    nnz = coords.shape[0]
    b, h, i, j = coords.T.contiguous().unbind(0)
    row = (b * H + h) * Mq + i
    col = (b * H + h) * Mk + j
    q_first, k_first = i * bq, j * bk
    q_last = torch.clamp(q_first + bq, max=seq_len_q) - 1
    k_last = torch.clamp(k_first + bk, max=seq_len_k) - 1
    # A block touching a sequence tail needs bounds masks on its loads and scores.
    tail = (q_first + bq > seq_len_q) | (k_first + bk > seq_len_k)
    rows, cols, kernel, long_lists, longest_row = {}, {}, {}, {}, {}
    by_col = torch.argsort(col * Mq + i)  # the same entries sorted by (b, h, j, i)
    classes = {}  # each entry's class, per causal flag
    for causal in (False, True):
        cls = torch.where(tail | (k_last > q_first), PARTIAL, FULL) if causal else torch.where(tail, PARTIAL, FULL)
        classes[causal] = torch.where(k_first <= q_last, cls, DEAD) if causal else cls
    # The class sizes of both flags, fetched from the device at once: (full, partial) per flag
    sizes = torch.stack([(c == k).sum() for c in classes.values() for k in (FULL, PARTIAL)]).tolist()
    covers_causal = False
    for causal, cls in classes.items():
        n_full, n_part = sizes[2 * causal:2 * causal + 2]
        rows_live, row_full, row_part = _class_lists(row, j, cls, (n_full, n_part), (B, H, Mq))
        cols_live, col_full, col_part = _class_lists(col[by_col], i[by_col], cls[by_col], (n_full, n_part),
                                                     (B, H, Mk))
        rows[causal], cols[causal] = rows_live, cols_live
        total = n_full + n_part  # live blocks: the total length of the row lists, and of the column lists
        row_chunk, col_chunk = _chunk_size(total, B * H * Mq), _chunk_size(total, B * H * Mk)
        long_lists[causal] = total >= LONG_LIST_BLOCKS * B * H * Mq
        if causal:
            covers_causal = total == B * H * _causal_blocks(Mq, Mk, bq, bk, seq_len_q)
        row_plan, longest_row[causal] = _plan_work(rows_live.counts, row_chunk, total / (B * H * Mq), row_full,
                                                   row_part)
        col_plan, _ = _plan_work(cols_live.counts, col_chunk, total / (B * H * Mk), col_full, col_part)
        kernel[causal] = KernelIndex(row_full, row_part, col_full, col_part, row_plan, col_plan)
    return MaskIndex(nnz, nnz == layout.numel(), covers_causal, rows, cols, kernel, long_lists, longest_row)

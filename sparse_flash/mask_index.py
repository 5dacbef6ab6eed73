"""The index lists and work plans of a block mask: what the kernels walk, and which program walks what.

Built from a `BlockMask`'s layout once, when the mask is made (torch operators; on a CUDA device the lists of a
top-k mask and the plans of unsplit lists come from `index_gpu`'s Triton launches, the same values): for each query
block the sorted key blocks of its row, and for each key block the sorted query blocks of its column, in
compressed (CSR) form so that they take memory proportional to the number of nonzero blocks, split into full
blocks (no element mask needed) and partial ones (causal diagonal, sequence tails); and the work plans that
say which program walks which list, or which chunk of a list much longer than the others.

This module holds the one scheduling policy of the lists (the `SPLIT_*`, `HEAVY_FACTOR` and
`LONG_LIST_BLOCKS` constants) and the records that carry a mask to the kernels (`MaskGeometry`,
`KernelIndex`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["BlockIndex", "BlockRuns", "KernelIndex", "MaskGeometry", "MaskIndex", "WorkPlan", "build_index", "build_topk_index"]

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


def _bin_counts(values: torch.Tensor, bins: int) -> torch.Tensor:
    """int64 `(bins,)`: how often each of `0 .. bins - 1` occurs in `values` (`torch.bincount` with `minlength`,
    which on a GPU waits for the device to read the largest value)."""
    counts = torch.zeros(bins, dtype=torch.int64, device=values.device)
    return counts.scatter_add_(0, values.long(), torch.ones_like(values, dtype=torch.int64))


FULL, PARTIAL, DEAD = 0, 1, 2  # what a nonzero block is for one causal flag: no element mask needed, one
# needed (causal diagonal, sequence tail), or no allowed pair at all (above the causal diagonal)


def _class_lists(keys: torch.Tensor, values: torch.Tensor, cls: torch.Tensor, sizes: list[tuple[int, int]],
                 shapes: list[tuple[int, int, int]]) -> list[tuple[BlockIndex, BlockIndex, BlockIndex]]:
    """The live, full and partial index lists of several sets of lists side by side.

    Set s holds the lists `base[s] ..` of `shapes[s]` (B, H, M); `keys` numbers each entry's list within all sets
    (set s's base plus `(b * H + h) * M + i`), `values` holds its block index and `cls` its class (FULL, PARTIAL
    or DEAD); entries are sorted by (key, value). `sizes` are the numbers of FULL and PARTIAL entries of each set,
    known on the host, so that nothing here waits for the device.
    """
    device = keys.device
    base = [0]
    for shape in shapes:
        base.append(base[-1] + math.prod(shape))
    lists = base[-1]
    full_count, part_count = _bin_counts(cls * lists + keys, 3 * lists)[: 2 * lists].view(2, lists)
    # A stable sort keeps the (key, value) order within each class: every set's full entries (set by set, as the
    # keys are), then every set's partial ones, then the dead ones.
    sorted_values = values[torch.argsort(cls, stable=True)]
    n_full, n_part = sum(f for f, _ in sizes), sum(p for _, p in sizes)
    if n_full + n_part == values.numel():
        live = values
    else:
        live = values[torch.argsort((cls == DEAD).to(torch.uint8), stable=True)[: n_full + n_part]]
    starts = {"live": [0], "full": [0], "part": [n_full]}  # where each set's entries start in `live`, `sorted_values`
    for f, p in sizes:
        starts["live"].append(starts["live"][-1] + f + p)
        starts["full"].append(starts["full"][-1] + f)
        starts["part"].append(starts["part"][-1] + p)
    out = []
    for kind, count, entries in (("live", full_count + part_count, live), ("full", full_count, sorted_values),
                                 ("part", part_count, sorted_values)):
        ends = torch.zeros(lists + 1, dtype=torch.int32, device=device)
        torch.cumsum(count, dim=0, out=ends[1:])
        per_set = []
        for s, shape in enumerate(shapes):  # separate tensors, none a view of another (torch.compile guards on
            # how its inputs alias, and the slices' offsets differ from mask to mask)
            indices = entries[starts[kind][s]:starts[kind][s + 1]].to(torch.int32, copy=True)
            offsets = ends[base[s]:base[s + 1] + 1] - ends[base[s]]
            _unbacked((indices, 0))
            per_set.append(BlockIndex(count[base[s]:base[s + 1]].to(torch.int32, copy=True).reshape(shape), offsets,
                                      indices))
        out.append(per_set)
    return list(zip(*out))


SPLIT_MIN_CHUNK = 32  # lists up to this many blocks are never split
SPLIT_FACTOR = 4  # ... nor lists up to this many times the mean length
SPLIT_MAX_CHUNKS = 64  # more chunks add scratch memory but no parallelism that a GPU could use
HEAVY_FACTOR = 2  # items longer than this many times the mean list length start first in every head
LONG_LIST_BLOCKS = 16  # rows averaging this many live blocks or more count as long (kernels pick wider tiles)


class _PlanInput(NamedTuple):
    """One work plan to build: the lists' live counts `(B, H, M)`, their split threshold in blocks (`_chunk_size`)
    and mean length, and their full and partial `BlockIndex`."""

    counts: torch.Tensor
    chunk: int
    mean: float
    full: BlockIndex
    part: BlockIndex


class _PlanBatch(NamedTuple):
    """The lists of several work plans side by side, plan p's at `[base[p], base[p + 1])`: per list its plan,
    its length and its chunks (int64 `(L,)` each), and the host numbers of the layout."""

    plans: tuple[_PlanInput, ...]
    base: tuple[int, ...]  # host: the first list of each plan, and the total
    which: list[torch.Tensor]  # per plan p >= 1, bool `(L,)`: the list belongs to plan p or a later one
    flat: torch.Tensor
    n: torch.Tensor
    plan: torch.Tensor  # the plan of each list
    local: torch.Tensor  # its number within its plan
    M: torch.Tensor  # its plan's lists per (b, h)


def _per_list(batch: _PlanBatch, values) -> torch.Tensor:
    """`values[plan of each list]`, `(L,)`, by `where` on host numbers (a table copied to the device would wait
    for it, and its host memory would be read again by every replay of a captured CUDA graph)."""
    out = torch.full_like(batch.flat, values[0], dtype=torch.float32 if isinstance(values[0], float) else torch.int64)
    for later, value in zip(batch.which, values[1:]):
        out = torch.where(later, value, out)
    return out


def _plan_batch(plans: list[_PlanInput], split: bool = True) -> _PlanBatch:
    """The lists of several work plans side by side, each cut into chunks when longer than its plan's `chunk`
    (with `split=False` none is: every size is then known on the host)."""
    base = [0]
    for plan in plans:
        base.append(base[-1] + plan.counts.numel())
    flat = torch.cat([plan.counts.reshape(-1) for plan in plans]).long()
    g = torch.arange(base[-1], device=flat.device)
    batch = _PlanBatch(tuple(plans), tuple(base), [g >= b for b in base[1:-1]], flat, torch.ones_like(flat), g, g, g)
    batch = batch._replace(plan=_per_list(batch, list(range(len(plans)))), local=g - _per_list(batch, base[:-1]),
                           M=_per_list(batch, [plan.counts.shape[-1] for plan in plans]))
    if not split:
        return batch
    chunk = _per_list(batch, [plan.chunk for plan in plans])
    n = torch.where(flat > chunk, torch.clamp((flat + chunk - 1) // chunk, max=SPLIT_MAX_CHUNKS), 1)  # chunks per list
    return batch._replace(n=n)


def _plan_sizes(batch: _PlanBatch) -> torch.Tensor:
    """Still on the device, int64 `(P, 5)`: each plan's sizes (items, the most items of one (b, h), split lists,
    scratch slots) and its longest list. The caller reads the sizes of every plan at once."""
    P, (B, H) = len(batch.plans), batch.plans[0].counts.shape[:2]
    flat, n, plan_of = batch.flat, batch.n, batch.plan
    head = plan_of * (B * H) + batch.local // batch.M
    is_split = n > 1

    def by_plan(values, reduce="sum"):
        return torch.zeros(P, dtype=torch.int64, device=flat.device).scatter_reduce_(0, plan_of, values, reduce)

    per_head = torch.zeros(P * B * H, dtype=torch.int64, device=flat.device).scatter_add_(0, head, n)
    return torch.stack([by_plan(n), per_head.view(P, B * H).amax(1), by_plan(is_split.long()),
                        by_plan(n * is_split), by_plan(flat, "amax")], 1)


def _plan_items(batch: _PlanBatch, sizes: list[list[int]]) -> list[WorkPlan]:
    """The work plans of a batch (`_plan_batch`), given each plan's sizes on the host (`_plan_sizes`): `(items,
    the most items of one (b, h), split lists, scratch slots)`. Nothing here waits for the device.

    Every plan follows one policy: items ordered by (b, h), longest first within; the first `lead` ranks of
    every head hold its heavy items (longer than HEAVY_FACTOR x the plan's mean list length); chunk c of n takes
    positions [c·L//n, (c+1)·L//n) of a list's L blocks, full blocks first.
    """
    plans, base, flat, n = batch.plans, batch.base, batch.flat, batch.n
    P = len(plans)
    B, H = plans[0].counts.shape[:2]
    device = flat.device
    num_items, widths, num_split, num_slots = (list(column) for column in zip(*[size[:4] for size in sizes]))
    item_base, slot_base = [0], [0]
    for p in range(P):
        item_base.append(item_base[-1] + num_items[p])
        slot_base.append(slot_base[-1] + num_slots[p])
    cut = sum(num_split) > 0  # some list is cut into chunks (else each item is a whole list, in list order)
    if cut:
        lists = torch.repeat_interleave(torch.arange(base[-1], device=device), n, output_size=item_base[-1])
        starts = torch.cumsum(n, 0) - n
        chunk_id = torch.arange(lists.numel(), device=device) - starts[lists]
        n_item = n[lists]
        length = flat[lists] // n_item  # every chunk of a list has this length or one more
        local, M, plan_of = batch.local[lists], batch.M[lists], batch.plan[lists]
    else:  # the gathers by item would copy each per-list value as it is
        lists, chunk_id, n_item, length = None, torch.zeros_like(flat), n, flat
        local, M, plan_of = batch.local, batch.M, batch.plan
    # local: the list's number in its plan; M: its plan's lists per (b, h)
    head = plan_of * (B * H) + local // M  # (plan, b, h)
    # by (plan, b, h), longest first within: two stable sorts of small keys (inductor has narrowed a composite
    # int64 key such as bh * 2**32 - length to int32 on the GPU, which scrambled the order)
    longest_first = torch.argsort(-length, stable=True)
    by_head = longest_first[torch.argsort(head[longest_first], stable=True)]
    per_head = _bin_counts(head, P * B * H)
    rank = torch.arange(head.numel(), device=device) - (torch.cumsum(per_head, 0) - per_head)[head[by_head]]
    threshold = _per_list(batch, [HEAVY_FACTOR * plan.mean for plan in plans])
    threshold = threshold[lists] if cut else threshold
    heavy = torch.where(length > threshold, head, P * B * H)  # light items count in a bin past the end
    lead = _bin_counts(heavy, P * B * H + 1)[: P * B * H].view(P, B * H).amax(1).to(torch.int32)
    slots = torch.full_like(flat, -1)
    if cut:
        is_split = n > 1
        split = torch.argsort((~is_split).to(torch.uint8), stable=True)[: sum(num_split)]  # the split lists, in order
        first_slot = torch.cumsum(n[split], 0) - n[split] - _per_list(batch, slot_base[:-1])[split]  # in its plan
        slots[split] = first_slot
        slot = torch.where(n_item > 1, slots[lists] + chunk_id, -1)
    else:
        slot = slots
    fields = [local % M, chunk_id, n_item, slot, *_item_ranges(batch, lists, chunk_id, n_item)]
    width = max(widths)
    items = torch.zeros((P * B * H, width, len(ITEM_FIELDS)), dtype=torch.int32, device=device)
    for field in ("block", "slot"):  # padding: no block, no slot (one fill each: a list index would be copied to
        items[..., ITEM_FIELDS.index(field)] = -1  # the device, which waits for it)
    items[head[by_head], rank] = torch.stack(fields, 1)[by_head].to(torch.int32)
    if cut:
        local_split = batch.local[split].to(torch.int32)
        slot_list = torch.repeat_interleave(local_split, n[split], output_size=slot_base[-1])
    else:  # no split list, no scratch slot
        local_split = slot_list = torch.zeros(0, dtype=torch.int32, device=device)
    chunks, slots = n.to(torch.int32), slots.to(torch.int32)
    out = []
    split_base = [sum(num_split[:p]) for p in range(P + 1)]
    for p in range(P):  # separate tensors, none a view of another (torch.compile guards on how inputs alias)
        plan = WorkPlan(items[p * B * H:(p + 1) * B * H, : widths[p]].reshape(B, H, widths[p], -1).clone(),
                        chunks[base[p]:base[p + 1]].clone(), slots[base[p]:base[p + 1]].clone(), lead[p:p + 1].clone(),
                        local_split[split_base[p]:split_base[p + 1]].clone(),
                        slot_list[slot_base[p]:slot_base[p + 1]].clone())
        _unbacked((plan.items, 2), (plan.split, 0), (plan.slot_list, 0))
        out.append(plan)
    return out


def _item_ranges(batch: _PlanBatch, lists, chunk_id, n) -> list[torch.Tensor]:
    """Per item: its ranges of its plan's full and partial lists (chunk c of n takes positions [c·L//n,
    (c+1)·L//n) of a list's L blocks, full blocks first) and the first block of each range. `lists` None:
    every item is a whole list, in list order."""
    ranges = []
    for kind in ("full", "part"):
        index = [getattr(plan, kind) for plan in batch.plans]
        counts = torch.cat([i.counts.reshape(-1) for i in index])
        offsets = torch.cat([i.offsets[:-1] for i in index])
        if lists is not None:
            counts, offsets = counts[lists], offsets[lists]
        ranges.append((index, counts.long(), offsets.long()))
    n_full, n_part = ranges[0][1], ranges[1][1]
    if lists is None:  # whole lists: [0, n_full) of the full list, [0, n_part) of the partial one
        zero = torch.zeros_like(n_full)
        bounds = [(zero, n_full), (zero, n_part)]
    else:
        length = n_full + n_part
        start, end = chunk_id * length // n, (chunk_id + 1) * length // n
        bounds = [(torch.clamp(start, max=n_full), torch.clamp(end, max=n_full)),
                  (torch.clamp(start - n_full, min=0), torch.clamp(end - n_full, min=0))]
    out, firsts = [], []
    for (index, _, offsets), (lo, hi) in zip(ranges, bounds):
        lo, hi = offsets + lo, offsets + hi
        out += [lo, hi]
        entries = torch.cat([i.indices for i in index])
        if entries.numel() == 0:
            firsts.append(torch.zeros_like(lo))
            continue
        shift = [0]
        for i in index[:-1]:
            shift.append(shift[-1] + i.indices.numel())
        shifts = _per_list(batch, shift)
        at = torch.clamp(lo + (shifts if lists is None else shifts[lists]), max=entries.numel() - 1)
        firsts.append(torch.where(hi > lo, entries[at].long(), 0))
    return out + firsts


def _causal_blocks(Mq: int, Mk: int, bq: int, bk: int, seq_len_q: int) -> int:
    """Blocks of a full Mq x Mk layout that hold a causal pair (key <= query): per query block i, the key
    blocks starting at or before its last query. Python ints only: torch.compile traces them as constants;
    eagerly they are cached per geometry (masks of one geometry ask again)."""
    if torch.compiler.is_compiling():  # dynamo would skip the cache (and warn)
        return _count_causal_blocks(Mq, Mk, bq, bk, seq_len_q)
    return _cached_causal_blocks(Mq, Mk, bq, bk, seq_len_q)


def _count_causal_blocks(Mq: int, Mk: int, bq: int, bk: int, seq_len_q: int) -> int:
    return sum(_causal_candidates(i, Mk, bq, bk, seq_len_q) for i in range(Mq))


_cached_causal_blocks = functools.lru_cache(maxsize=256)(_count_causal_blocks)


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


class _Side(NamedTuple):
    """The lists of one side (rows or columns) of one causal flag, before its work plan: live, full and
    partial `BlockIndex`, and the mean list length."""

    live: BlockIndex
    full: BlockIndex
    part: BlockIndex
    mean: float


def _sides(row, col, i, j, by_col, classes: dict, sizes: dict, shape) -> dict:
    """The row and column lists of every causal flag in `classes`, built in one batch: `{flag: (rows, cols)}`,
    each a `_Side`.

    `row`, `col`, `i`, `j`: the layout's nonzero blocks sorted by (row list, key block) (`by_col` sorts them by
    (column list, query block)); `classes[flag]` their class for that flag and `sizes[flag]` the numbers of FULL
    and PARTIAL ones.
    """
    B, H, Mq, Mk = shape
    Lq, Lk = B * H * Mq, B * H * Mk
    col, i = col[by_col], i[by_col]
    keys, values, cls, shapes, set_sizes = [], [], [], [], []
    for flag, flag_cls in classes.items():
        offset = len(keys) // 2 * (Lq + Lk)
        keys += [row + offset if offset else row, col + (offset + Lq)]
        values += [j, i]
        cls += [flag_cls, flag_cls[by_col]]
        shapes += [(B, H, Mq), (B, H, Mk)]
        set_sizes += [sizes[flag]] * 2
    built = _class_lists(torch.cat(keys), torch.cat(values), torch.cat(cls), set_sizes, shapes)
    out = {}
    for n, flag in enumerate(classes):
        total = sum(sizes[flag])  # live blocks: the total length of the row lists, and of the column lists
        out[flag] = (_Side(*built[2 * n], total / Lq), _Side(*built[2 * n + 1], total / Lk))
    return out


def _unsplit_plans(sides: list[_Side]) -> list[WorkPlan]:
    """The work plans of lists that no program splits, one per side (every size known on the host)."""
    inputs = [_PlanInput(side.live.counts, 0, side.mean, side.full, side.part) for side in sides]
    on_gpu = _unsplit_plans_on_gpu(inputs)
    if on_gpu is not None:
        return on_gpu
    sizes = [[side.live.counts.numel(), side.live.counts.shape[-1], 0, 0] for side in sides]
    return _plan_items(_plan_batch(inputs, split=False), sizes)


@contextlib.contextmanager
def one_host_thread(device=None):
    """The host's torch operators on one thread inside (a context, or a decorator: `@one_host_thread()`): a
    build's host tensors hold thousands of elements, where an operator that shares its work among the intra-op
    threads (advanced indexing, `repeat_interleave`) waits for every one of them: tens of microseconds on an
    idle host, milliseconds while other processes hold some of its cores (a compile's workers: fixed built in
    29-37 ms, 2.2 ms on one thread; tuning log step 118). `device`: the device of the build's tensors, where
    they are not host tables (a CPU layout's build keeps every thread for its O(layout) operators). Nested uses
    keep the one thread; inside torch.compile nothing changes.

    Example:
        >>> with one_host_thread():
        ...     torch.get_num_threads()
        1
    """
    threads = torch.get_num_threads()
    if threads == 1 or (device is not None and torch.device(device).type != "cuda") or torch.compiler.is_compiling():
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _on_gpu(t: torch.Tensor) -> bool:
    """Whether lists and plans of tensors like `t` are built by `index_gpu`'s Triton launches: on a CUDA device,
    with the kernel setting `gpu_index`, which is read outside torch.compile only (Dynamo cannot read the
    settings' context variable: inside torch.compile the builders that run there launch on every CUDA device;
    both builders give the same lists). Tests make it true on the CPU, under TRITON_INTERPRET=1, to compare
    both builders."""
    if not t.is_cuda:
        return False
    if torch.compiler.is_compiling():
        return True
    from .kernels import settings

    return settings.current().gpu_index


def _index_gpu():
    """`sparse_flash.index_gpu`, or None without a Triton (and torch) that the kernels are tested on
    (`checks.triton_problem`)."""
    from .checks import triton_problem

    if triton_problem() is not None:
        return None
    from . import index_gpu

    return index_gpu


def gpu_builders(t: torch.Tensor, traceable: bool = False):
    """`sparse_flash.index_gpu` where it builds the lists of tensors like `t` (`_on_gpu`), else None. Inside
    torch.compile only for the builders that run there as custom ops (`traceable`: the top-k choice and lists
    and the unsplit work plans, whose sizes the host knows); the others' sizes wait for the device, and there
    inductor fuses the torch operators instead."""
    if torch.compiler.is_compiling() and not traceable:
        return None
    return _index_gpu() if _on_gpu(t) else None


def _unsplit_plans_on_gpu(plans: list[_PlanInput]) -> list[WorkPlan] | None:
    """The plans of `_plan_items` for lists that no program splits, in one Triton launch
    (`sparse_flash.index_gpu.unsplit_plans`), or None where that does not apply (`_on_gpu`, no Triton, more
    lists per head than one program sorts)."""
    counts = plans[0].counts
    index_gpu = gpu_builders(counts, traceable=True)
    longest = max(plan.counts.shape[-1] for plan in plans)  # a list holds at most the other side's blocks
    if index_gpu is None or not all(index_gpu.supported(plan.counts.shape[-1], longest) for plan in plans):
        return None
    made = index_gpu.unsplit_plans([index_gpu.PlanInput(plan.counts, plan.full, plan.part, HEAVY_FACTOR * plan.mean)
                                    for plan in plans], longest)
    none = index_gpu.int32_pieces([(0,)] * (2 * len(plans)), counts.device)  # the empty split tables
    out = []
    for p, (items, chunks, slots, lead) in enumerate(made):
        out.append(WorkPlan(items, chunks, slots, lead, none[2 * p], none[2 * p + 1]))
        _unbacked((items, 2), (out[-1].split, 0), (out[-1].slot_list, 0))
    return out


def _plan_sizes_on_gpu(plans: list[_PlanInput]):
    """`(n, base, sizes)`: the chunks of every list (`_PlanBatch.n`, `.base`) and the plans' sizes
    (`_plan_sizes`, still on the device), one Triton launch per plan (`sparse_flash.index_gpu.plan_sizes`), or
    None where that does not apply (`_on_gpu`, no Triton, more lists per head than one program holds)."""
    index_gpu = gpu_builders(plans[0].counts)
    if index_gpu is None or not all(index_gpu.sizes_supported(plan.counts.shape[-1]) for plan in plans):
        return None
    return index_gpu.plan_sizes([plan.counts for plan in plans], [plan.chunk for plan in plans], SPLIT_MAX_CHUNKS)


def _split_plans_on_gpu(plans: list[_PlanInput], base: tuple[int, ...], n: torch.Tensor,
                        sizes: list[list[int]], firsts: torch.Tensor | None = None) -> list[WorkPlan] | None:
    """`_plan_items` of a batch of plans in which some list is cut into chunks (`n`: every list's chunks, plan p's
    at `base[p]`; `firsts`: their prefix sums of `index_gpu.split_plans`, or None to sum them here), one Triton
    launch for up to four plans (`sparse_flash.index_gpu.split_plans`; a plan without a cut list comes out as
    `_unsplit_plans_on_gpu` makes it), or None where that does not apply (`_on_gpu`, no Triton, more items or
    lists per head than one program orders)."""
    index_gpu = gpu_builders(n)
    longest = max(size[4] for size in sizes)
    if index_gpu is None or not all(index_gpu.split_supported(plan.counts.shape[-1], size[1], longest)
                                    for plan, size in zip(plans, sizes)):
        return None
    if firsts is None:
        is_split = (n > 1).long()
        # exclusive prefix sums over the batch: the split lists' scratch slots and the split lists themselves
        firsts = torch.nn.functional.pad(torch.stack([n * is_split, is_split]).cumsum(1), (1, 0))
    leads = torch.zeros(len(plans), dtype=torch.int32, device=n.device)  # one fill for every plan's count
    shapes = [index_gpu.split_plan_shapes(plan.counts, tuple(size[:4])) for plan, size in zip(plans, sizes)]
    # the plans' tables of fixed sizes in one allocation, their scratch (freed once the plans are made) in another
    kept = [shape for kept, _ in shapes for shape in kept]
    per_plan = len(shapes[0][0])
    own = [first + i for first in range(0, len(kept), per_plan) for i in index_gpu.SPLIT_PLAN_OWN]
    pieces = iter(index_gpu.int32_pieces(kept, n.device, own))
    scratch = index_gpu.int32_pieces([scratch for _, scratch in shapes], n.device)
    batch = [index_gpu.SplitInput(index_gpu.PlanInput(plan.counts, plan.full, plan.part, HEAVY_FACTOR * plan.mean),
                                  base[p], tuple(size[:4]), (*(next(pieces) for _ in shapes[p][0]), scratch[p]),
                                  leads[p:p + 1])
             for p, (plan, size) in enumerate(zip(plans, sizes))]
    out = [WorkPlan(*fields) for fields in index_gpu.split_plans(batch, n, firsts, longest)]
    for plan in out:
        _unbacked((plan.items, 2), (plan.split, 0), (plan.slot_list, 0))
    return out


def _plans_on_gpu(plans: list[_PlanInput], base: tuple[int, ...], n: torch.Tensor, sizes: list[list[int]],
                  firsts: torch.Tensor | None) -> list[WorkPlan] | None:
    """`_plan_items` of a batch of plans (`_split_plans_on_gpu`'s arguments) on the device, or None where that does
    not apply: where some plan cuts a list into chunks, every plan of the batch by `_split_plans_on_gpu` (one launch
    for the four plans of a mask, where a launch per cut plan and one for the others were), else every plan as
    whole lists by `_unsplit_plans_on_gpu` (one launch)."""
    if any(size[2] for size in sizes):
        return _split_plans_on_gpu(plans, base, n, sizes, firsts)
    return _unsplit_plans_on_gpu([plan._replace(chunk=0) for plan in plans])


def _kernel_index(rows: _Side, cols: _Side, row_plan: WorkPlan, col_plan: WorkPlan) -> KernelIndex:
    return KernelIndex(rows.full, rows.part, cols.full, cols.part, row_plan, col_plan)


class LayoutSizes(NamedTuple):
    """The sizes of a layout's lists that the host must know before they are written, known without reading
    the device (`run_sizes`, `BlockMask._list_sizes`), so that `build_index` need not wait for the device to
    count them.

    Attributes:
        totals: the entries of each kind of list, `(live, full, partial)` without the causal flag, then with it
            (each side, rows or columns, holds them all).
        longest: `{flag: (most live blocks of a row, of a column)}`.
        lists: `{flag: (row counts (B|1, H|1, Mq), column counts (B|1, H|1, Mk))}`, CPU tensors: each list's live
            blocks, from which the host plans lists cut into chunks (no second wait); or None.
    """

    totals: tuple[int, int, int, int, int, int]
    longest: dict
    lists: dict | None = None


class BlockRuns(NamedTuple):
    """The nonzero blocks of a `(1, H, Mq, Mk)` layout as runs along its rows, on the host: int64 CPU tensors
    `(n,)`; run n holds key blocks `start[n] .. end[n] - 1` of query block `row[n] % Mq` of head
    `row[n] // Mq`. The runs of one row are disjoint; a run may be empty (`end <= start`: it holds nothing);
    every start lies in `[0, Mk]`.
    A mask constructor that knows its pattern lists it so (a band is one run per row, a butterfly block a run of
    one): `run_sizes` counts its lists on the host and `mask.layout_from_runs` uploads it without a wait.

    Example:
        >>> runs = BlockRuns(torch.tensor([0, 1, 1]), torch.tensor([0, 0, 2]), torch.tensor([1, 1, 4]))
        >>> runs.size()  # blocks (0, 0), (1, 0), (1, 2), (1, 3)
        4
    """

    row: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor

    def size(self) -> int:
        """The number of blocks the runs hold (a host read of CPU tensors)."""
        return int((self.end - self.start).clamp_(min=0).sum())


def union_runs(a: BlockRuns, b: BlockRuns, Mk: int) -> BlockRuns:
    """The runs of the union of two run sets on one grid of `Mk` key blocks (`BlockRuns`, host tensors): sorted
    by row and start, runs that overlap or touch merged (a running maximum of the ends: each row's keys offset
    past every earlier row's), empty runs dropped.

    Example:
        >>> a = BlockRuns(torch.tensor([0, 1]), torch.tensor([0, 2]), torch.tensor([2, 3]))
        >>> union_runs(a, BlockRuns(torch.tensor([0]), torch.tensor([1]), torch.tensor([4])), 4)
        BlockRuns(row=tensor([0, 1]), start=tensor([0, 2]), end=tensor([4, 3]))
    """
    row, start, end = (torch.cat(pair) for pair in zip(a, b))
    width = Mk + 1
    start, end = row * width + start, row * width + torch.maximum(end, start)
    keep = (end > start).nonzero().squeeze(1)  # host tensors: no device involved
    order = start.index_select(0, keep).argsort()
    start, end = start.index_select(0, keep)[order], end.index_select(0, keep)[order].cummax(0).values
    opens = torch.ones_like(start, dtype=torch.bool)
    opens[1:] = start[1:] > end[:-1]  # a run past every earlier end starts a merged run
    firsts = opens.nonzero().squeeze(1)
    lasts = torch.cat([firsts[1:] - 1, torch.tensor([start.numel() - 1])]) if firsts.numel() else firsts
    start, end = start.index_select(0, firsts), end.index_select(0, lasts)
    row = start.div(width, rounding_mode="floor")
    return BlockRuns(row, start - row * width, end - row * width)


def complement_runs(runs: BlockRuns, lists: int, Mk: int) -> BlockRuns:
    """The runs of the blocks that `runs` leave out, on `lists` rows of `Mk` key blocks: per row the gap before
    each of its merged runs and the one after its last (some empty).

    Example:
        >>> complement_runs(BlockRuns(torch.tensor([0]), torch.tensor([1]), torch.tensor([2])), 2, 3)
        BlockRuns(row=tensor([0, 0, 1]), start=tensor([0, 2, 0]), end=tensor([1, 3, 3]))
    """
    none = torch.zeros(0, dtype=torch.int64)
    row, start, end = union_runs(runs, BlockRuns(none, none, none), Mk)  # sorted, merged
    first = torch.ones_like(row, dtype=torch.bool)
    first[1:] = row[1:] != row[:-1]
    before = torch.where(first, 0, torch.cat([end.new_zeros(1), end[:-1]]))  # the previous end in its row
    last_end = torch.zeros(lists, dtype=torch.int64).scatter_reduce_(0, row, end, "amax")
    rows = torch.arange(lists)
    return BlockRuns(torch.cat([row, rows]), torch.cat([before, last_end]), torch.cat([start, torch.full_like(rows, Mk)]))


def _run_column_counts(starts: torch.Tensor, head_base: torch.Tensor | None, end: torch.Tensor, heads: int,
                       Mk: int) -> torch.Tensor:
    """int64 `(1, heads, Mk)`: each column's blocks among runs `[start, end)` (`end >= start`) of the heads at
    `head_base` (`head x (Mk + 1)` per run, or None for one head): a difference array, +1 where a run starts and
    -1 where it ends, summed along the keys. `starts`: the +1s, `_run_starts(start, head_base, heads, Mk)` (the
    same for both causal flags)."""
    ends = _run_starts(end, head_base, heads, Mk)
    return (starts - ends).view(heads, Mk + 1).cumsum_(1)[:, :Mk].reshape(1, heads, Mk)


def _run_starts(start: torch.Tensor, head_base: torch.Tensor | None, heads: int, Mk: int) -> torch.Tensor:
    """int64 `(heads x (Mk + 1),)`: how many runs start at each key block of each head (`_run_column_counts`)."""
    return torch.bincount(start if head_base is None else start + head_base, minlength=heads * (Mk + 1))


@functools.lru_cache(maxsize=64)
def _row_bounds(Mq: int, Mk: int, bq: int, bk: int, seq_len_q: int, seq_len_k: int) -> torch.Tensor:
    """int64 `(Mq, 2)` on the host, per query block: the key blocks holding a causal pair (`candidates`), and the
    first key block that touches the causal diagonal (k_last > q_first). Kept per geometry; never written. Made
    as a plain tensor inside a torch.func transform too (a mask built in torch.func.grad): a tensor made there
    is the transform's, and the cache outlives it."""
    with torch._C._DisableFuncTorch():
        q = torch.arange(Mq)
        return torch.stack([candidates(True, (Mq, Mk, bq, bk, seq_len_q, seq_len_k), "cpu"), (q * bq + 1) // bk], 1)


@one_host_thread()
def run_sizes(runs: BlockRuns, heads: int, block_size: tuple[int, int], seq_len_q: int, seq_len_k: int) -> LayoutSizes:
    """`LayoutSizes` of a `(1, heads, Mq, Mk)` layout, with every list's count, from its runs on the host
    (`BlockRuns`): O(runs + heads x (Mq + Mk)) work, no device involved. The classes are `build_index`'s
    (tests/test_layout.py compares the two).

    Example:
        >>> runs = BlockRuns(torch.tensor([0, 1]), torch.tensor([1, 0]), torch.tensor([2, 2]))  # (0, 1) holds no causal pair
        >>> run_sizes(runs, 1, (64, 64), 128, 128)[:2]
        ((3, 3, 0, 2, 1, 1), {False: (2, 2), True: (2, 1)})
    """
    bq, bk = block_size
    Mq, Mk = -(-seq_len_q // bq), -(-seq_len_k // bk)
    row, start, end = runs
    head_base = None
    if heads > 1:
        head = row.div(Mq, rounding_mode="floor")
        i, head_base = row - head * Mq, head.mul_(Mk + 1)
    else:
        i = row
    end = torch.maximum(end, start)  # an empty run: [start, start)
    cand, lowest = _row_bounds(Mq, Mk, bq, bk, seq_len_q, seq_len_k).index_select(0, i).unbind(1)
    live_end = torch.minimum(end, cand).clamp_(min=start)
    sizes, live = end - start, live_end - start
    first = torch.maximum(start, lowest)
    partial_causal = live_end.sub(first).clamp_(min=0)  # the live blocks from `first` on
    partial = None
    if Mk * bk > seq_len_k:  # a key tail: the last column's blocks are partial with either flag
        partial = ((end == Mk) & (sizes > 0)).long()
        partial_causal += (live_end == Mk) & (first >= Mk) & (live > 0)  # not counted from `first` on already
    if Mq * bq > seq_len_q:  # a query tail: every block of the last row
        last = i == Mq - 1
        partial = torch.where(last, sizes, 0 if partial is None else partial)
        partial_causal = torch.where(last, live, partial_causal)
    counts, starts = {}, _run_starts(start, head_base, heads, Mk)
    for flag, n, stop in ((False, sizes, end), (True, live, live_end)):
        rows = torch.zeros(heads * Mq, dtype=torch.int64).index_add_(0, row, n).view(1, heads, Mq)
        counts[flag] = (rows, _run_column_counts(starts, head_base, stop, heads, Mk))
    zero = torch.zeros((), dtype=torch.int64)
    totals = torch.stack([sizes.sum(), zero if partial is None else partial.sum(), live.sum(), partial_causal.sum(),
                          *(c.max() for flag in (False, True) for c in counts[flag])]).tolist()
    n, p, nc, pc, row_f, col_f, row_t, col_t = totals
    return LayoutSizes((n, n - p, p, nc, nc - pc, pc), {False: (row_f, col_f), True: (row_t, col_t)}, counts)


def build_index(layout: torch.Tensor, block_size: tuple[int, int], seq_len_q: int, seq_len_k: int,
                sizes: LayoutSizes | None = None) -> MaskIndex:
    """Every index list of a bool layout `(B, H, Mq, Mk)`, from one pass over it; the rest costs O(nnz).

    Built eagerly (when a mask is made) so that attention calls inside `torch.compile` only read them. On a GPU
    the lists come from `index_gpu.layout_lists` (a few Triton launches) and the host waits for the device
    once, for the numbers of each kind of entry and the longest lists; where a list is long enough to be cut
    into chunks it waits once more, for the sizes of the four work plans (rows and columns of each flag). Every
    other size is known on the host. The torch path (`_layout_sides`) waits three times: for the nonzero
    blocks, the numbers of each kind and the plans' sizes.

    `sizes`: the layout's `LayoutSizes` where the host knows them (a mask constructor that made the layout from
    its runs, `run_sizes`; a CPU mask moved to a GPU): the GPU builders then do not wait for the device at all
    (where lists are cut, when `sizes.lists` holds every list's count). They must be the layout's: nothing
    checks them on the device.
    """
    with one_host_thread(layout.device):
        return _build_index(layout, block_size, seq_len_q, seq_len_k, sizes)


def _build_index(layout: torch.Tensor, block_size: tuple[int, int], seq_len_q: int, seq_len_k: int,
                 sizes: LayoutSizes | None) -> MaskIndex:
    """`build_index` (its host operators on one thread where the layout is on a GPU)."""
    B, H, Mq, Mk = layout.shape
    bq, bk = block_size
    on_gpu = _layout_sides_on_gpu(layout, block_size, seq_len_q, seq_len_k, sizes)
    if on_gpu is not None:
        nnz, flag_sizes, sides, longest = on_gpu
    else:
        (nnz, flag_sizes, sides), longest = _layout_sides(layout, block_size, seq_len_q, seq_len_k), None
    rows, cols, kernel, long_lists, longest_row, inputs = {}, {}, {}, {}, {}, []
    covers_causal = False
    for causal in (False, True):
        total = sum(flag_sizes[causal])
        for side, lists in zip(sides[causal], (B * H * Mq, B * H * Mk)):
            inputs.append(_PlanInput(side.live.counts, _chunk_size(total, lists), side.mean, side.full, side.part))
        long_lists[causal] = total >= LONG_LIST_BLOCKS * B * H * Mq
        if causal:
            covers_causal = total == B * H * _causal_blocks(Mq, Mk, bq, bk, seq_len_q)
    plans = None
    if longest is not None:  # the longest lists are known: where none is cut into chunks, nothing more to wait for
        most = [n for flag in (False, True) for n in longest[flag]]  # in the order of `inputs`
        if all(n <= plan.chunk for n, plan in zip(most, inputs)):
            plans = _unsplit_plans_on_gpu([plan._replace(chunk=0) for plan in inputs])
            longest_row = {flag: longest[flag][0] for flag in (False, True)}
    if plans is None:
        # The four work plans (rows and columns of each flag) in one batch. Where the host has every list's count,
        # it counts their chunks, prefix sums and the plans' sizes and uploads the first two at once (no launch,
        # no device operator before the plans' own launches); otherwise the chunks come from the device, the sizes
        # too (read together) or from the host's counts
        batch = firsts = None
        if sizes is not None and sizes.lists is not None:
            n, firsts, base, plan_sizes = _host_split(inputs, sizes, layout.device)
        else:
            on_gpu = _plan_sizes_on_gpu(inputs)
            if on_gpu is None:
                batch = _plan_batch(inputs)
                n, base, plan_sizes = batch.n, batch.base, None
            else:
                n, base, plan_sizes = on_gpu
            plan_sizes = (_plan_sizes(batch) if plan_sizes is None else plan_sizes).tolist()
        plans = _plans_on_gpu(inputs, base, n, plan_sizes, firsts) or _plan_items(batch or _plan_batch(inputs),
                                                                                  plan_sizes)
        longest_row = {flag: plan_sizes[2 * flag][-1] for flag in (False, True)}
    for causal, (row_side, col_side) in sides.items():
        rows[causal], cols[causal] = row_side.live, col_side.live
        kernel[causal] = _kernel_index(row_side, col_side, *plans[2 * causal:2 * causal + 2])
    return MaskIndex(nnz, nnz == layout.numel(), covers_causal, rows, cols, kernel, long_lists, longest_row)


def _host_split(inputs: list[_PlanInput], sizes: LayoutSizes, device: torch.device):
    """`(n, firsts, base, plan sizes)` of the four plans of `inputs` from the lists' counts on the host
    (`sizes.lists`, CPU tensors; `sizes.longest` their longest lists): every list's chunks `n` (`_PlanBatch.n`)
    and their exclusive prefix sums `firsts` (`index_gpu.split_plan`) uploaded together to `device` without
    waiting, the first list of each plan `base`, and each plan's sizes (`_plan_sizes`, host ints). The same
    numbers as `plan_sizes` on the device and `_plan_sizes` of `_plan_batch` (tests/test_layout.py compares
    them); the four plans side by side, in a few operators whatever their number of lists.

    Example:
        >>> counts = torch.tensor([[[40, 1, 2, 1]]])  # one (b, h) of four lists: the first cut into two chunks
        >>> plan = _PlanInput(counts, 32, 11.0, None, None)
        >>> sizes = LayoutSizes((), {False: (40, 40), True: (40, 40)}, {False: (counts, counts), True: (counts, counts)})
        >>> n, firsts, base, plan_sizes = _host_split([plan] * 4, sizes, "cpu")
        >>> n[:4].tolist(), plan_sizes[0]  # (items, the most of one (b, h), split lists, scratch slots, longest)
        ([2, 1, 1, 1], [5, 5, 1, 2, 40])
    """
    counts = [c for flag in (False, True) for c in sizes.lists[flag]]  # in the order of `inputs`
    base, lists_per_head = [0], []
    for c in counts:
        base.append(base[-1] + c.numel())
        lists_per_head.append(c.shape[-1])
    flat = torch.cat([c.reshape(-1) for c in counts]).long()
    chunk = torch.repeat_interleave(torch.tensor([plan.chunk for plan in inputs]),
                                    torch.tensor([b - a for a, b in zip(base, base[1:])]), output_size=base[-1])
    n = flat.sub(1).div_(chunk, rounding_mode="floor").add_(1).clamp_(1, SPLIT_MAX_CHUNKS)  # an empty list: 1
    is_split = n > 1
    # exclusive prefix sums: the split lists' scratch slots and the split lists (`firsts`), then the items
    sums = torch.nn.functional.pad(torch.stack([n * is_split, is_split, n]).cumsum(1), (1, 0))
    heads = counts[0].shape[0] * counts[0].shape[1]
    # the sums at every (plan, b, h)'s first list and one past its last give each plan's totals (its first and
    # last bounds) and the items of each of its (b, h)
    at = sums[:, _plan_bounds(tuple(base), tuple(lists_per_head), heads)].tolist()  # (3, plans, heads + 1)
    slots, split, items = ([row[-1] - row[0] for row in sums_at] for sums_at in at)
    per_head = [max(b - a for a, b in zip(row, row[1:])) for row in at[2]]
    longest = [m for flag in (False, True) for m in sizes.longest[flag]]
    plan_sizes = [list(row) for row in zip(items, per_head, split, slots, longest)]
    L = base[-1]
    both = upload(torch.cat([n, sums[:2].reshape(-1)]), device)
    return both[:L], both[L:].view(2, L + 1), tuple(base), plan_sizes


@functools.lru_cache(maxsize=64)
def _plan_bounds(base: tuple[int, ...], lists_per_head: tuple[int, ...], heads: int) -> torch.Tensor:
    """int64 `(plans, heads + 1)` on the host: the first list of each (plan, b, h) of a batch of plans
    (`_host_split`), then one past the plan's last. Kept per shape; never written. Made as a plain tensor inside
    a torch.func transform too (as `_row_bounds`)."""
    with torch._C._DisableFuncTorch():
        return torch.tensor(base[:-1])[:, None] + torch.tensor(lists_per_head)[:, None] * torch.arange(heads + 1)


def _layout_sides_on_gpu(layout: torch.Tensor, block_size: tuple[int, int], seq_len_q: int, seq_len_k: int,
                         sizes: LayoutSizes | None = None):
    """`_layout_sides` by `index_gpu.layout_lists` (a few Triton launches and one wait for the sizes) and the
    longest lists `{flag: (row, column)}`, or None where that does not apply (`_on_gpu`, no Triton, more blocks
    along a side than one program holds)."""
    index_gpu = gpu_builders(layout)
    B, H, Mq, Mk = layout.shape
    if index_gpu is None or max(Mq, Mk) > index_gpu.MAX_BLOCKS:
        return None
    lists, flag_sizes, longest = index_gpu.layout_lists(layout, block_size, seq_len_q, seq_len_k, sizes)
    sides = {}
    for flag, (rows, cols) in lists.items():
        total = sum(flag_sizes[flag])
        for side in (rows, cols):
            _unbacked(*((indices, 0) for _, _, indices in side))
        sides[flag] = (_Side(*(BlockIndex(*x) for x in rows), total / (B * H * Mq)),
                       _Side(*(BlockIndex(*x) for x in cols), total / (B * H * Mk)))
    return sum(flag_sizes[False]), flag_sizes, sides, longest


def _layout_sides(layout: torch.Tensor, block_size: tuple[int, int], seq_len_q: int, seq_len_k: int):
    """`(nnz, sizes, sides)` of a bool layout by torch operators: the number of nonzero blocks, per causal flag
    the numbers of full and partial blocks, and the row and column lists (`_sides`). Waits for the device twice:
    for the nonzero blocks and for the class sizes."""
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
    by_col = torch.argsort(col * Mq + i)  # the same entries sorted by (b, h, j, i)
    classes = {}  # each entry's class, per causal flag
    for causal in (False, True):
        cls = torch.where(tail | (k_last > q_first), PARTIAL, FULL) if causal else torch.where(tail, PARTIAL, FULL)
        classes[causal] = torch.where(k_first <= q_last, cls, DEAD) if causal else cls
    # The class sizes of both flags, fetched from the device at once: (full, partial) per flag
    sizes = torch.stack([(c == k).sum() for c in classes.values() for k in (FULL, PARTIAL)]).tolist()
    flag_sizes = {causal: tuple(sizes[2 * causal:2 * causal + 2]) for causal in classes}
    return nnz, flag_sizes, _sides(row, col, i, j, by_col, classes, flag_sizes, (B, H, Mq, Mk))


# ---------------------------------------------------------------------------------------------- top-k masks
# A mask that keeps a known number of key blocks in every row (`BlockMask.from_topk`) has every size of its lists
# known on the host: its lists are built below with static shapes, without waiting for the device.


def _causal_candidates(i: int, Mk: int, bq: int, bk: int, seq_len_q: int) -> int:
    """Key blocks holding a causal pair with query block `i`: those starting at or before its last query."""
    return min(Mk, (min((i + 1) * bq, seq_len_q) - 1) // bk + 1)


def _first_partial(i: int, causal: bool, geometry: tuple[int, ...]) -> int:
    """The first key block of row `i` that an attention call with this `causal` flag may need to mask
    element-wise (Mk: none): every live block from it on does (a key tail, the causal diagonal), none before;
    in the last row of a query tail, every block does."""
    Mq, Mk, bq, bk, seq_len_q, seq_len_k = geometry
    if i == Mq - 1 and Mq * bq > seq_len_q:
        return 0
    first = Mk - 1 if Mk * bk > seq_len_k else Mk
    return min(first, (i * bq + 1) // bk) if causal else first  # the first j with k_last(j) > q_first(i)


class TopkSizes(NamedTuple):
    """What the host knows of a top-k mask's lists before any of them exists (`topk_sizes`).

    Attributes:
        nnz: nonzero blocks of the layout.
        flags: the causal flags whose lists are built without reading the device (both for a causal top-k
            mask; only False for a non-causal one, whose causal lists depend on which blocks were chosen).
        partial: per flag in `flags`, the blocks put in the partial lists.
        longest_row: the most blocks of one row.
        covers_causal: whether every block holding a causal pair is kept; None when that depends on the choice.
    """

    nnz: int
    flags: tuple[bool, ...]
    partial: dict
    longest_row: int
    covers_causal: bool | None


def topk_sizes(ks: tuple[int, ...], causal: bool, batch: int, heads: int, geometry: tuple[int, ...]) -> TopkSizes:
    """The sizes of the lists of a top-k mask: `ks` blocks kept per row (one per head, or one for all heads),
    `geometry` `(Mq, Mk, block_q, block_k, seq_len_q, seq_len_k)`. Python ints only, no tensor: torch.compile
    traces it as constants; eagerly it is cached per geometry."""
    if torch.compiler.is_compiling():  # dynamo would skip the cache (and warn)
        return _topk_sizes(ks, causal, batch, heads, geometry)
    return _cached_topk_sizes(ks, causal, batch, heads, geometry)


def _topk_sizes(ks: tuple[int, ...], causal: bool, batch: int, heads: int, geometry: tuple[int, ...]) -> TopkSizes:
    Mq, Mk, bq, bk, seq_len_q, _ = geometry
    cand = [_causal_candidates(i, Mk, bq, bk, seq_len_q) if causal else Mk for i in range(Mq)]
    flags = (False, True) if causal else (False,)
    spans = {flag: [max(0, c - _first_partial(i, flag, geometry)) for i, c in enumerate(cand)] for flag in flags}
    rows_per_k = {k: ks.count(k) * heads // len(ks) * batch for k in set(ks)}  # rows of each value of k, per block
    nnz = sum(rows * sum(min(k, c) for c in cand) for k, rows in rows_per_k.items())
    partial = {flag: sum(rows * sum(min(k, c, s) for c, s in zip(cand, spans[flag])) for k, rows in rows_per_k.items())
               for flag in flags}
    longest_causal = _causal_candidates(Mq - 1, Mk, bq, bk, seq_len_q)  # the most causal candidates of a row
    if causal or min(ks) == Mk:
        covers = min(ks) >= longest_causal  # every row keeps all its causal candidates
    else:
        covers = False if longest_causal > min(ks) else None
    return TopkSizes(nnz, flags, partial, min(max(ks), max(cand)), covers)


_cached_topk_sizes = functools.lru_cache(maxsize=64)(_topk_sizes)


def candidates(causal: bool, geometry: tuple[int, ...], device) -> torch.Tensor:
    """int64 `(Mq,)` on `device`: the key blocks a top-k row chooses from, Mk, or with `causal` those holding a
    causal pair (`_causal_candidates`): they are always blocks `0 .. candidates - 1`."""
    Mq, Mk, bq, bk, seq_len_q, _ = geometry
    i = torch.arange(Mq, device=device)
    if not causal:
        return torch.full_like(i, Mk)
    return torch.clamp((torch.clamp((i + 1) * bq, max=seq_len_q) - 1) // bk + 1, max=Mk)


def topk_counts(ks: tuple[int, ...], causal: bool, geometry: tuple[int, ...], device,
                cand: torch.Tensor | None = None) -> torch.Tensor:
    """int64 `(len(ks), Mq)` on `device`: the blocks a top-k mask keeps in each row, `min(k, candidates)`
    (the candidates of a causal row: the key blocks holding a causal pair; `cand`: `candidates(causal, ...)`
    if the caller has it). A per-head `ks` is copied to the device without waiting for it."""
    cand = candidates(causal, geometry, device) if cand is None else cand
    if len(set(ks)) == 1:
        return torch.clamp(cand, max=ks[0]).expand(len(ks), -1)
    k = torch.as_tensor(ks, dtype=torch.int64).to(device, non_blocking=True)
    return torch.minimum(k[:, None], cand[None, :])


def _partial_counts(counts: torch.Tensor, cand: torch.Tensor, flag: bool, geometry: tuple[int, ...]) -> torch.Tensor:
    """int64 like `counts`: how many of each row's kept blocks (its last ones) go to the partial list of an
    attention call with causal flag `flag` (device arithmetic; `_first_partial` on the host); `cand`: the
    mask's `candidates`."""
    Mq, Mk, bq, bk, seq_len_q, seq_len_k = geometry
    i = torch.arange(Mq, device=counts.device)
    first = torch.full_like(i, Mk - 1 if Mk * bk > seq_len_k else Mk)
    if flag:
        first = torch.minimum(first, (i * bq + 1) // bk)
    if Mq * bq > seq_len_q:
        first = torch.where(i == Mq - 1, 0, first)
    return torch.minimum(counts, torch.clamp(cand - first, min=0))


class TopkTables(NamedTuple):
    """What a top-k mask's build needs besides the scores, from host values only (`topk_tables`).

    Attributes:
        cand: int64 `(Mq,)`: `candidates`.
        counts: int64 `(len(ks), Mq)`: `topk_counts`.
        partials: `{causal flag: int64 (len(ks), Mq)}`: `_partial_counts` for both flags.
        group_sizes: `{causal flag: int64 (3, len(ks))}`: live, full and partial blocks of one (batch, head)
            of each group (`index_gpu.group_sizes`).
    """

    cand: torch.Tensor
    counts: torch.Tensor
    partials: dict
    group_sizes: dict


_TABLES: dict = {}  # (ks, causal, geometry, device) -> TopkTables, most recent last
_TABLES_KEPT = 32
_CAPTURED: dict = {}  # tables that a CUDA graph reads: kept for the life of the process, never evicted


def upload(t: torch.Tensor, device) -> torch.Tensor:
    """CPU tensor `t` on `device` (None: torch's default device), copied without waiting for the device (outside torch.compile and CUDA-graph
    capture, where it is a plain `.to`): the one place that moves the host's tables of a build to a GPU. The
    host buffer stays alive (pinned, held by the copy's event; or staged by the driver) until the copy ran.

    Example:
        >>> upload(torch.arange(3), torch.device("cpu")).tolist()
        [0, 1, 2]
    """
    device = torch.get_default_device() if device is None else torch.device(device)
    if device.type == "cpu" or torch.compiler.is_compiling() or _capturing(device):
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _capturing(device: torch.device) -> bool:
    """Whether work on `device` is being captured into a CUDA graph now (kernels recorded, not run). False
    while torch.compile traces: Dynamo cannot trace the query (a graph break, an error under fullgraph)."""
    return device.type == "cuda" and not torch.compiler.is_compiling() and torch.cuda.is_current_stream_capturing()


def topk_tables(ks: tuple[int, ...], causal: bool, geometry: tuple[int, ...], device) -> TopkTables:
    """`TopkTables` on `device`, made once per (ks, causal, geometry, device) and reused (the last 32 kept):
    masks chosen per call from scores of one shape then launch about 30 fewer small operators each. The
    tables are never written in place.

    Inside a CUDA-graph capture, tables made before it (by a warm-up call, as graph capture wants anyway) are
    read by the graph instead of being remade in it, so a replayed `from_topk` runs about 30 fewer kernels;
    since the graph keeps their addresses, they are then kept for the life of the process. Tables not made
    before the capture, and every call inside torch.compile, are made afresh (part of the graph).

    Example:
        >>> t = topk_tables((2, ), True, (4, 4, 64, 64, 256, 256), "cpu")
        >>> t.counts.tolist(), t is topk_tables((2, ), True, (4, 4, 64, 64, 256, 256), "cpu")
        ([[1, 2, 2, 2]], True)
    """
    device = torch.device(device)
    key = (ks, causal, geometry, device)
    if torch.compiler.is_compiling():
        return _make_topk_tables(ks, causal, geometry, device)
    if _capturing(device):
        tables = _CAPTURED.get(key) or _TABLES.get(key)
        if tables is None:
            return _make_topk_tables(ks, causal, geometry, device)
        _CAPTURED[key] = tables
        return tables
    tables = _TABLES.pop(key, None) or _make_topk_tables(ks, causal, geometry, device)
    _TABLES[key] = tables
    while len(_TABLES) > _TABLES_KEPT:
        del _TABLES[next(iter(_TABLES))]
    return tables


def _make_topk_tables(ks, causal, geometry, device) -> TopkTables:
    cand = candidates(causal, geometry, device)
    counts = topk_counts(ks, causal, geometry, device, cand)
    partials = {flag: _partial_counts(counts, cand, flag, geometry) for flag in (False, True)}
    groups = {flag: torch.stack([counts, counts - partials[flag], partials[flag]]).sum(-1) for flag in partials}
    return TopkTables(cand, counts, partials, groups)


class _BuiltOnUse(dict):
    """Per-causal-flag values of which some are built when first asked for: `fill(flag)` stores that flag in
    every such dict of the index."""

    def __init__(self, values: dict, fill):
        super().__init__(values)
        self._fill = fill

    def __missing__(self, flag):
        self._fill(flag)
        return dict.__getitem__(self, flag)


def _unpack(index: MaskIndex) -> tuple:
    """The per-flag dicts of an index: rows, cols, kernel, long_lists, longest_row."""
    return index.rows, index.cols, index.kernel, index.long_lists, index.longest_row


def _topk_entries(selected: torch.Tensor, counts: torch.Tensor, nnz: int, Mk: int) -> tuple:
    """The kept blocks of a top-k mask as entries sorted by (row list, key block): `(row, t, i, j, col, by_col)`,
    int64 `(nnz,)` each: the row list `(b * H + h) * Mq + i`, the place in its row, the query and key block,
    the column list `(b * H + h) * Mk + j`, and the order that sorts the entries by (column list, query block)."""
    B, H, Mq, W = selected.shape
    L = B * H * Mq
    n_rows = counts.expand(B, H, Mq).reshape(L)
    row = torch.repeat_interleave(torch.arange(L, device=selected.device), n_rows, output_size=nnz)
    t = torch.arange(nnz, device=selected.device) - (torch.cumsum(n_rows, 0) - n_rows)[row]  # place in row
    j = selected.reshape(L, W)[row, t]
    bh, i = row // Mq, row % Mq
    col = bh * Mk + j
    return row, t, i, j, col, torch.argsort(col * Mq + i)


def _topk_sides_on_gpu(selected: torch.Tensor, counts: torch.Tensor, partials: dict, flag_sizes: dict,
                       Mk: int, group_sizes: dict) -> dict | None:
    """`_sides` of a top-k mask, three Triton launches per causal flag (`sparse_flash.index_gpu.topk_lists`), or
    None where that does not apply (`_on_gpu`, no Triton, more kept blocks per head or query blocks per column
    than one program holds)."""
    B, H, Mq, W = selected.shape
    index_gpu = gpu_builders(selected, traceable=True)
    if index_gpu is None or not index_gpu.topk_supported(Mq, W, Mk):
        return None
    out = {}
    # the kind of each (column list, query block), 0: not kept; one fill for both flags
    kinds = torch.zeros((len(flag_sizes), B * H * Mk, Mq), dtype=torch.int8, device=selected.device)
    for f, (flag, (full, part)) in enumerate(flag_sizes.items()):
        rows, cols = index_gpu.topk_lists(selected, counts.contiguous(), partials[flag].contiguous(), Mk,
                                          (full + part, full, part), kinds[f], group_sizes[flag])
        for lists in (rows, cols):
            _unbacked(*((indices, 0) for _, _, indices in lists))
        out[flag] = (_Side(*(BlockIndex(*x) for x in rows), (full + part) / (B * H * Mq)),
                     _Side(*(BlockIndex(*x) for x in cols), (full + part) / (B * H * Mk)))
    return out


_CAUSAL_LISTS_OF_CHOICE = (
    "a top-k mask chosen with causal=False builds its causal=True lists on first use, and their sizes depend on "
    "the choice: that waits for the device, which torch.compile(fullgraph=True) cannot trace. Use the mask once "
    "with causal=True before the compiled call (or call mask.row_index(True)), or choose it with causal=True")


def _causal_lists_of_choice(layout: torch.Tensor, block_size, seq_len_q: int, seq_len_k: int) -> tuple:
    """The per-flag dicts (`_unpack`) of a non-causal top-k choice's layout, built by `build_index` (it waits for
    the device, so inside torch.compile it raises `_CAUSAL_LISTS_OF_CHOICE`: under fullgraph=True that error
    reaches the caller; without it Dynamo runs the frame eagerly, where the lists build, `untraced`)."""
    if torch.compiler.is_compiling():
        raise RuntimeError(_CAUSAL_LISTS_OF_CHOICE)
    return _unpack(untraced(build_index)(layout, block_size, seq_len_q, seq_len_k))


_UNTRACED: dict = {}  # fn -> its `torch.compiler.disable` wrapper, made once (tens of microseconds each time)


def untraced(fn):
    """`fn`, never traced by torch.compile: for the builders that wait for the device, which a compiled caller
    without fullgraph runs eagerly at a graph break. Dynamo would otherwise compile them as frames of their own,
    breaking at every device read (and torch 2.11's fails on those breaks with an internal assertion). Where
    Dynamo is not loaded nothing is compiling, and `fn` is returned as it is (no import for this). The wrapper
    is made once per function: a mask build calls this every time."""
    if "torch._dynamo" not in sys.modules:
        return fn
    wrapped = _UNTRACED.get(fn)
    if wrapped is None:
        wrapped = _UNTRACED[fn] = torch.compiler.disable(fn)
    return wrapped


def build_topk_index(selected: torch.Tensor, tables: TopkTables, ks: tuple[int, ...], causal: bool,
                     block_size: tuple[int, int], seq_len_q: int, seq_len_k: int, layout: torch.Tensor) -> MaskIndex:
    """The index lists of a top-k mask, with static shapes: nothing here waits for the device.

    Args:
        selected: int64 `(B, H, Mq, W)`: row (b, h, i) keeps the key blocks `selected[b, h, i, :counts[h, i]]`,
            ascending (the rest of the row is ignored).
        tables: `topk_tables(ks, causal, ...)` on the device (the rows' candidates, kept and partial counts).
        ks: blocks kept per row, one per head or one for all heads (host ints).
        causal: the mask keeps only blocks holding a causal pair (a causal top-k).
        layout: the mask's bool layout `(B, H, Mq, Mk)` (for the lists of a flag built on first use).

    Every size follows from `ks` and the geometry (`topk_sizes`), except which kept blocks need an element mask
    (a key tail, the causal diagonal): the lists put the last `min(count, span)` kept blocks of a row in the
    partial list, where `span` is the number of the row's candidates that may need one (they are its last
    candidates). That holds every block that needs a mask, and may hold full blocks too (exact: their element
    mask allows every pair) when a row did not keep all of its `span`: with rectangular blocks, or with a key
    tail. Square blocks without tails give exactly the lists of `build_index`.

    Lists are never split (each list is one work item; long columns, such as a block every row keeps, are
    walked by one program). Only the lists of the mask's own flag are built here: a causal top-k mask builds its
    non-causal lists on first use (the same static path, no wait), a non-causal one its causal lists with
    `build_index`, which waits for the device (and `covers_causal`, where it depends on the choice, at once).
    Inside torch.compile every flag of `topk_sizes` is built at once. A mask made inside a CUDA-graph capture
    refuses the other flag (its lists would be built from one replay's choice and not follow the next), and
    a first use of the other flag inside a capture is refused too (the lists would only exist in the graph).
    """
    B, H, Mq, W = selected.shape
    Mk = layout.shape[-1]
    geometry = (Mq, Mk, *block_size, seq_len_q, seq_len_k)
    sizes = topk_sizes(ks, causal, B, H, geometry)
    counts = tables.counts
    entries = []  # the torch builders' entries, made once where they are needed

    def topk_entries():
        if not entries:
            entries.append(_topk_entries(selected, counts, sizes.nnz, Mk))
        return entries[0]

    def static_lists(flags):
        """rows, cols, kernel, long_lists and longest_row of `flags` (each a subset of `sizes.flags`)."""
        partials = {flag: tables.partials[flag] for flag in flags}  # (len(ks), Mq) each
        flag_sizes = {flag: (sizes.nnz - sizes.partial[flag], sizes.partial[flag]) for flag in flags}
        sides = _topk_sides_on_gpu(selected, counts, partials, flag_sizes, Mk, tables.group_sizes)
        if sides is None:
            row, t, i, j, col, by_col = topk_entries()
            n_rows = counts.expand(B, H, Mq).reshape(-1)
            classes = {flag: torch.where(t >= (n_rows - partials[flag].expand(B, H, Mq).reshape(-1))[row], PARTIAL,
                                         FULL) for flag in flags}
            sides = _sides(row, col, i, j, by_col, classes, flag_sizes, (B, H, Mq, Mk))
        plans = _unsplit_plans([side for pair in sides.values() for side in pair])  # every flag's plans in one batch
        out = tuple({} for _ in range(5))
        for (flag, (row_side, col_side)), row_plan, col_plan in zip(sides.items(), plans[::2], plans[1::2]):
            values = (row_side.live, col_side.live, _kernel_index(row_side, col_side, row_plan, col_plan),
                      sizes.nnz >= LONG_LIST_BLOCKS * B * H * Mq, sizes.longest_row)
            for mine, value in zip(out, values):
                mine[flag] = value
        return out

    compiling = torch.compiler.is_compiling()
    in_capture = _capturing(selected.device)
    rows, cols, kernel, long_lists, longest_row = static_lists(sizes.flags if compiling else (causal, ))
    covers = sizes.covers_causal
    if covers is None:  # a non-causal choice that may hold every causal block: count the causal ones it kept
        _, _, i, j, _, _ = topk_entries()
        q_last = torch.clamp((i + 1) * block_size[0], max=seq_len_q) - 1
        covers = int((j * block_size[1] <= q_last).sum()) == B * H * _causal_blocks(Mq, Mk, *block_size, seq_len_q)
    if len(rows) == 1:  # the other flag: on first use
        def fill(flag):
            if in_capture or _capturing(selected.device):
                where = "was made inside a CUDA-graph capture" if in_capture else "is first used so inside one"
                raise RuntimeError(
                    f"this top-k mask (chosen for causal={causal} attention) builds its lists for causal={flag} "
                    f"attention on first use, and {where}: those lists would not follow the graph's replays. "
                    f"Use it with causal={causal}, or once with causal={flag} outside the capture first")
            built = (static_lists((flag, )) if causal else
                     _causal_lists_of_choice(layout, block_size, seq_len_q, seq_len_k))
            for mine, theirs in zip(lazy, built):
                dict.__setitem__(mine, flag, theirs[flag])

        lazy = tuple(_BuiltOnUse(v, fill) for v in (rows, cols, kernel, long_lists, longest_row))
        rows, cols, kernel, long_lists, longest_row = lazy
    return MaskIndex(sizes.nnz, sizes.nnz == layout.numel(), covers, rows, cols, kernel, long_lists, longest_row)

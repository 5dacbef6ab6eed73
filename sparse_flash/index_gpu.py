"""A mask's index lists and work plans built on the GPU by a few Triton launches, where `mask_index` builds them
with many small torch operators, each a kernel launch of its own:

- `layout_lists`: every row and column list of a bool layout, both causal flags (`mask_index.build_index`);
- `topk_lists`: those of a top-k mask, whose sizes the host knows (`mask_index.build_topk_index`);
- `plan_sizes`: the chunks of every list and the sizes of the work plans where some list is cut;
- `unsplit_plans`: the work plans of lists that no program splits (`mask_index._plan_items`): items ordered by
  (batch, head), longest list first within, ties in list order; every item a whole list;
- `split_plans`: the same where some lists are cut into chunks (global rows and columns): every chunk an item,
  with its scratch slot, and the split lists' tables;
- `hash_into`: the seeded draws of the random constructors (`masks._common.hash_draws`);
- `runs_layout`: the layout of a mask constructor's runs (`mask.layout_from_runs`);
- `fixed_layout`: the layout of `masks.fixed` where its runs are too many to list.

`mask_index` calls them for tensors on a CUDA device; inside torch.compile the top-k builders (`choose_topk`,
`topk_lists`, `unsplit_plans`: their sizes are known on the host) run as custom ops (the end of this module),
and the others are left to inductor's fusion of the torch operators. This is the only module of the mask layer
that imports Triton, and only then. Each builds
exactly what the torch operators build (tests/test_layout.py and tests/test_dynamic_masks.py compare them under
TRITON_INTERPRET=1).

Example: `unsplit_plans`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import operator
from typing import Collection, NamedTuple

import torch
import triton
import triton.language as tl

from .kernels.memory import new_output, new_outputs
# `launch`: Triton's own launcher costs tens of microseconds of host time per call
from .kernels.launch import cdiv, launch, next_power_of_2

FIELDS = 10  # int32 fields of a work item: `mask_index.ITEM_FIELDS`, in that order
WARPS, STAGES = 4, 3  # Triton's default launch options, passed explicitly to the direct launches
MAX_LISTS = 8192  # lists of one (batch, head) that a program sorts in its registers


ALIGN = 32  # int32s: every shared piece of `int32_pieces` starts a multiple of 128 bytes into its allocation


def int32_pieces(shapes: list[tuple[int, ...]], device: torch.device, own: Collection[int] = ()) -> list[torch.Tensor]:
    """Uninitialised int32 tensors of these shapes: one call into the allocator for a build's many outputs of
    fixed sizes (each of its own costs a few microseconds of host time), views into one allocation, each a
    multiple of 128 bytes into it (CUDA's start on 512-byte boundaries, so the kernels' alignment
    specialisations stay those of separate allocations); the pieces live as long as any of them does.

    The pieces at the positions in `own` (those whose sizes differ from mask to mask: index lists, work items)
    get allocations of their own. torch.compile takes a view's offset into its allocation as a size of the
    graph's inputs and guards on it, and these offsets would follow the sizes before them: a mask of new sizes
    would compile a new graph (tests/test_nn.py). The shared pieces' offsets depend on the shapes of fixed
    pieces only.

    Example:
        >>> a, b, c = int32_pieces([(2, 3), (4,), (5,)], torch.device("cpu"), own=[1])
        >>> a.shape, c.data_ptr() - a.data_ptr(), b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
        (torch.Size([2, 3]), 128, False)
    """
    return int32_arena(shapes, device, own)[1]


def _arena_plan(shapes: tuple, own: tuple) -> tuple:
    """Where `int32_arena`'s pieces lie: `(length of the shared allocation, views)`, views `(shape, strides,
    offset)` per shared piece and None per own piece, in the order of `shapes`; kept per (shapes, own) (a
    build's shared pieces have the sizes of its geometry, so a new mask of a known geometry looks them up).
    Under torch.compile it is computed, not looked up: dynamo skips an lru_cache (and warns), and the plan is
    Python ints that it traces as constants."""
    if torch.compiler.is_compiling():
        return _place_pieces(shapes, own)
    return _cached_arena_plan(shapes, own)


def _place_pieces(shapes: tuple, own: tuple) -> tuple:
    """`_arena_plan` computed."""
    views, start = [], 0
    for i, shape in enumerate(shapes):
        if i in own:
            views.append(None)
            continue
        strides = tuple(itertools.accumulate((max(d, 1) for d in reversed(shape[1:])), operator.mul, initial=1))[::-1]
        views.append((shape, strides, start))
        n = math.prod(shape)
        start += n + -n % ALIGN  # the piece, then its padding
    return start, tuple(views)


_cached_arena_plan = functools.lru_cache(maxsize=512)(_place_pieces)


def _key(shapes: list, own: Collection[int]) -> tuple:
    """`_arena_plan`'s key: the shapes with each own piece's left out (its size differs from mask to mask)."""
    marks = set(own)
    return tuple(None if i in marks else tuple(shape) for i, shape in enumerate(shapes)), tuple(sorted(marks))


def int32_arena(shapes: list[tuple[int, ...]], device: torch.device,
                own: Collection[int] = ()) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`(allocations, pieces)` of `int32_pieces`: the shared allocation, then each own piece's in order."""
    key = _key(shapes, own)
    length, views = _arena_plan(*key)
    allocations = new_outputs([(length,), *(shapes[i] for i in key[1])], torch.int32, device)
    return allocations, _pieces(allocations, views)


def pieces_of(allocations: list[torch.Tensor], shapes: list[tuple[int, ...]],
              own: Collection[int] = ()) -> list[torch.Tensor]:
    """The pieces of `allocations` (those of `int32_arena(shapes, device, own)`), in the order of `shapes`."""
    return _pieces(allocations, _arena_plan(*_key(shapes, own))[1])


def _pieces(allocations: list[torch.Tensor], views: tuple) -> list[torch.Tensor]:
    """The pieces at `views` (`_arena_plan`): each shared piece one strided view of the shared allocation (one
    operator a piece, where a split and a view take two, and a tensor for each padding), each own piece its
    allocation."""
    shared, owned = allocations[0], iter(allocations[1:])
    return [next(owned) if view is None else shared.as_strided(*view) for view in views]


def every_third(shapes: list) -> range:
    """The positions of the index lists in shapes of (counts, offsets, indices) triples: their own pieces."""
    return range(2, len(shapes), 3)


def _on(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' for the launch."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def supported(lists_per_head: int, longest: int) -> bool:
    """Whether one program can order `lists_per_head` lists of at most `longest` blocks (its sort key, the
    length and the list number, must fit in 31 bits)."""
    block = next_power_of_2(lists_per_head)
    return block <= MAX_LISTS and (longest + 1) * block < 2**31


class PlanInput(NamedTuple):
    """One work plan's lists for `unsplit_plans`: `counts` int32 `(B, H, M)` live blocks of each list; `full`,
    `part` `(counts, offsets, indices)` of the full and the partial lists (a `BlockIndex`); a list longer than
    `heavy_above` blocks is heavy (`HEAVY_FACTOR` x the mean length). The launches read each list's lengths from
    the offsets (a list's live blocks are its full and partial ones), so `counts` gives only the shape."""
    counts: torch.Tensor
    full: tuple
    part: tuple
    heavy_above: float


MAX_PLANS = 4  # work plans that one `unsplit_plans` launch orders (a mask's rows and columns for both flags)


def unsplit_plans(plans: list[PlanInput], longest: int):
    """The work plans of lists that no program splits, on the lists' device: up to `MAX_PLANS` plans per
    launch, their outputs in one allocation.

    Args:
        plans: each plan's lists (`PlanInput`), all on one device.
        longest: an upper bound of the lists' lengths (the most blocks of the other side).

    Returns:
        Per plan `(items, chunks, slots, lead)`: int32 `(B, H, M, FIELDS)` items, `(B * H * M,)` chunks (all 1)
        and slots (all -1), and `(1,)` the most heavy lists of one (batch, head).

    Example (on a GPU, or on the CPU under TRITON_INTERPRET=1 as the CPU tests run it):
        >>> i32 = dict(dtype=torch.int32, device="cuda" if torch.cuda.is_available() else "cpu")
        >>> counts = torch.tensor([[[1, 3, 2]]], **i32)  # (B, H, M): live blocks of 3 lists
        >>> full = (counts, torch.tensor([0, 1, 4, 6], **i32), torch.arange(6, **i32))
        >>> part = (torch.zeros_like(counts), torch.zeros(4, **i32), torch.zeros(0, **i32))
        >>> [(items, chunks, slots, lead)] = unsplit_plans([PlanInput(counts, full, part, 4.0)], longest=3)
        >>> items[0, 0, :, 0].tolist()  # the lists by rank: longest first
        [1, 2, 0]
    """
    shapes = [shape for plan in plans for shape in unsplit_plan_shapes(plan.counts)]
    if not torch.compiler.is_compiling():
        return _unsplit_plans(plans, longest, shapes)[2]
    flat = [t for plan in plans for t in (plan.counts, *plan.full[:3], *plan.part[:3])]
    *allocations, leads = _unsplit_plans_op(flat, [float(plan.heavy_above) for plan in plans], longest)
    return _plans_of(pieces_of(allocations, shapes, _items_of(shapes)), leads)


def _items_of(shapes: list) -> range:
    """The positions of the items in `unsplit_plans`' shapes: their own pieces (`int32_pieces`; an item table's
    size differs from mask to mask where some list is cut)."""
    return range(0, len(shapes), 3)


def _plans_of(pieces: list[torch.Tensor], leads: torch.Tensor) -> list[tuple]:
    """Each plan's `(items, chunks, slots, lead)` from the pieces of `unsplit_plans`' allocation."""
    return [(*pieces[3 * p:3 * p + 3], leads[p:p + 1]) for p in range(len(leads))]


def _unsplit_plans(plans: list[PlanInput], longest: int, shapes: list[tuple[int, ...]]):
    """`unsplit_plans`' launches: `(allocations, leads, out)`, the allocations of every plan's items, chunks and
    slots (`pieces_of(allocations, shapes, _items_of(shapes))`), each plan's count of heavy lists, and the plans
    (`_plans_of`)."""
    device = plans[0].counts.device
    allocations, pieces = int32_arena(shapes, device, _items_of(shapes))
    leads = torch.zeros(len(plans), dtype=torch.int32, device=device)  # one fill for every plan's count
    out = _plans_of(pieces, leads)
    with _on(device):
        for first in range(0, len(plans), MAX_PLANS):
            slots = list(range(first, min(first + MAX_PLANS, len(plans))))
            args, consts, end = [], {}, 0
            for n, p in enumerate(slots + [slots[0]] * (MAX_PLANS - len(slots))):  # unused slots: never reached
                counts, full, part, heavy_above = plans[p]
                B, H, M = counts.shape
                block = next_power_of_2(M)
                chunk = max(1, min(block, PLAN_TILE // block))  # lists per program
                if n < len(slots):
                    end += B * H * cdiv(M, chunk)
                # the lists' lengths come from their offsets, and each plan's slots follow its chunks (`_place_pieces`):
                # 6 tensors a plan where 11 were (each tensor argument costs the launch host time)
                args += [full[1], full[2], part[1], part[2], out[p][0], out[p][1], M, float(heavy_above), p, end]
                consts.update({f"BLOCK{n}": block, f"CHUNK{n}": chunk})
            launch(_unsplit_plans_kernel, (end, ), (*args, leads, longest), dict(**consts, FIELDS=FIELDS, ALIGN=ALIGN),
                   WARPS, STAGES)
    return allocations, leads, out


def unsplit_plan_shapes(counts: torch.Tensor) -> list[tuple[int, ...]]:
    """The shapes of a plan's items, chunks and slots (`unsplit_plans`) for lists with these counts `(B, H, M)`."""
    B, H, M = counts.shape
    return [(B, H, M, FIELDS), (B * H * M,), (B * H * M,)]


PLAN_TILE = 8192  # (list, list) comparisons of one `_unsplit_plan` program


@triton.jit
def _list_lengths(FullOffsets, PartOffsets, lists, valid):
    """The full, the partial and the live blocks of `lists` (live: both), from their offsets (consecutive lists
    lie back to back, `mask_index.BlockIndex`)."""
    full = tl.load(FullOffsets + lists + 1, mask=valid, other=0) - tl.load(FullOffsets + lists, mask=valid, other=0)
    part = tl.load(PartOffsets + lists + 1, mask=valid, other=0) - tl.load(PartOffsets + lists, mask=valid, other=0)
    return full, part, full + part


@triton.jit
def _unsplit_plan(FullOffsets, FullIndices, PartOffsets, PartIndices, Items, Chunks, Lead, lists_per_head,
                  heavy_above, pid, programs, longest, BLOCK: tl.constexpr, CHUNK: tl.constexpr, FIELDS: tl.constexpr,
                  ALIGN: tl.constexpr):
    """Program `pid` of `programs` = (bh, c) of one plan: the items of lists c CHUNK + [0, CHUNK) of head bh (lists
    [bh * lists_per_head, (bh + 1) * lists_per_head)), each at its rank among the head's lists, longest first (a
    stable order: the key is (longest - length, list), and a list's rank is how many keys are smaller); item
    fields as `mask_index.ITEM_FIELDS`; each list's chunks (1) and slot (-1: its Slots follow its Chunks, padded to
    ALIGN ints, as `int32_arena` places them); the head's heavy lists counted into Lead."""
    chunks = tl.cdiv(lists_per_head, CHUNK)
    bh, c = pid // chunks, pid % chunks
    Slots = Chunks + tl.cdiv(programs // chunks * lists_per_head, ALIGN) * ALIGN
    every = tl.arange(0, BLOCK)
    valid_all = every < lists_per_head
    _, _, length_all = _list_lengths(FullOffsets, PartOffsets, bh * lists_per_head + every, valid_all)
    key_all = tl.where(valid_all, (longest - length_all) * BLOCK + every, 2147483647)  # unused slots rank last
    idx = c * CHUNK + tl.arange(0, CHUNK)
    valid = idx < lists_per_head
    lists = bh * lists_per_head + idx
    full_n, part_n, length = _list_lengths(FullOffsets, PartOffsets, lists, valid)
    rank = tl.sum((key_all[None, :] < ((longest - length) * BLOCK + idx)[:, None]).to(tl.int32), 1)
    full_lo = tl.load(FullOffsets + lists, mask=valid, other=0)
    part_lo = tl.load(PartOffsets + lists, mask=valid, other=0)
    full_first = tl.load(FullIndices + full_lo, mask=valid & (full_n > 0), other=0)
    part_first = tl.load(PartIndices + part_lo, mask=valid & (part_n > 0), other=0)
    item = Items + (bh * lists_per_head + rank).to(tl.int64) * FIELDS
    one = tl.zeros_like(idx) + 1
    tl.store(item + 0, idx, mask=valid)  # block
    tl.store(item + 1, one * 0, mask=valid)  # chunk
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
    heavy = tl.sum((valid_all & (length_all.to(tl.float32) > heavy_above)).to(tl.int32), 0)
    tl.atomic_max(Lead, heavy, mask=c == 0)


@triton.jit
def _unsplit_plans_kernel(FO0, FI0, PO0, PI0, I0, K0, M0, heavy0, lead0, end0,
                          FO1, FI1, PO1, PI1, I1, K1, M1, heavy1, lead1, end1,
                          FO2, FI2, PO2, PI2, I2, K2, M2, heavy2, lead2, end2,
                          FO3, FI3, PO3, PI3, I3, K3, M3, heavy3, lead3, end3, Leads, longest,
                          BLOCK0: tl.constexpr, CHUNK0: tl.constexpr, BLOCK1: tl.constexpr, CHUNK1: tl.constexpr,
                          BLOCK2: tl.constexpr, CHUNK2: tl.constexpr, BLOCK3: tl.constexpr, CHUNK3: tl.constexpr,
                          FIELDS: tl.constexpr, ALIGN: tl.constexpr):
    """Up to four plans in one launch (`_unsplit_plan`): programs [0, end0) make plan 0, [end0, end1) plan 1, and
    so on (a plan's slot past the last plan is never reached); plan n's heavy lists are counted into
    `Leads[lead_n]`."""
    p = tl.program_id(0)
    if p < end0:
        _unsplit_plan(FO0, FI0, PO0, PI0, I0, K0, Leads + lead0, M0, heavy0, p, end0, longest, BLOCK0, CHUNK0, FIELDS,
                      ALIGN)
    elif p < end1:
        _unsplit_plan(FO1, FI1, PO1, PI1, I1, K1, Leads + lead1, M1, heavy1, p - end0, end1 - end0, longest, BLOCK1,
                      CHUNK1, FIELDS, ALIGN)
    elif p < end2:
        _unsplit_plan(FO2, FI2, PO2, PI2, I2, K2, Leads + lead2, M2, heavy2, p - end1, end2 - end1, longest, BLOCK2,
                      CHUNK2, FIELDS, ALIGN)
    else:
        _unsplit_plan(FO3, FI3, PO3, PI3, I3, K3, Leads + lead3, M3, heavy3, p - end2, end3 - end2, longest, BLOCK3,
                      CHUNK3, FIELDS, ALIGN)


def sizes_supported(lists_per_head: int) -> bool:
    """Whether one program holds the `lists_per_head` lists of one (batch, head) (`plan_sizes`)."""
    return next_power_of_2(lists_per_head) <= MAX_LISTS


def plan_sizes(counts: list[torch.Tensor], chunks: list[int], max_chunks: int):
    """`mask_index._plan_batch`'s chunks per list and `_plan_sizes`' sizes of several work plans, one launch
    per plan (where the torch operators take about sixty).

    Args:
        counts: int32 `(B, H, M_p)` per plan: live blocks of each list.
        chunks: per plan, its split threshold in blocks (`mask_index._chunk_size`).
        max_chunks: the most chunks of one list (`mask_index.SPLIT_MAX_CHUNKS`).

    Returns:
        `(n, base, sizes)`: int64 `(L,)` chunks of every list, plan p's at `[base[p], base[p + 1])` (host ints);
        int32 `(P, 5)` per plan: items, the most items of one (batch, head), split lists, scratch slots, longest
        list.
    """
    device = counts[0].device
    base = [0]
    for c in counts:
        base.append(base[-1] + c.numel())
    n = new_output(base[-1], torch.int64, device)
    sizes = torch.zeros((len(counts), 5), dtype=torch.int32, device=device)
    with _on(device):
        for p, (c, chunk) in enumerate(zip(counts, chunks)):
            B, H, M = c.shape
            launch(_plan_sizes_kernel, (B * H, ), (c, n, sizes[p], base[p], M, chunk, max_chunks),
                   dict(BLOCK=next_power_of_2(M)), WARPS, STAGES)
    return n, tuple(base), sizes


@triton.jit
def _plan_sizes_kernel(Counts, N, Sizes, base, lists_per_head, chunk, max_chunks, BLOCK: tl.constexpr):
    """Program bh: the chunks of the lists of one (batch, head) (a list longer than `chunk` is cut into
    ceil(length / chunk) of them, at most `max_chunks`), stored at `base` in N, and added into the plan's
    Sizes: items, the most items of one (batch, head), split lists, scratch slots, longest list."""
    bh = tl.program_id(0)
    idx = tl.arange(0, BLOCK)
    valid = idx < lists_per_head
    length = tl.load(Counts + bh * lists_per_head + idx, mask=valid, other=0)
    n = tl.where(length > chunk, tl.minimum((length + chunk - 1) // chunk, max_chunks), 1)
    n = tl.where(valid, n, 0)
    tl.store(N + base + bh * lists_per_head + idx, n.to(tl.int64), mask=valid)
    split = valid & (n > 1)
    items = tl.sum(n, 0)
    tl.atomic_add(Sizes + 0, items)
    tl.atomic_max(Sizes + 1, items)
    tl.atomic_add(Sizes + 2, tl.sum(split.to(tl.int32), 0))
    tl.atomic_add(Sizes + 3, tl.sum(tl.where(split, n, 0), 0))
    tl.atomic_max(Sizes + 4, tl.max(length, 0))


def split_supported(lists_per_head: int, width: int, longest: int) -> bool:
    """Whether one program orders the `width` items (chunks of lists) of one (batch, head) and holds its
    `lists_per_head` lists (`split_plans`; the sort key, the length and the item number, must fit in 31 bits)."""
    block = next_power_of_2(width)
    return block <= MAX_LISTS and next_power_of_2(lists_per_head) <= MAX_LISTS and (longest + 1) * block < 2**31


SPLIT_PLAN_OWN = (0, 3, 4)  # `split_plan_shapes`' pieces whose sizes differ from mask to mask (`int32_pieces`)


def split_plan_shapes(counts: torch.Tensor, sizes: tuple) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """The shapes of `split_plans`' items, chunks, slots, split lists and slot list, and of its scratch (each
    item's list and chunk, needed only while the plan is made), for lists with these counts `(B, H, M)` and
    plan sizes `(items, the most items of one (b, h), split lists, scratch slots)`."""
    B, H, M = counts.shape
    _, width, num_split, num_slots = sizes
    return [(B, H, width, FIELDS), (B * H * M,), (B * H * M,), (num_split,), (num_slots,)], (2, B * H, width)


class SplitInput(NamedTuple):
    """One work plan's lists for `split_plans`: `plan` its lists (`PlanInput`), `base` its first list in the batch's
    chunk counts, `sizes` host ints `(items, the most items of one (b, h), split lists, scratch slots)`, and
    `out` `(items, chunks, slots, split, slot_list, scratch)` to write (`split_plan_shapes`; scratch holds each
    item's list and chunk while the plan is made) and `lead` int32 `(1,)` zeros to count its heavy items into."""
    plan: PlanInput
    base: int
    sizes: tuple
    out: tuple
    lead: torch.Tensor


def split_plans(plans: list[SplitInput], n: torch.Tensor, firsts: torch.Tensor, longest: int) -> list[tuple]:
    """The work plans of a batch of plans of which some cut lists into chunks (`mask_index._plan_items`' policy), on
    the lists' device: up to `MAX_PLANS` plans per launch, and no wait (the sizes are the host's already). A plan
    whose lists are all whole (`n` 1 for each) comes out as `unsplit_plans` makes it: every item a whole list,
    no split list.

    Args:
        plans: each plan's lists, place in the batch, sizes and outputs (`SplitInput`), all on one device.
        n: int64 `(L,)`: chunks of every list of the batch (`mask_index._plan_batch`), plan p's at
            `[plans[p].base, plans[p].base + B * H * M)`.
        firsts: int64 `(2, L + 1)`: exclusive prefix sums over that batch of the split lists' chunks (row 0,
            their scratch slots) and of the split lists (row 1), with the grand totals last.
        longest: an upper bound of the lists' lengths.

    Returns:
        Per plan, `mask_index.WorkPlan` fields `(items, chunks, slots, lead, split, slot_list)`.
    """
    device = n.device
    with _on(device):
        for first in range(0, len(plans), MAX_PLANS):
            group = list(range(first, min(first + MAX_PLANS, len(plans))))
            args, end = [n, firsts, firsts.shape[1], longest], 0
            for k, p in enumerate(group + [group[0]] * (MAX_PLANS - len(group))):  # unused slots: never reached
                (counts, full, part, heavy_above), base, sizes, out, lead = plans[p]
                B, H, M = counts.shape
                if k < len(group):
                    end += B * H
                # the lists' lengths come from their offsets: 11 tensors a plan where 14 were
                args += [full[1], full[2], part[1], part[2], *out, lead, base, M, sizes[1], float(heavy_above), B * H,
                         end]
            block = next_power_of_2(max(plans[p].plan.counts.shape[-1] for p in group))
            width = next_power_of_2(max(plans[p].sizes[1] for p in group))
            launch(_split_plans_kernel, (end, ), tuple(args), dict(BLOCK=block, WIDTH=width, FIELDS=FIELDS),
                   4 if width <= 1024 else 8, STAGES)
    return [(*plan.out[:3], plan.lead, *plan.out[3:5]) for plan in plans]


@triton.jit
def _split_plan(N, Firsts, stride, longest, FullOffsets, FullIndices, PartOffsets, PartIndices, Items, Chunks, Slots,
                Split, SlotList, Scratch, Lead, base, lists_per_head, width, heavy_above, heads, bh, BLOCK: tl.constexpr,
                WIDTH: tl.constexpr, FIELDS: tl.constexpr):
    """(batch, head) `bh` of one plan of `heads` of them: its lists' chunks and scratch (`_split_lists`), then its
    items from them (`_split_items`). Each step reads only what the program itself wrote before it, so one
    barrier between them orders the two (one launch where two were: a launch costs the host more than the
    step's device time)."""
    _split_lists(N, Firsts, Chunks, Slots, Split, SlotList, Scratch, base, stride, lists_per_head, width, heads, bh,
                 BLOCK)
    tl.debug_barrier()  # every thread's Scratch and Slots stores before any thread reads them
    _split_items(FullOffsets, FullIndices, PartOffsets, PartIndices, N, Slots, Scratch, Items, Lead, base,
                 lists_per_head, width, longest, heavy_above, heads, bh, WIDTH, FIELDS)


@triton.jit
def _split_plans_kernel(N, Firsts, stride, longest,
                        FO0, FI0, PO0, PI0, I0, K0, S0, SP0, SL0, SC0, L0, base0, M0, width0, heavy0, heads0, end0,
                        FO1, FI1, PO1, PI1, I1, K1, S1, SP1, SL1, SC1, L1, base1, M1, width1, heavy1, heads1, end1,
                        FO2, FI2, PO2, PI2, I2, K2, S2, SP2, SL2, SC2, L2, base2, M2, width2, heavy2, heads2, end2,
                        FO3, FI3, PO3, PI3, I3, K3, S3, SP3, SL3, SC3, L3, base3, M3, width3, heavy3, heads3, end3,
                        BLOCK: tl.constexpr, WIDTH: tl.constexpr, FIELDS: tl.constexpr):
    """Up to four plans in one launch (`_split_plan`): programs [0, end0) make plan 0's (batch, head)s, [end0,
    end1) plan 1's, and so on (a plan's slot past the last plan is never reached). One body for every plan, its
    tensors and sizes chosen per program, at the largest plan's BLOCK and WIDTH (a plan's order and fields do
    not depend on them): one compile, where a body per plan compiled four sorts and each combination of the
    plans' sizes anew. The sizes are made tensors (`+ zero`), so that a size Triton specialises to a constant
    in one plan (a 1) has the type of the others."""
    p = tl.program_id(0)
    zero = p * 0
    if p < end0:
        FO, FI, PO, PI = FO0, FI0, PO0, PI0
        I, K, S, SP, SL, SC, L = I0, K0, S0, SP0, SL0, SC0, L0
        base, M, width, heavy, heads = base0 + zero, M0 + zero, width0 + zero, heavy0 + 0.0 * zero, heads0 + zero
        bh = p
    elif p < end1:
        FO, FI, PO, PI = FO1, FI1, PO1, PI1
        I, K, S, SP, SL, SC, L = I1, K1, S1, SP1, SL1, SC1, L1
        base, M, width, heavy, heads = base1 + zero, M1 + zero, width1 + zero, heavy1 + 0.0 * zero, heads1 + zero
        bh = p - end0
    elif p < end2:
        FO, FI, PO, PI = FO2, FI2, PO2, PI2
        I, K, S, SP, SL, SC, L = I2, K2, S2, SP2, SL2, SC2, L2
        base, M, width, heavy, heads = base2 + zero, M2 + zero, width2 + zero, heavy2 + 0.0 * zero, heads2 + zero
        bh = p - end1
    else:
        FO, FI, PO, PI = FO3, FI3, PO3, PI3
        I, K, S, SP, SL, SC, L = I3, K3, S3, SP3, SL3, SC3, L3
        base, M, width, heavy, heads = base3 + zero, M3 + zero, width3 + zero, heavy3 + 0.0 * zero, heads3 + zero
        bh = p - end2
    _split_plan(N, Firsts, stride, longest, FO, FI, PO, PI, I, K, S, SP, SL, SC, L, base, M, width, heavy, heads, bh,
                BLOCK, WIDTH, FIELDS)


@triton.jit
def _split_lists(N, Firsts, Chunks, Slots, Split, SlotList, Scratch, base, stride, lists_per_head, width, heads, bh,
                 BLOCK: tl.constexpr):
    """(Batch, head) bh of `heads`: the chunk counts and first scratch slots of lists [bh * M, (bh + 1) * M), the
    split lists' entries in Split and SlotList, and each of the (batch, head)'s items' list and chunk (in list
    order, the chunks of a list in order; unused ranks -1) in Scratch."""
    idx = tl.arange(0, BLOCK)
    valid = idx < lists_per_head
    lst = bh * lists_per_head + idx  # the list's number in its plan
    n = tl.load(N + base + lst, mask=valid, other=0).to(tl.int32)
    is_split = valid & (n > 1)
    slot0 = (tl.load(Firsts + base + lst, mask=valid, other=0) - tl.load(Firsts + base)).to(tl.int32)
    at = (tl.load(Firsts + stride + base + lst, mask=valid, other=0) - tl.load(Firsts + stride + base)).to(tl.int32)
    tl.store(Chunks + lst, n, mask=valid)
    tl.store(Slots + lst, tl.where(is_split, slot0, -1), mask=valid)
    tl.store(Split + at, lst, mask=is_split)
    start = tl.cumsum(n, 0) - n  # the list's first item within its (batch, head)
    row = Scratch + bh * width
    for r in range(0, width, BLOCK):  # no rank without an item reads a stale value
        tl.store(row + r + idx, -1 + 0 * idx, mask=r + idx < width)
    tl.debug_barrier()  # before the items' stores, which other threads of this program make
    for c in range(0, tl.max(n, 0)):
        taken = c < n
        tl.store(row + start + c, idx, mask=taken)
        tl.store(row + heads * width + start + c, c + 0 * idx, mask=taken)
        tl.store(SlotList + slot0 + c, lst, mask=is_split & taken)


@triton.jit
def _split_items(FullOffsets, FullIndices, PartOffsets, PartIndices, N, Slots, Scratch, Items, Lead, base,
                 lists_per_head, width, longest, heavy_above, heads, bh, WIDTH: tl.constexpr, FIELDS: tl.constexpr):
    """(Batch, head) bh of `heads`: its items from Scratch and Slots (`_split_lists`), ordered longest first, ties
    in item order; item fields as `mask_index.ITEM_FIELDS`, unused ranks padded (no block, no slot); its heavy
    items counted into Lead."""
    t = tl.arange(0, WIDTH)
    used = t < width
    i = tl.load(Scratch + bh * width + t, mask=used, other=-1)
    real = i >= 0
    lst = bh * lists_per_head + tl.where(real, i, 0)
    _, _, count = _list_lengths(FullOffsets, PartOffsets, lst, real)
    n = tl.load(N + base + lst, mask=real, other=1).to(tl.int32)
    length = count // n  # every chunk of a list has this length or one more
    key = tl.where(real, (longest - length) * WIDTH + t, 2147483647)  # ranks without an item last
    ranked = tl.sort(key)
    # the item at each rank; a rank without one reads its own slot, which holds none (-1): the key of such
    # ranks names no slot, and slot WIDTH - 1 may lie in another head's row or past the table's end
    order = tl.where(ranked == 2147483647, t, ranked % WIDTH)
    heavy = tl.sum((real & (length.to(tl.float32) > heavy_above)).to(tl.int32), 0)
    tl.atomic_max(Lead, heavy)
    # the fields of the item at rank r = t
    i = tl.load(Scratch + bh * width + order, mask=used, other=-1)
    c = tl.load(Scratch + heads * width + bh * width + order, mask=used, other=0)
    real = used & (i >= 0)
    lst = bh * lists_per_head + tl.where(real, i, 0)
    n = tl.load(N + base + lst, mask=real, other=1).to(tl.int32)
    n_full, n_part, total = _list_lengths(FullOffsets, PartOffsets, lst, real)
    full_off = tl.load(FullOffsets + lst, mask=real, other=0)
    part_off = tl.load(PartOffsets + lst, mask=real, other=0)
    lo, hi = c * total // n, (c + 1) * total // n  # chunk c of n: positions [c L // n, (c + 1) L // n)
    full_lo, full_hi = full_off + tl.minimum(lo, n_full), full_off + tl.minimum(hi, n_full)
    part_lo, part_hi = part_off + tl.maximum(lo - n_full, 0), part_off + tl.maximum(hi - n_full, 0)
    full_first = tl.load(FullIndices + full_lo, mask=real & (full_hi > full_lo), other=0)
    part_first = tl.load(PartIndices + part_lo, mask=real & (part_hi > part_lo), other=0)
    item = Items + (bh * width + t).to(tl.int64) * FIELDS
    tl.store(item + 0, tl.where(real, i, -1), mask=used)  # block
    tl.store(item + 1, tl.where(real, c, 0), mask=used)  # chunk
    tl.store(item + 2, tl.where(real, n, 0), mask=used)  # chunks
    slot = tl.load(Slots + lst, mask=real & (n > 1), other=-1)
    tl.store(item + 3, tl.where(slot >= 0, slot + c, -1), mask=used)  # slot
    tl.store(item + 4, tl.where(real, full_lo, 0), mask=used)
    tl.store(item + 5, tl.where(real, full_hi, 0), mask=used)
    tl.store(item + 6, tl.where(real, part_lo, 0), mask=used)
    tl.store(item + 7, tl.where(real, part_hi, 0), mask=used)
    tl.store(item + 8, tl.where(real, full_first, 0), mask=used)
    tl.store(item + 9, tl.where(real, part_first, 0), mask=used)


MAX_ENTRIES = 16384  # kept blocks of one (batch, head) (rows x widest row, padded) that a program holds


def topk_supported(rows: int, width: int, cols: int) -> bool:
    """Whether one program holds the kept blocks of one (batch, head) of a top-k mask (`topk_lists`: its row
    lists) and a whole column (its column lists)."""
    block = next_power_of_2(rows)
    return block * next_power_of_2(width) <= MAX_ENTRIES and block <= MAX_BLOCKS


def topk_lists(selected: torch.Tensor, counts: torch.Tensor, partial: torch.Tensor, cols: int, sizes: tuple,
               kind: torch.Tensor, per_group: torch.Tensor):
    """The row and column lists of a top-k mask for one causal flag, on the GPU in three launches, none waiting
    for the device.

    The row lists come from programs of a few rows each, as the kept blocks come (row-major, ascending; a
    program finds where its rows start from the kept counts of the rows before it). For the column lists,
    the same programs mark each kept block's kind (1 full, 2 partial) in a table by (batch, head, key block,
    query block); one program per column counts its kinds, and programs of a few columns each write their
    lists by prefix sums down the columns (no sort: a whole column is in one program's registers), starting
    where the counts of their head's earlier columns end.

    Args:
        selected: int64 `(B, H, Mq, W)`: row (b, h, i) keeps the key blocks `selected[b, h, i, :counts[g, i]]`,
            ascending (g = h for one k per head, else 0).
        counts, partial: int64 `(G, Mq)`, G in {1, H}: blocks kept per row, and how many of them (its last
            ones) are partial for this flag.
        cols: Mk, the key blocks.
        sizes: host ints `(live, full, partial)`: the blocks of each kind in the whole mask.
        kind: int8 zeros `(B * H * cols, Mq)` for the table of kinds (the flags of one mask share one
            zero-filled allocation: one launch fewer).
        per_group: int64 `(3, G)`: live, full and partial blocks of one (batch, head) of each group
            (`mask_index.topk_tables` keeps them per geometry).

    Returns:
        `((row_live, row_full, row_part), (col_live, col_full, col_part))`, each `(counts, offsets, indices)`
        as in `mask_index.BlockIndex` (int32; counts `(B, H, M)`, offsets `(B * H * M + 1,)`): the lists that
        `mask_index._sides` builds from the same choice.
    """
    shapes = topk_list_shapes(selected.shape, cols, sizes)
    if not torch.compiler.is_compiling():
        return _topk_lists(selected, counts, partial, cols, sizes, kind, per_group, shapes)[1]
    allocations = _topk_lists_op(selected, counts, partial, per_group, cols, list(sizes))
    return _sides_of(pieces_of(allocations, shapes, every_third(shapes)))


def _sides_of(pieces: list[torch.Tensor]) -> tuple:
    """`(rows, cols)` of `topk_lists` from the pieces of its allocation: per side, (counts, offsets, indices) of
    each kind (live, full, partial)."""
    return tuple(tuple(tuple(pieces[side * 9 + 3 * kind:side * 9 + 3 * kind + 3]) for kind in range(3))
                 for side in (0, 1))


def topk_list_shapes(selected_shape, cols: int, sizes) -> list[tuple[int, ...]]:
    """The shapes of `topk_lists`' outputs, in one allocation: both sides' (counts, offsets, indices) of each
    kind (live, full, partial)."""
    B, H, Mq, _ = selected_shape
    return [shape for m in (Mq, cols) for n in sizes for shape in ((B, H, m), (B * H * m + 1,), (n,))]


def _topk_lists(selected, counts, partial, cols: int, sizes: tuple, kind, per_group, shapes):
    """`topk_lists`' launches: `(allocations, lists)`, the allocations of its lists (`pieces_of(allocations,
    shapes, every_third(shapes))`) and the lists (`_sides_of`)."""
    B, H, Mq, W = selected.shape
    G, device = counts.shape[0], selected.device
    n_cols = B * H * cols
    allocations, pieces = int32_arena(shapes, device, every_third(shapes))
    rows, col_lists = _sides_of(pieces)
    per_col = new_output((3, n_cols), torch.int32, device)  # the columns' kind counts, while building
    block, width, groups = next_power_of_2(Mq), next_power_of_2(W), next_power_of_2(G)
    chunk = max(1, min(block, ROW_TILE // width))  # rows per program
    column_warps = max(1, block // 512)  # a column of up to 512 query blocks is one warp's
    with _on(device):
        launch(_topk_rows_kernel, (B * H * cdiv(Mq, chunk), ),
               (selected, counts, partial, per_group, *[t for part in rows for t in part], kind, B * H, H, G, Mq,
                cols, W),
               dict(BLOCK=block, ROWS=chunk, WIDTH=width, GROUPS=groups), WARPS, STAGES)
        launch(_topk_col_counts_kernel, (n_cols, ), (kind, per_col, n_cols, Mq), dict(BLOCK=block), column_warps,
               STAGES)
        col_chunk = max(1, min(next_power_of_2(cols), COLUMN_TILE // block))  # columns per program
        launch(_topk_col_write_kernel, (B * H * cdiv(cols, col_chunk), ),
               (kind, per_col, per_group, *[t for part in col_lists for t in part], n_cols, H, G, Mq, cols),
               dict(BLOCK=block, COLS=next_power_of_2(cols), CHUNK=col_chunk, GROUPS=groups), WARPS, STAGES)
    return allocations, (rows, col_lists)


ROW_TILE = 1024  # kept-block slots (rows x widest row) of one `_topk_rows_kernel` program
COLUMN_TILE = 8192  # (column, query block) pairs of one `_topk_col_write_kernel` program


@triton.jit
def _head_base(PerGroup, kind, b, h, bh, num_groups, GROUPS: tl.constexpr):
    """Where the lists of head (b, h) start among all heads' lists of one kind (0 live, 1 full, 2 partial)."""
    g = tl.arange(0, GROUPS)
    per = tl.load(PerGroup + kind * num_groups + g, mask=g < num_groups, other=0)
    per_head = tl.sum(tl.where(g < h, per, 0), 0) + b * tl.sum(per, 0)
    return tl.where(num_groups > 1, per_head, bh * tl.sum(per, 0)).to(tl.int32)


@triton.jit
def _topk_rows_kernel(Selected, Counts, Partial, PerGroup,
                      RowLiveCounts, RowLiveOffsets, RowLive, RowFullCounts, RowFullOffsets, RowFull,
                      RowPartCounts, RowPartOffsets, RowPart, Kind,
                      heads, H, num_groups, Mq, Mk, W, BLOCK: tl.constexpr, ROWS: tl.constexpr, WIDTH: tl.constexpr,
                      GROUPS: tl.constexpr):
    """Program (bh, c): rows [c ROWS, (c + 1) ROWS) of head bh. Their row lists as the kept blocks come
    (row-major, ascending; each list's place among all heads' from the per-group sizes and the head's earlier
    rows), and each kept block's kind (1 full, 2 partial) in the column-major table Kind `(B * H * Mk, Mq)`."""
    chunks = tl.cdiv(Mq, ROWS)
    bh, c = tl.program_id(0) // chunks, tl.program_id(0) % chunks
    b, h = bh // H, bh % H
    g = tl.where(num_groups > 1, h, 0)
    every = tl.arange(0, BLOCK)  # all the head's rows: what comes before this program's, and the totals
    n_all = tl.load(Counts + g * Mq + every, mask=every < Mq, other=0).to(tl.int32)
    p_all = tl.load(Partial + g * Mq + every, mask=every < Mq, other=0).to(tl.int32)
    earlier = every < c * ROWS
    i = c * ROWS + tl.arange(0, ROWS)
    t = tl.arange(0, WIDTH)
    n = tl.load(Counts + g * Mq + i, mask=i < Mq, other=0).to(tl.int32)  # (ROWS,) kept per row
    p = tl.load(Partial + g * Mq + i, mask=i < Mq, other=0).to(tl.int32)  # of which partial (the last ones)
    f = n - p
    kept = (i[:, None] < Mq) & (t[None, :] < n[:, None])  # (ROWS, WIDTH)
    is_full = kept & (t[None, :] < f[:, None])
    is_part = kept & (t[None, :] >= f[:, None])
    j = tl.load(Selected + (bh * Mq + i[:, None]).to(tl.int64) * W + t[None, :], mask=kept, other=0).to(tl.int32)
    last_head = bh == heads - 1
    # rows: entry t of row i goes after the earlier rows' entries of its kind
    _store_rows(RowLiveCounts, RowLiveOffsets, RowLive, bh, heads, Mq, _head_base(PerGroup, 0, b, h, bh, num_groups,
                GROUPS), tl.sum(tl.where(earlier, n_all, 0), 0), tl.sum(n_all, 0), n, i, t[None, :], j, kept,
                last_head)
    _store_rows(RowFullCounts, RowFullOffsets, RowFull, bh, heads, Mq, _head_base(PerGroup, 1, b, h, bh, num_groups,
                GROUPS), tl.sum(tl.where(earlier, n_all - p_all, 0), 0), tl.sum(n_all - p_all, 0), f, i,
                t[None, :], j, is_full, last_head)
    _store_rows(RowPartCounts, RowPartOffsets, RowPart, bh, heads, Mq, _head_base(PerGroup, 2, b, h, bh, num_groups,
                GROUPS), tl.sum(tl.where(earlier, p_all, 0), 0), tl.sum(p_all, 0), p, i, t[None, :] - f[:, None], j,
                is_part, last_head)
    # columns: the kind of (key block j, query block i), for the column programs
    tl.store(Kind + (bh * Mk + j).to(tl.int64) * Mq + i[:, None], tl.where(is_full, 1, 2).to(tl.int8), mask=kept)


@triton.jit
def _store_rows(Counts, Offsets, Indices, bh, heads, Mq, base, before, total, per_row, i, slot, j, ok, last_head):
    """Some rows of one head's lists of one kind: `per_row` entries each, after the `before` entries of the
    head's earlier rows; entry `slot` of row i at its place. The last head also closes the offsets."""
    starts = before + tl.cumsum(per_row, 0) - per_row
    rows = i < Mq
    tl.store(Counts + bh * Mq + i, per_row, mask=rows)
    tl.store(Offsets + bh * Mq + i, base + starts, mask=rows)
    tl.store(Offsets + heads * Mq, base + total, mask=last_head)
    tl.store(Indices + base + starts[:, None] + slot, j, mask=ok)


@triton.jit
def _column_kinds(Kind, lst, Mq, BLOCK: tl.constexpr):
    """Column list `lst`'s query blocks and their kinds (0 not kept, 1 full, 2 partial)."""
    i = tl.arange(0, BLOCK)
    return i, tl.load(Kind + lst.to(tl.int64) * Mq + i, mask=i < Mq, other=0)


@triton.jit
def _topk_col_counts_kernel(Kind, PerCol, lists, Mq, BLOCK: tl.constexpr):
    """Program `lst`: its column's live, full and partial counts (rows of PerCol)."""
    lst = tl.program_id(0)
    _, k = _column_kinds(Kind, lst, Mq, BLOCK)
    tl.store(PerCol + lst, tl.sum((k != 0).to(tl.int32), 0))
    tl.store(PerCol + lists + lst, tl.sum((k == 1).to(tl.int32), 0))
    tl.store(PerCol + 2 * lists + lst, tl.sum((k == 2).to(tl.int32), 0))


@triton.jit
def _topk_col_write_kernel(Kind, PerCol, PerGroup, LiveCounts, LiveOffsets, Live, FullCounts, FullOffsets, Full,
                           PartCounts, PartOffsets, Part, lists, H, num_groups, Mq, Mk, BLOCK: tl.constexpr,
                           COLS: tl.constexpr, CHUNK: tl.constexpr, GROUPS: tl.constexpr):
    """Program (bh, c): columns [c CHUNK, (c + 1) CHUNK) of head bh, their live, full and partial lists (query
    blocks ascending), after the lists of earlier heads (the per-group sizes) and of the head's earlier
    columns (their counts in PerCol)."""
    chunks = tl.cdiv(Mk, CHUNK)
    bh, c = tl.program_id(0) // chunks, tl.program_id(0) % chunks
    b, h = bh // H, bh % H
    col = c * CHUNK + tl.arange(0, CHUNK)
    i = tl.arange(0, BLOCK)
    real = col < Mk
    lst = bh * Mk + col
    k = tl.load(Kind + lst[:, None].to(tl.int64) * Mq + i[None, :], mask=real[:, None] & (i[None, :] < Mq), other=0)
    every = tl.arange(0, COLS)
    earlier = bh * Mk + every
    for kind in tl.static_range(3):
        if kind == 0:
            entries = k != 0
        elif kind == 1:
            entries = k == 1
        else:
            entries = k == 2
        before = tl.load(PerCol + kind * lists + earlier, mask=every < c * CHUNK, other=0)
        taken = entries.to(tl.int32)
        n = tl.sum(taken, 1)  # (CHUNK,)
        start = _head_base(PerGroup, kind, b, h, bh, num_groups, GROUPS) + tl.sum(before, 0) + tl.cumsum(n, 0) - n
        at = start[:, None] + tl.cumsum(taken, 1) - 1
        ends = lst == lists - 1
        if kind == 0:
            Counts, Offsets, Indices = LiveCounts, LiveOffsets, Live
        elif kind == 1:
            Counts, Offsets, Indices = FullCounts, FullOffsets, Full
        else:
            Counts, Offsets, Indices = PartCounts, PartOffsets, Part
        tl.store(Counts + lst, n, mask=real)
        tl.store(Offsets + lst, start, mask=real)
        tl.store(Offsets + lists + 0 * lst, start + n, mask=ends)  # the last list closes the offsets
        tl.store(Indices + at, tl.zeros_like(at) + i[None, :], mask=taken != 0)


@triton.jit
def _write_list(Counts, Offsets, Indices, start, lst, lists, idx, entries):
    """List `lst` from `start`: its count, its offset (the last list also closes the offsets) and its entries
    (block numbers `idx` where `entries`), in block order."""
    taken = entries.to(tl.int32)
    at = start + tl.cumsum(taken, 0) - 1
    n = tl.sum(taken, 0)
    tl.store(Counts + lst, n)
    tl.store(Offsets + lst, start)
    tl.store(Offsets + lists, start + n, mask=lst == lists - 1)
    tl.store(Indices + at, idx, mask=taken != 0)


MAX_BLOCKS = 8192  # blocks along one side that a program of `layout_lists` holds in its registers

# The six kinds of entry one list counts, per list: live, full, partial without the causal flag, then with it
KINDS = 6
SUMMARY = 8  # ints a side's lists add up to: the KINDS totals and the longest live list of each flag


def layout_lists(layout: torch.Tensor, block_size: tuple, seq_len_q: int, seq_len_k: int, known=None):
    """The row and column lists of a bool layout `(B, H, Mq, Mk)` for both causal flags, on the GPU: one launch
    counts each list's kinds of entry (live, full, partial per flag, the classes of `mask_index.build_index`)
    on both sides, the host reads the six totals and the longest list of each side and flag (the one wait), one
    cumsum gives every list's end, and one launch writes the lists of both sides and flags. `known`: those
    totals and longest lists (`mask_index.LayoutSizes`) where the host has them already: no wait.

    Returns:
        `(lists, totals, longest)`: lists `{flag: (rows, cols)}`, each `(live, full, partial)` of `(counts,
        offsets, indices)` as in `mask_index.BlockIndex`; totals `{flag: (full, partial)}` and longest
        `{flag: (most live blocks of a row, of a column)}` (host ints).
    """
    B, H, Mq, Mk = layout.shape
    device, layout = layout.device, layout.contiguous()
    geometry = (H, Mq, Mk, *block_size, seq_len_q, seq_len_k)
    with _on(device):
        return _layout_lists(layout, B, H, Mq, Mk, device, geometry, known)


def _layout_lists(layout, B, H, Mq, Mk, device, geometry, known):
    """`layout_lists` on the layout's device (its current CUDA device)."""
    rows, cols = B * H * Mq, B * H * Mk  # lists of each side: programs [0, rows) take rows, the rest columns
    blocks = dict(BLOCK0=next_power_of_2(Mk), BLOCK1=next_power_of_2(Mq))
    # each kind's count per list, rows then columns (one table: one cumsum gives both sides' list ends)
    kinds = new_output((KINDS, rows + cols), torch.int32, device)
    # the counts' sums (atomics): read where the host does not know them, else never (no zeros needed)
    summary = (torch.zeros if known is None else new_output)(2 * SUMMARY, dtype=torch.int32, device=device)
    launch(_layout_counts_kernel, (rows + cols, ), (layout, kinds, summary, rows, cols, *geometry),
           dict(**blocks, SUMMARY=SUMMARY), WARPS, STAGES)
    if known is None:
        # the one wait: how many entries of each kind (both sides hold them all), and the longest live list of
        # each side and flag
        read = summary.tolist()
        totals, (row_f, row_t), (col_f, col_t) = read[:KINDS], read[KINDS:SUMMARY], read[SUMMARY + KINDS:]
    else:
        totals, ((row_f, col_f), (row_t, col_t)) = list(known.totals), (known.longest[False], known.longest[True])
    ends = torch.cumsum(kinds, 1, dtype=torch.int32)  # launched after the wait, behind the device's work
    sizes = {flag: tuple(totals[3 * flag + 1:3 * flag + 3]) for flag in (False, True)}  # (full, partial)
    made = {}  # (side, flag): the (counts, offsets, indices) of its live, full and partial lists, in one allocation
    keys = [(side, flag) for side in (0, 1) for flag in (False, True)]
    shapes = [shape for side, flag in keys for n in totals[3 * flag:3 * flag + 3]
              for shape in ((B, H, (Mq, Mk)[side]), (B * H * (Mq, Mk)[side] + 1,), (n,))]
    allocations, pieces = int32_arena(shapes, device, every_third(shapes))
    pieces = iter(pieces)
    for key in keys:
        made[key] = [(next(pieces), next(pieces), next(pieces)) for _ in range(3)]
    # the launch takes the shared allocation whole and each kind's entries: 16 tensors where every piece took 39
    # (each tensor argument costs the launch host time). A kind's counts and offsets take `kind_size` ints of the
    # shared allocation (as `int32_arena` pads them)
    kind_size = [-(-n // ALIGN) * ALIGN + -(-(n + 1) // ALIGN) * ALIGN for n in (rows, cols)]
    launch(_layout_write_kernel, (rows + cols, ),
           (layout, kinds, ends, *allocations, rows, cols, *kind_size, *totals, *geometry), dict(**blocks, ALIGN=ALIGN),
           WARPS, STAGES)
    out = {flag: (made[0, flag], made[1, flag]) for flag in (False, True)}
    return out, sizes, {False: (row_f, col_f), True: (row_t, col_t)}


@triton.jit
def _list_entries(Layout, lst, Mq, Mk, bq, bk, seq_len_q, seq_len_k, SIDE: tl.constexpr, BLOCK: tl.constexpr):
    """List `lst` of one side (0: row (b, h, i) over key blocks j; 1: column (b, h, j) over query blocks i):
    its block numbers, the blocks that are on, those of them partial without the causal flag, live with it (a
    causal pair) and partial with it: `mask_index.build_index`'s classes."""
    idx = tl.arange(0, BLOCK)
    if SIDE == 0:
        bh, i, j = lst // Mq, lst % Mq, idx
        ok = idx < Mk
        ptrs = Layout + (bh * Mq + i).to(tl.int64) * Mk + j
    else:
        bh, i, j = lst // Mk, idx, lst % Mk
        ok = idx < Mq
        ptrs = Layout + (bh * Mq + i).to(tl.int64) * Mk + j
    on = tl.load(ptrs, mask=ok, other=0) != 0
    q_first, k_first = i * bq, j * bk
    q_last = tl.minimum(q_first + bq, seq_len_q) - 1
    k_last = tl.minimum(k_first + bk, seq_len_k) - 1
    tail = (q_first + bq > seq_len_q) | (k_first + bk > seq_len_k)
    live_causal = on & (k_first <= q_last)  # a causal pair in the block
    return idx, on, on & tail, live_causal, live_causal & (tail | (k_last > q_first))


@triton.jit
def _count_list(Layout, Kinds, Totals, lst, stride, Mq, Mk, bq, bk, seq_len_q, seq_len_k, SIDE: tl.constexpr,
                BLOCK: tl.constexpr):
    """List `lst` of one side: how many entries of each kind it holds (`KINDS` rows of Kinds, `stride` apart),
    added into the side's Totals: the `KINDS` totals, then the longest live list without and with the causal
    flag."""
    idx, on, part, live_c, part_c = _list_entries(Layout, lst, Mq, Mk, bq, bk, seq_len_q, seq_len_k, SIDE, BLOCK)
    n = tl.sum(on.to(tl.int32), 0)
    p = tl.sum(part.to(tl.int32), 0)
    nc = tl.sum(live_c.to(tl.int32), 0)
    pc = tl.sum(part_c.to(tl.int32), 0)
    tl.store(Kinds + 0 * stride, n)
    tl.store(Kinds + 1 * stride, n - p)
    tl.store(Kinds + 2 * stride, p)
    tl.store(Kinds + 3 * stride, nc)
    tl.store(Kinds + 4 * stride, nc - pc)
    tl.store(Kinds + 5 * stride, pc)
    tl.atomic_add(Totals + 0, n)
    tl.atomic_add(Totals + 1, n - p)
    tl.atomic_add(Totals + 2, p)
    tl.atomic_add(Totals + 3, nc)
    tl.atomic_add(Totals + 4, nc - pc)
    tl.atomic_add(Totals + 5, pc)
    tl.atomic_max(Totals + 6, n)
    tl.atomic_max(Totals + 7, nc)


@triton.jit
def _layout_counts_kernel(Layout, Kinds, Summary, rows, cols, H, Mq, Mk, bq, bk, seq_len_q, seq_len_k,
                          BLOCK0: tl.constexpr, BLOCK1: tl.constexpr, SUMMARY: tl.constexpr):
    """Program p: row list p (p < rows), else column list p - rows (`_count_list`); Kinds `(KINDS, rows +
    cols)` holds the rows' counts, then the columns'; Summary the rows' `SUMMARY` ints, then the columns'."""
    p = tl.program_id(0)
    if p < rows:
        _count_list(Layout, Kinds + p, Summary, p, rows + cols, Mq, Mk, bq, bk, seq_len_q, seq_len_k, 0, BLOCK0)
    else:
        _count_list(Layout, Kinds + p, Summary + SUMMARY, p - rows, rows + cols, Mq, Mk, bq, bk, seq_len_q,
                    seq_len_k, 1, BLOCK1)


@triton.jit
def _write_kind(Counts, Offsets, Indices, Kinds, Ends, before, kind, stride, lst, lists, idx, entries):
    """One kind of list `lst`, which ends where `Ends` says less `before` (its count from `Kinds`; both
    tables' kinds `stride` apart): `_write_list`."""
    start = tl.load(Ends + kind * stride) - before - tl.load(Kinds + kind * stride)
    _write_list(Counts, Offsets, Indices, start, lst, lists, idx, entries)


@triton.jit
def _write_lists(Layout, Kinds, Ends, Counts, I0, I1, I2, I3, I4, I5, lst, lists, kind_size, stride, t0, t1, t2, t3, t4,
                 t5, Mq, Mk, bq, bk, seq_len_q, seq_len_k, SIDE: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    """List `lst` of one side: its live, full and partial lists for both causal flags (kinds 0-2: without the
    flag, 3-5: with it; `I0`..`I5` their entries), from one read of its layout row or column. The side's counts
    of kind k start at `Counts + k * kind_size`, their offsets `lists` (padded to ALIGN) after them. `t0`..`t5`:
    the entries of each kind before this side's (the columns': every row's)."""
    idx, on, part, live_c, part_c = _list_entries(Layout, lst, Mq, Mk, bq, bk, seq_len_q, seq_len_k, SIDE, BLOCK)
    after = tl.cdiv(lists, ALIGN) * ALIGN  # a kind's offsets follow its counts
    _write_kind(Counts, Counts + after, I0, Kinds, Ends, t0, 0, stride, lst, lists, idx, on)
    c = Counts + kind_size
    _write_kind(c, c + after, I1, Kinds, Ends, t1, 1, stride, lst, lists, idx, on ^ part)
    c += kind_size
    _write_kind(c, c + after, I2, Kinds, Ends, t2, 2, stride, lst, lists, idx, part)
    c += kind_size
    _write_kind(c, c + after, I3, Kinds, Ends, t3, 3, stride, lst, lists, idx, live_c)
    c += kind_size
    _write_kind(c, c + after, I4, Kinds, Ends, t4, 4, stride, lst, lists, idx, live_c ^ part_c)
    c += kind_size
    _write_kind(c, c + after, I5, Kinds, Ends, t5, 5, stride, lst, lists, idx, part_c)


@triton.jit
def _layout_write_kernel(Layout, Kinds, Ends, Shared, R0, R1, R2, R3, R4, R5, C0, C1, C2, C3, C4, C5, rows, cols,
                         row_kind, col_kind, t0, t1, t2, t3, t4, t5, H, Mq, Mk, bq, bk, seq_len_q, seq_len_k,
                         BLOCK0: tl.constexpr, BLOCK1: tl.constexpr, ALIGN: tl.constexpr):
    """Program p: the lists of row p (p < rows; R0..R5 the entries of its side's live, full and partial lists
    without, then with the causal flag), else of column p - rows (C0..C5). Every list's counts and offsets lie
    in Shared as `layout_lists` placed them: each side's (rows first) six kinds in order, `row_kind` (`col_kind`)
    ints a kind. Kinds and Ends `(KINDS, rows + cols)`: each list's counts and their running sums, rows first, so
    a column's ends are past every row's entries of their kind (`t0`..`t5`)."""
    p = tl.program_id(0)
    if p < rows:
        _write_lists(Layout, Kinds + p, Ends + p, Shared, R0, R1, R2, R3, R4, R5, p, rows, row_kind, rows + cols,
                     0, 0, 0, 0, 0, 0, Mq, Mk, bq, bk, seq_len_q, seq_len_k, 0, BLOCK0, ALIGN)
    else:
        _write_lists(Layout, Kinds + p, Ends + p, Shared + 6 * row_kind, C0, C1, C2, C3, C4, C5, p - rows, cols,
                     col_kind, rows + cols, t0, t1, t2, t3, t4, t5, Mq, Mk, bq, bk, seq_len_q, seq_len_k, 1, BLOCK1,
                     ALIGN)  # 6: `KINDS`


MAX_CHOOSE = 2048  # key blocks of a row that `choose_topk` ranks in one program (64 registers per thread at 4
# warps; longer rows take the torch choice)


RUNS_TILE = 128  # runs per program of `runs_layout`
RUN_STEP = 32  # blocks of each run that a step of `runs_layout` writes


def runs_layout(runs: torch.Tensor, heads: int, Mq: int, Mk: int) -> torch.Tensor:
    """bool `(1, heads, Mq, Mk)` on the device of `runs`, holding the blocks of the runs: one fill and one launch,
    where the torch operators take a dozen (`mask.layout_from_runs`, which gives the same layout).

    Args:
        runs: int64 `(3, n)`: the rows, starts and ends of `mask_index.BlockRuns` (row `h x Mq + i`, blocks
            `start .. end - 1`; an empty run, `end <= start`, holds none).

    Example:
        >>> runs = torch.tensor([[0, 1], [1, 0], [2, 2]], device="cuda")  # doctest: +SKIP
        >>> runs_layout(runs, 1, 2, 2)[0, 0].tolist()  # doctest: +SKIP
        [[False, True], [True, True]]
    """
    layout = torch.zeros(heads * Mq * Mk, dtype=torch.bool, device=runs.device)
    n = runs.shape[1]
    if n:
        with _on(runs.device):
            launch(_runs_layout_kernel, (cdiv(n, RUNS_TILE), ), (runs, layout, n, Mk),
                   dict(RUNS=RUNS_TILE, STEP=RUN_STEP), WARPS, STAGES)
    return layout.view(1, heads, Mq, Mk)


@triton.jit
def _runs_layout_kernel(Runs, Layout, n, Mk, RUNS: tl.constexpr, STEP: tl.constexpr):
    """`runs_layout`: runs `[pid x RUNS, +RUNS)`, STEP blocks of each per step, as many steps as the longest."""
    r = tl.program_id(0) * RUNS + tl.arange(0, RUNS)
    valid = r < n
    row = tl.load(Runs + r, mask=valid, other=0)
    start = tl.load(Runs + n + r, mask=valid, other=0)
    length = tl.where(valid, tl.load(Runs + 2 * n + r, mask=valid, other=0) - start, 0)
    first = Layout + row * Mk + start  # int64: rows x Mk may pass 2**31
    step = tl.arange(0, STEP)
    for at in range(0, tl.max(length, 0), STEP):
        inside = (at + step)[None, :] < length[:, None]
        tl.store(first[:, None] + (at + step)[None, :], inside, mask=inside)  # True wherever it stores


FIXED_TILE = 1024  # key blocks per program of `fixed_layout`


def fixed_layout(layout: torch.Tensor, local: int, width: int, patterns: int, causal: bool,
                 horizontal: bool) -> torch.Tensor:
    """`masks.fixed`'s layout written into `layout` (bool `(H, M, M)`, contiguous) in one launch, where the torch
    operators take some fifteen: windows of `local` blocks, in each the `width` global columns of head h's
    pattern `h % patterns` (those of a partial last window clamped to the grid's end), with `horizontal` also
    global rows, with `causal` the lower triangle. The same layout as `masks.fixed`'s torch operators
    (tests/test_layout.py compares them under TRITON_INTERPRET=1).

    Example:
        >>> out = fixed_layout(torch.empty(1, 8, 8, dtype=torch.bool, device="cuda"), 4, 1, 1, False, False)  # doctest: +SKIP
    """
    H, M, _ = layout.shape
    if layout.numel():
        with _on(layout.device):
            launch(_fixed_layout_kernel, (H * M * cdiv(M, FIXED_TILE),), (layout, M, local, width, patterns),
                   dict(CAUSAL=causal, HORIZONTAL=horizontal, TILE=FIXED_TILE), WARPS, STAGES)
    return layout


@triton.jit
def _fixed_columns(j, p, M, local, width):
    """Whether blocks `j` are global columns of pattern `p` (`masks.fixed._global_columns`)."""
    offset = j % local
    first = local - (1 + p) * width
    cols = (j - offset + local <= M) & (offset >= first) & (offset < first + width)  # windows that fit the grid
    last = (M - 1) // local * local  # the last window's first block
    start = tl.minimum(last + local - (1 + p) * width, tl.maximum(M - width, 0))
    return cols | ((last + local > M) & (j >= start) & (j < start + width))  # a partial last window


@triton.jit
def _fixed_layout_kernel(Layout, M, local, width, patterns, CAUSAL: tl.constexpr, HORIZONTAL: tl.constexpr,
                         TILE: tl.constexpr):
    """`fixed_layout`: row i of head h, key blocks `[t * TILE, +TILE)`, program `(h * M + i) * tiles + t`."""
    tiles = tl.cdiv(M, TILE)
    row, t = tl.program_id(0) // tiles, tl.program_id(0) % tiles
    h, i = row // M, row % M
    p = h % patterns
    j = t * TILE + tl.arange(0, TILE)
    on = (i // local) == (j // local)
    cols = _fixed_columns(j, p, M, local, width)
    if CAUSAL:
        on = (on | cols) & (j <= i)
    else:
        on = on | cols
    if HORIZONTAL:
        on = on | _fixed_columns(i, p, M, local, width)
    tl.store(Layout + row.to(tl.int64) * M + j, on, mask=j < M)


HASH_BLOCK = 1024  # positions per program of `hash_into`


def hash_into(out: torch.Tensor, words: tuple[int, int]) -> torch.Tensor:
    """`masks._common.hash_draws` written into `out` (int64, contiguous) or `uniform_draws` of an int seed
    (`out` float32): the hash of every position `[0, out.numel())` and the seed's two 32-bit `words`
    (`masks._common._seed_words`), in one launch where the torch operators take some forty (32-bit unsigned
    arithmetic wraps as their masked int64 arithmetic does: the same numbers, tests/test_masks.py).

    Example:
        >>> out = hash_into(torch.empty(4, dtype=torch.int64, device="cuda"), (1, 2))  # doctest: +SKIP
    """
    n = out.numel()
    if n:
        signed = [w - (1 << 32) if w >= 1 << 31 else w for w in words]  # int32 bit patterns
        with _on(out.device):
            launch(_hash_kernel, (cdiv(n, HASH_BLOCK),), (out, n, *signed),
                   dict(UNIFORM=out.dtype == torch.float32, BLOCK=HASH_BLOCK), WARPS, STAGES)
    return out


@triton.jit
def _fmix32(x):
    """MurmurHash3's 32-bit finaliser on uint32 `x` (its products wrap modulo 2**32)."""
    x ^= x >> 16
    x *= 0x85EBCA6B
    x ^= x >> 13
    x *= 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit(do_not_specialize=["first", "second"])
def _hash_kernel(Out, n, first, second, UNIFORM: tl.constexpr, BLOCK: tl.constexpr):
    """`hash_into`: positions `[pid * BLOCK, +BLOCK)`; a float32 draw keeps the top 24 bits, times 2**-24."""
    pos = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = pos.to(tl.uint32) * 0x9E3779B1 + first.to(tl.uint32, bitcast=True)
    x = _fmix32(_fmix32(x) + second.to(tl.uint32, bitcast=True))
    if UNIFORM:
        tl.store(Out + pos, (x >> 8).to(tl.float32) * 5.9604644775390625e-08, mask=pos < n)
    else:
        tl.store(Out + pos, x.to(tl.int64), mask=pos < n)


def choose_supported(cols: int, dtype: torch.dtype) -> bool:
    """Whether one program can rank a row of `cols` key blocks of scores of `dtype` (`choose_topk`): it ranks
    32-bit keys, so float64 scores, which would round to ties (or to infinities) there, take the torch sort."""
    return dtype != torch.float64 and next_power_of_2(cols) <= MAX_CHOOSE


def choose_topk(scores: torch.Tensor, counts: torch.Tensor, width: int, causal: bool, cand: torch.Tensor):
    """`mask._choose_topk` and the layout it marks, one program per row: `(selected, layout)`, int64
    `(B, H, Mq, width)` (each row's kept key blocks ascending, then Mk) and bool `(B, H, Mq, Mk)`.

    A row ranks its candidates by score, higher first and lower key block among equals (NaN as -inf, -0.0 as
    0.0), keeps `counts[g, i]` of them (with `causal`, the diagonal `cand[i] - 1` and the best `counts - 1`
    before it), sorts them and marks them in its layout row. The last kept score is found bit by bit, one
    counting reduction per bit, until exactly the blocks to keep reach the bits found (about 15 bits for
    scores drawn at random; all 32 and a prefix count for ties). A row of up to 512 key blocks is one warp's,
    so its reductions need no shared memory (several rows per program, or several warps per row, measured
    slower: tuning log, step 78).
    """
    if torch.compiler.is_compiling():
        return _choose_topk_op(scores, counts, cand, width, causal)
    return _choose_topk(scores, counts, cand, width, causal)


def _choose_topk(scores, counts, cand, width: int, causal: bool):
    """`choose_topk`'s launch."""
    B, H, Mq, Mk = scores.shape
    device = scores.device
    selected = new_output((B, H, Mq, width), torch.int64, device)
    layout = new_output((B, H, Mq, Mk), torch.bool, device)
    block = next_power_of_2(Mk)
    with _on(device):
        launch(_choose_topk_kernel, (B * H * Mq, ),
               (scores.contiguous(), counts.contiguous(), cand.contiguous(), selected, layout, H, counts.shape[0], Mq,
                Mk, width),
               dict(CAUSAL=causal, BLOCK=block), max(1, block // 512), STAGES)
    return selected, layout


@triton.jit
def _choose_topk_kernel(Scores, Counts, Cand, Selected, Layout, H, num_groups, Mq, Mk, width, CAUSAL: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Program r = (b * H + h) * Mq + i: row r's choice. Each score becomes an unsigned key ascending with the
    float (candidates only; everything else 0, below every candidate). A threshold `t` is built from its
    highest bit down, a bit kept when at least `take` keys reach the value with it, until exactly `take` keys
    reach `t` (they are the row's choice) or every bit is set (`t` is then the take-th largest key: the row
    keeps the keys above it and, of those equal to it, the lowest blocks up to `take`). The kept blocks
    leave in ascending order by a prefix count."""
    r = tl.program_id(0)
    h, i = (r // Mq) % H, r % Mq
    g = tl.where(num_groups > 1, h, 0)
    n = tl.load(Counts + g * Mq + i)
    last = tl.load(Cand + i) - 1  # the diagonal of a causal row
    j = tl.arange(0, BLOCK)
    s = tl.load(Scores + r.to(tl.int64) * Mk + j, mask=j < Mk, other=float("-inf")).to(tl.float32)
    s = tl.where(s != s, float("-inf"), s) + 0.0  # NaN ranks as -inf; -0.0 as 0.0
    if CAUSAL:
        candidate = j < last  # the diagonal is kept apart, blocks past it never
        take = n - 1
    else:
        candidate = j < Mk
        take = n
    bits = s.to(tl.int32, bitcast=True)
    # a negative float has every bit flipped, a positive one its sign bit: ascending as unsigned; -inf is
    # 0x007FFFFF, above the 0 of non-candidates
    key = (bits ^ ((bits >> 31) | -2147483648)).to(tl.uint32, bitcast=True)
    key = tl.where(candidate, key, tl.zeros_like(key))
    t = tl.zeros([], tl.uint32)
    reach = tl.full([], BLOCK, tl.int32)  # keys >= t
    bit = 31
    while (bit >= 0) & (reach != take):
        c = t | (tl.full([], 1, tl.uint32) << bit)
        at_c = tl.sum((key >= c).to(tl.int32), 0)
        t = tl.where(at_c >= take, c, t)
        reach = tl.where(at_c >= take, at_c, reach)
        bit -= 1
    above = key > t  # fewer than `take` (take <= 0: t ends at 0xFFFFFFFF, which no key reaches)
    tie = key == t
    need = take - tl.sum(above.to(tl.int32), 0)
    kept = tl.where(reach == take, key >= t, above | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= need)))
    if CAUSAL:
        on = kept | ((j == last) & (n > 0))
    else:
        on = kept
    tl.store(Layout + r.to(tl.int64) * Mk + j, on, mask=j < Mk)
    # the `take` kept blocks ascending first, each at its place among them (a prefix count, not a sort), then
    # the diagonal of a causal row and Mk for the unused places
    place = tl.cumsum(kept.to(tl.int32), 0) - 1
    out = Selected + r.to(tl.int64) * width
    tl.store(out + place, j.to(tl.int64), mask=kept)
    rest = tl.full([BLOCK], Mk, tl.int64)
    if CAUSAL:
        rest = tl.where((j == take) & (n > 0), last.to(tl.int64), rest)
    tl.store(out + j, rest, mask=(j >= take) & (j < width))


# Inside torch.compile. Dynamo cannot trace the direct launches (`launch`), and inductor's fusion of the torch
# operators that build the same choice and lists took 0.43-0.91 ms of GPU time at 32,768-65,536 tokens, where
# the launches take 34-78 us (both replayed from CUDA graphs; tuning log, steps 62 and 78). So the
# builders whose output sizes the host knows (a top-k mask's choice, lists and plans) run there as custom ops:
# each op's fake implementation only allocates its outputs, its real one launches as outside torch.compile. A
# custom op's outputs may not alias each other: an op whose outputs are pieces of allocations returns those
# (`int32_arena`), which the caller cuts (`pieces_of`) outside the op.

@torch.library.custom_op("sparse_flash::choose_topk", mutates_args=())
def _choose_topk_op(scores: torch.Tensor, counts: torch.Tensor, cand: torch.Tensor, width: int,
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _choose_topk(scores, counts, cand, width, causal)


@_choose_topk_op.register_fake
def _(scores, counts, cand, width, causal):
    B, H, Mq, Mk = scores.shape
    return scores.new_empty((B, H, Mq, width), dtype=torch.int64), scores.new_empty(scores.shape, dtype=torch.bool)


@torch.library.custom_op("sparse_flash::topk_lists", mutates_args=())
def _topk_lists_op(selected: torch.Tensor, counts: torch.Tensor, partial: torch.Tensor, per_group: torch.Tensor,
                   cols: int, sizes: list[int]) -> list[torch.Tensor]:
    B, H, Mq, _ = selected.shape
    kind = torch.zeros((B * H * cols, Mq), dtype=torch.int8, device=selected.device)  # the op's own: no mutation
    return _topk_lists(selected, counts, partial, cols, tuple(sizes), kind, per_group,
                       topk_list_shapes(selected.shape, cols, sizes))[0]


@_topk_lists_op.register_fake
def _(selected, counts, partial, per_group, cols, sizes):
    shapes = topk_list_shapes(selected.shape, cols, sizes)
    return int32_arena(shapes, selected.device, every_third(shapes))[0]


_PLAN_TENSORS = 7  # a `PlanInput`'s tensors: counts, then full's and part's (counts, offsets, indices)


@torch.library.custom_op("sparse_flash::unsplit_plans", mutates_args=())
def _unsplit_plans_op(flat: list[torch.Tensor], heavy_above: list[float],
                      longest: int) -> list[torch.Tensor]:
    """The allocations of the plans' pieces (`int32_arena`), then every plan's count of heavy lists."""
    n = _PLAN_TENSORS
    plans = [PlanInput(flat[n * p], tuple(flat[n * p + 1:n * p + 4]), tuple(flat[n * p + 4:n * p + 7]), heavy)
             for p, heavy in enumerate(heavy_above)]
    allocations, leads, _ = _unsplit_plans(plans, longest, [shape for plan in plans
                                                             for shape in unsplit_plan_shapes(plan.counts)])
    return [*allocations, leads]


@_unsplit_plans_op.register_fake
def _(flat, heavy_above, longest):
    shapes = [shape for counts in flat[::_PLAN_TENSORS] for shape in unsplit_plan_shapes(counts)]
    counts = flat[0]
    return [*int32_arena(shapes, counts.device, _items_of(shapes))[0],
            counts.new_empty(len(heavy_above), dtype=torch.int32)]

"""Work items of the Hopper (Gluon) kernels: which tiles an item walks, the order items start in, and the
placement of items on the resident programs (torch, and one small Triton kernel that places them on the GPU
without a host synchronisation).

Both kernel families take the cutting of very long lists from the mask's own work plans
(`sparse_flash.mask_index.WorkPlan`); the Gluon kernels' resident programs need items placed by load, built
here from the same index lists and plans (`row_items`, `column_items`, `split_items`).
"""

from __future__ import annotations

import contextlib
import heapq

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

from ..mask_index import HEAVY_FACTOR, ITEM_FIELDS, BlockIndex, KernelIndex, MaskGeometry
from . import settings
from .launch import cdiv, launch, next_power_of_2
from .memory import new_output

# Time per item besides its key tiles (Q load, first S, last O += P V, O store), in key tiles, for balancing:
# 3.2 us against 1.74 us per tile, fitted on local masks of 3 and 9 blocks per row (tuning log, step 44).
ITEM_COST = 2
ITEM_WIDTH = 8  # int32 fields of a Gluon item record: the six of `row_items` or `column_items`, the scratch place
# of a chunk of a split list (-1: the item writes its output; `split_items`), padding
BUNDLES_PER_PROGRAM = 16  # runs of items per program that the balancing places (bounds its host time)
ROW_BLOCK = 128  # query rows per item of the kernels that walk row lists (`row_items`), and key rows per list tile
# Causal calls of at most this many tokens per head start their items in (batch, head) order, longer ones longest
# first (`longest_first`; tuning log, step 111)
HEAD_ORDER_TOKENS = 4096


def list_ranges(full: BlockIndex, part: BlockIndex, lists):
    """(full start, full end, partial start, partial end) of the given lists (any shape of list numbers) in
    the full and partial lists of a `KernelIndex`."""
    full_off, part_off = full.offsets.long(), part.offsets.long()
    return full_off[lists], full_off[lists + 1], part_off[lists], part_off[lists + 1]


def row_items(B, Hq, Hkv, Nq, Nk, causal: bool, index: KernelIndex | None, geometry: MaskGeometry | None, device):
    """int32 `(items, 6)` records, one per ROW_BLOCK-row query tile of each (batch, head): (first Q/O/LSE
    row, first K/V row of its head, full list start, full list end, partial list start, partial list end);
    lists count mask blocks of the tile's mask row (`index.row_full`, `index.row_partial`), or for the dense path (None)
    ROW_BLOCK-key tiles (causal: the tile on the diagonal is the partial list).

    Order (`order_items`): heavy lists first, then by (batch, head) and query tile, so that the programs in
    flight share one head's K and V in L2; causal calls longest list first where `longest_first` says so.
    """
    tiles = Nq // ROW_BLOCK
    b = torch.arange(B, device=device).view(B, 1, 1)
    h = torch.arange(Hq, device=device).view(1, Hq, 1)
    i = torch.arange(tiles, device=device).view(1, 1, tiles)
    shape = (B, Hq, tiles)
    q_row = ((b * Hq + h) * Nq + i * ROW_BLOCK).expand(shape)
    kv_row = ((b * Hkv + h // (Hq // Hkv)) * Nk).expand(shape)
    if index is None:  # dense: key tiles [0, Nk / ROW_BLOCK), or below and on the diagonal when causal
        key_tiles = Nk // ROW_BLOCK
        lo = torch.zeros(shape, dtype=torch.long, device=device)
        hi = (i.clamp(max=key_tiles) if causal else torch.full_like(i, key_tiles)).expand(shape)
        plo, phi = (hi, (i + 1).clamp(max=key_tiles).expand(shape)) if causal else (lo, lo)
    else:
        g = geometry
        row = (((b % g.batch) * g.heads + h % g.heads) * g.blocks_q + (i * ROW_BLOCK) // g.block_q).expand(shape)
        lo, hi, plo, phi = list_ranges(index.row_full, index.row_partial, row)  # each tile's mask row
    return order_items(torch.stack([q_row, kv_row, lo, hi, plo, phi], -1).reshape(-1, 6),
                       longest_first(causal, Nq, Nk))


def column_items(B, Hq, Hkv, Nq, Nk, causal: bool, index: KernelIndex | None, geometry: MaskGeometry | None, device,
                 BLOCK_N: int, BLOCK_M: int):
    """int32 `(items, 6)` records, one per BLOCK_N-key tile of each (batch, KV head): (first K/V row, first Q
    row of the group's first query head, full list start, end, partial list start, end). Lists count mask
    blocks of the column (`index.col_full`, `index.col_partial`), or BLOCK_M-row query tiles for the dense
    path (index None; causal: the tiles on the diagonal are the partial list). Order: `order_items`, as
    `row_items`."""
    G = Hq // Hkv
    tiles = Nk // BLOCK_N
    b = torch.arange(B, device=device).view(B, 1, 1)
    hk = torch.arange(Hkv, device=device).view(1, Hkv, 1)
    n = torch.arange(tiles, device=device).view(1, 1, tiles)
    shape = (B, Hkv, tiles)
    kv_row = ((b * Hkv + hk) * Nk + n * BLOCK_N).expand(shape)
    q_row0 = ((b * Hq + hk * G) * Nq).expand(shape)
    if index is None:
        q_tiles = Nq // BLOCK_M
        if causal:  # query tiles that see these keys start at the tile holding the first key
            plo = (n * BLOCK_N // BLOCK_M).clamp(max=q_tiles).expand(shape)
            phi = ((n + 1) * BLOCK_N // BLOCK_M).clamp(max=q_tiles).expand(shape)
            lo, hi = phi, torch.full_like(phi, q_tiles)
        else:
            lo = plo = phi = torch.zeros(shape, dtype=torch.long, device=device)
            hi = torch.full(shape, q_tiles, dtype=torch.long, device=device)
    else:
        g = geometry
        col = (((b % g.batch) * g.heads + hk % g.heads) * g.blocks_k + (n * BLOCK_N) // g.block_k).expand(shape)
        lo, hi, plo, phi = list_ranges(index.col_full, index.col_partial, col)  # each tile's mask column
    return order_items(torch.stack([kv_row, q_row0, lo, hi, plo, phi], -1).reshape(-1, 6),
                       longest_first(causal, Nq, Nk))


def split_items(along: str, B, Hq, Hkv, Nq, Nk, index: KernelIndex, geometry: MaskGeometry, copy_strides,
                copies: int, device, BLOCK: int, unit: int = 1):
    """Item records of a mask whose work plan splits lists (`mask_index.WorkPlan`: the one policy that cuts
    long lists, for both kernel families), and the merge records.

    `along="rows"` (forward, dQ): an item is a BLOCK-row query tile of one (batch, query head) and walks its
    mask row's lists; `along="cols"` (dK/dV): a BLOCK-key tile of one (batch, KV head) that walks its mask
    column's lists for every query head of its group. Each chunk of a split list is an item of its own, taken
    from the plan's records (`WorkPlan.items`); chunks first, then the rest by (batch, head).

    Records have ITEM_WIDTH int32 fields: the six of `row_items` or `column_items`, then the chunk's scratch
    place (-1: not split) and padding. The scratch of chunk slot `slot` (`WorkPlan.slots`) and copy `copy` (a
    (batch, head) sharing the mask: `copy_strides`, `copies` from `split.SplitPlan`) starts at row
    `(slot * copies + copy) * mask block`, the item's tile `s * BLOCK` rows further; the field holds that row
    divided by `unit` (1: a row, BLOCK: a BLOCK-row scratch tile). One merge record per (tile of a split
    list, copy): (first output row, first slot, number of chunks, copy, tile within its mask block).

    Example (the tile slots of the backward's `merge.ChunkSum`; `mask_index.SPLIT_*` patched to cut every
    list of more than 3 blocks into 2 chunks): rows 0 and 2 hold 4 blocks, rows 1 and 3 hold 3.
        >>> from unittest import mock
        >>> from sparse_flash import masks, mask_index
        >>> with mock.patch.multiple(mask_index, SPLIT_MIN_CHUNK=3, SPLIT_FACTOR=0, SPLIT_MAX_CHUNKS=2):
        ...     m = masks.longformer(512, 128, global_block_indices=[0])
        ...     index, geometry = m.kernel_index(False), m.kernel_geometry(False)
        >>> items, merges = split_items("rows", 1, 1, 1, 512, 512, index, geometry, (1, 1), 1, "cpu", 128, 128)
        >>> items[:, [0, 2, 3, 6]].tolist()  # (first row, full list range, scratch tile): chunks first
        [[0, 0, 2, 0], [0, 2, 4, 1], [256, 7, 9, 2], [256, 9, 11, 3], [128, 4, 7, -1], [384, 11, 14, -1]]
        >>> merges.tolist()  # (first row, first slot, chunks, copy, tile)
        [[0, 0, 2, 0, 0], [256, 2, 2, 0, 0]]
    """
    rows = along == "rows"
    plan_items = (index.row_plan if rows else index.col_plan).items  # (Bm|1, Hm|1, W, fields)
    block = geometry.block_q if rows else geometry.block_k
    H, N, G = (Hq if rows else Hkv), (Nq if rows else Nk), Hq // Hkv
    sub = block // BLOCK
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    s = torch.arange(sub, device=device).view(1, 1, 1, sub)
    mask_b = torch.arange(B, device=device).view(B, 1) % plan_items.shape[0]
    mask_h = torch.arange(H, device=device).view(1, H) % plan_items.shape[1]
    rec = plan_items[mask_b, mask_h].long()  # (B, H, W, fields): each (batch, head)'s records
    shape = (B, H, rec.shape[2], sub)

    def field(name):
        return rec[..., ITEM_FIELDS.index(name)].unsqueeze(-1).expand(shape)

    block_no, chunk, slot = field("block"), field("chunk"), field("slot")
    own_row = (b * H + h) * N + block_no.clamp(min=0) * block + s * BLOCK
    other_row = ((b * Hkv + h // G) * Nk if rows else (b * Hq + h * G) * Nq).expand(shape)
    copy = (b * copy_strides[0] + h * copy_strides[1]).expand(shape)
    scratch = torch.where(slot >= 0, ((slot * copies + copy) * block + s * BLOCK) // unit, -1)
    items = torch.stack([own_row, other_row, field("full_lo"), field("full_hi"), field("part_lo"), field("part_hi"),
                         scratch, torch.zeros_like(scratch)], -1)
    valid = block_no >= 0  # padding records walk nothing
    items = items[valid]
    order = torch.argsort((items[:, 6] < 0).to(torch.int8), stable=True)
    first = (chunk == 0) & (slot >= 0) & valid
    merges = torch.stack([own_row, slot, field("chunks"), copy, s.expand(shape)], -1)[first]
    return items[order].to(torch.int32).contiguous(), merges.to(torch.int32).contiguous()


def whole_items(items):
    """`row_items` or `column_items` records as ITEM_WIDTH-field records of items that are not chunks
    (scratch place -1), for a mask whose plans split nothing or the dense path."""
    return torch.cat([items, torch.full_like(items[:, :1], -1), torch.zeros_like(items[:, :1])], 1).contiguous()


def longest_first(causal: bool, Nq: int, Nk: int) -> bool:
    """Whether a call's work items start longest list first (`order_items`): causal calls, whose lists grow
    along the diagonal, where the programs take their items in turn (without `settings.hopper_balance` the
    long ones must not come last) or the heads are longer than HEAD_ORDER_TOKENS. With the balancing, which
    places items by load whatever their order, a causal call of 4,096 tokens runs 2-7% faster with its items
    in (batch, head) order, forward and backward (the programs in flight share fewer heads' K and V), and one
    of 16,384 tokens 2-3% slower (tuning log, step 111).

    Example:
        >>> longest_first(True, 4096, 4096), longest_first(True, 16384, 16384), longest_first(False, 16384, 16384)
        (False, True, False)
    """
    return causal and (max(Nq, Nk) > HEAD_ORDER_TOKENS or not settings.current().hopper_balance)


def order_items(items, longest: bool):
    """Items (fields 2-5: full and partial list ranges) in the order they start: with `longest`
    (`longest_first`) longest list first; otherwise heavy lists first (longer than `mask_index.HEAVY_FACTOR` x
    the mean, as the Triton kernels' work plans start them), then as given (by (batch, head) and tile, so
    that the programs in flight share one head's tensors in L2). Returns int32 records."""
    length = items[:, 3] - items[:, 2] + items[:, 5] - items[:, 4]
    if longest:
        order = torch.argsort(-length, stable=True)
    else:
        heavy = length > HEAVY_FACTOR * length.float().mean()
        order = torch.argsort((~heavy).to(torch.int8), stable=True)
    return items[order].to(torch.int32).contiguous()


def assign_programs(items, num_programs: int, sub: int):
    """Items regrouped by the resident program that runs them, and `starts` (int32, `num_programs + 1`):
    program p runs items [starts[p], starts[p + 1]).

    The programs never wait for each other, so the call lasts as long as the most loaded one. A program's
    load counts its items' tiles (list length x `sub`) plus ITEM_COST each. With `settings.hopper_balance`:
    runs of consecutive items (about BUNDLES_PER_PROGRAM runs per program, so that the placement stays short;
    each chunk of a split list, `split_items`, is a run of its own) go heaviest first to the least loaded
    program (`deal_runs`); each program then takes its runs in their order in `items` (as `order_items` left
    them). Without it, item i goes to program i % num_programs, whatever its length.

    On a GPU every step is a tensor operation or kernel on the items' device: no host synchronisation, so a
    mask built per call (`BlockMask.from_topk`) does not stall the GPU here.

    Example:
        >>> items = torch.tensor([[0, 0, 0, n, 0, 0] for n in (8, 1, 1, 1, 1, 1)], dtype=torch.int32)
        >>> placed, starts = assign_programs(items, 2, 2)
        >>> starts.tolist()  # the 8-block list alone on program 0 (17 tiles against 5 x 3)
        [0, 1, 6]
    """
    n, dev = items.shape[0], items.device
    position = torch.arange(n, device=dev)
    program = position % num_programs
    if settings.current().hopper_balance and n > num_programs:
        cost = (items[:, 3] - items[:, 2] + items[:, 5] - items[:, 4]).long() * sub + ITEM_COST
        run = -(-n // (BUNDLES_PER_PROGRAM * num_programs))  # items per run
        new_run = position % run == 0
        if items.shape[1] > 6:  # a chunk of a split list (`split_items`) is a run of its own
            chunk = items[:, 6] >= 0
            new_run |= chunk | torch.cat([chunk.new_zeros(1), chunk[:-1]])
        run_of = torch.cumsum(new_run.long(), 0) - 1  # at most n runs: the unused ones cost 0
        run_cost = torch.zeros(n, dtype=torch.long, device=dev).index_add_(0, run_of, cost)
        order = torch.argsort(run_cost, descending=True, stable=True)  # heaviest first, ties in item order
        owner = torch.empty_like(position).scatter_(0, order, deal_runs(run_cost[order], num_programs))
        program = owner[run_of]
    order = torch.argsort(program, stable=True)  # by program, each program's items in their order in `items`
    counts = torch.zeros(num_programs, dtype=torch.int32, device=dev).index_add_(
        0, program, torch.ones(n, dtype=torch.int32, device=dev))
    starts = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0, dtype=torch.int32)])
    return items[order].contiguous(), starts


def item_count(along: str, B, Hq, Hkv, Nq, Nk, BLOCK_N: int = ROW_BLOCK) -> int:
    """The work items of a call whose lists no program splits: one per tile of each (batch, head), ROW_BLOCK
    query rows (`along="rows"`) or BLOCK_N key rows (`"cols"`)."""
    return B * Hq * (Nq // ROW_BLOCK) if along == "rows" else B * Hkv * (Nk // BLOCK_N)


def whole_plan(along: str, B, Hq, Hkv, Nq, Nk, causal: bool, index: KernelIndex | None,
               geometry: MaskGeometry | None, device, num_programs: int, sub: int, BLOCK_N: int = ROW_BLOCK,
               BLOCK_M: int = ROW_BLOCK):
    """The placed items and starts (`assign_programs`) of a call whose lists no program splits: the records
    of `row_items` (`along="rows"`) or `column_items` (`"cols"`, key tiles of BLOCK_N, dense query tiles of
    BLOCK_M) as `whole_items`, placed on `num_programs` programs at `sub` tiles per list block.

    For a mask's lists on a GPU with `settings.gpu_index` (outside torch.compile, at most MAX_ITEMS items) Triton
    programs build, order and place them (`placed_items`, the same records): a mask built per call
    (`BlockMask.from_topk`) pays one or two launches per plan instead of about sixty small operators, which the
    H200 profile of a MoBA step found to cost more host time than the Hopper kernels gain (tuning log, step 62)."""
    n = item_count(along, B, Hq, Hkv, Nq, Nk, BLOCK_N)
    on_gpu = (index is not None and torch.device(device).type == "cuda" and not torch.compiler.is_compiling()
              and settings.current().gpu_index and n <= MAX_ITEMS)
    if on_gpu:
        side = (index.row_full, index.row_partial) if along == "rows" else (index.col_full, index.col_partial)
        return placed_items(along, B, Hq, Hkv, Nq, Nk, causal, *side, geometry, num_programs, sub, BLOCK_N)
    if along == "rows":
        items = row_items(B, Hq, Hkv, Nq, Nk, causal, index, geometry, device)
    else:
        items = column_items(B, Hq, Hkv, Nq, Nk, causal, index, geometry, device, BLOCK_N, BLOCK_M)
    return assign_programs(whole_items(items), num_programs, sub)


MAX_ITEMS = 8192  # work items that one program of `_deal_items_kernel` places


def placed_items(along: str, B, Hq, Hkv, Nq, Nk, causal: bool, full: BlockIndex, part: BlockIndex,
                 geometry: MaskGeometry, num_programs: int, sub: int, BLOCK_N: int = ROW_BLOCK):
    """`whole_plan`'s records and starts without a host synchronisation: `full`, `part` are the mask's full
    and partial lists of that side. Many programs put each item at its place in the start order, counting the
    items that start before it (`_order_items_kernel`; without the balancing they place it too), and with the
    balancing one program deals the runs (`_deal_items_kernel`): no sort of the items, which in one program's
    registers took ~180 us at 4,096 items on the H200 (tuning log, step 92).

    Kept while the mask's lists live, per call signature and balancing setting: the forward and the dQ pass
    place the same row items, which a mask chosen per call would otherwise pay twice (one launch of ~0.2 ms
    at 4,096 items on the H200). Not kept from inside a CUDA-graph capture, whose launches write only when the
    graph is replayed."""
    balance = settings.current().hopper_balance and item_count(along, B, Hq, Hkv, Nq, Nk, BLOCK_N) > num_programs
    key = (along, B, Hq, Hkv, Nq, Nk, causal, part.offsets.data_ptr(), geometry, num_programs, sub, BLOCK_N, balance)
    kept = _PLACED.get(full.offsets)
    if kept is not None and key in kept:
        return kept[key]
    made = _placed_items(along, B, Hq, Hkv, Nq, Nk, causal, full, part, geometry, num_programs, sub, BLOCK_N,
                         balance)
    if not (full.offsets.is_cuda and torch.cuda.is_current_stream_capturing()):
        if kept is None:
            kept = _PLACED[full.offsets] = {}
        kept[key] = made
    return made


_PLACED = WeakIdKeyDictionary()  # a mask's full offsets (of one side and flag) -> {call signature: placed items}


def _placed_items(along: str, B, Hq, Hkv, Nq, Nk, causal: bool, full: BlockIndex, part: BlockIndex,
                  geometry: MaskGeometry, num_programs: int, sub: int, BLOCK_N: int, balance: bool):
    """`placed_items`' launch."""
    G, g = Hq // Hkv, geometry
    if along == "rows":
        heads, tiles, n_own, other_heads, mul, div, n_other = Hq, Nq // ROW_BLOCK, Nq, Hkv, 1, G, Nk
        blocks, block, tile = g.blocks_q, g.block_q, ROW_BLOCK
    else:
        heads, tiles, n_own, other_heads, mul, div, n_other = Hkv, Nk // BLOCK_N, Nk, Hq, G, 1, Nq
        blocks, block, tile = g.blocks_k, g.block_k, BLOCK_N
    n = B * heads * tiles
    device = full.offsets.device
    BLOCK = next_power_of_2(n)
    run = -(-n // (BUNDLES_PER_PROGRAM * num_programs))  # items per run, as `assign_programs` cuts them
    RUNS = next_power_of_2(-(-n // run))
    PROGRAMS = next_power_of_2(num_programs)
    scratch = new_output(7 * BLOCK + 3 * RUNS + PROGRAMS, torch.int32, device)
    placed = new_output((n, ITEM_WIDTH), torch.int32, device)
    starts = new_output(num_programs + 1, torch.int32, device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():  # Triton's current device
        launch(_order_items_kernel, (cdiv(n, ORDER_ITEMS), ),
               (full.offsets, part.offsets, scratch, placed, starts, n, tiles, heads, n_own, other_heads, mul, div,
                n_other, g.batch, g.heads, blocks, block, num_programs, float(HEAVY_FACTOR)),
               dict(LONGEST=longest_first(causal, Nq, Nk), BALANCE=balance, TILE=tile, ITEMS=ORDER_ITEMS,
                    CHUNK=ORDER_CHUNK, PROGRAMS=PROGRAMS), 4, 3)
        if balance:
            launch(_deal_items_kernel, (1, ), (scratch, placed, starts, n, num_programs, run, sub),
                   dict(ITEM_COST=ITEM_COST, BLOCK=BLOCK, RUNS=RUNS, PROGRAMS=PROGRAMS),
                   max(4, min(32, BLOCK // 256)), 3)
    return placed, starts


ORDER_ITEMS, ORDER_CHUNK = 64, 128  # items that one program of `_order_items_kernel` ranks, against this many at a time


def deal_runs(costs, num_programs: int):
    """The program of each run, for int64 `costs` sorted heaviest first: each run in turn goes to the least
    loaded program so far, the lowest-numbered among equals (greedy longest-processing-time placement, which
    keeps the most loaded program within one run's cost of the mean). Runs of cost 0 (unused) may go anywhere.

    On the CPU a heap places them one by one. On a GPU one Triton program (`_deal_runs_kernel`, no host
    synchronisation) places them in rounds with the same result: with the programs ranked by (load, number),
    the next m runs go to the m least loaded programs in rank order whenever each of those programs stays less
    loaded than the least loaded one after it takes its run, so that one at a time would have chosen the same;
    about 16-24 rounds for 2,000 runs on 132 programs (tests/test_schedule.py compares the two under
    TRITON_INTERPRET=1), where one run at a time took 0.5 ms on the H200.

    Example:
        >>> deal_runs(torch.tensor([9, 4, 4, 4, 4, 4]), 2).tolist()  # loads 13 and 16
        [0, 1, 1, 1, 0, 1]
    """
    if costs.device.type == "cpu" and not settings.interpreting():
        owners, loads = [0] * costs.shape[0], [(0, p) for p in range(num_programs)]
        for r, c in enumerate(costs.tolist()):
            if c:
                load, p = heapq.heappop(loads)
                owners[r] = p
                heapq.heappush(loads, (load + c, p))
        return torch.tensor(owners, dtype=torch.long)
    owners = torch.zeros(costs.shape[0], dtype=torch.long, device=costs.device)
    with torch.cuda.device(costs.device) if costs.is_cuda else contextlib.nullcontext():  # Triton's current device
        launch(_deal_runs_kernel, (1, ), (costs, owners, costs.shape[0], num_programs),
               dict(PROGRAMS=next_power_of_2(num_programs)), 4, 3)
    return owners


@triton.jit
def _deal_runs_kernel(Costs, Owners, n, num_programs, PROGRAMS: tl.constexpr):
    """`deal_runs` in one program (`_deal`)."""
    _deal(Costs, Owners, n, num_programs, PROGRAMS)


@triton.jit
def _deal(Costs, Owners, n, num_programs, PROGRAMS: tl.constexpr):
    """Owners[r] = the program of run r, for the n runs of Costs sorted heaviest first (`deal_runs`), in rank
    space: `keys` holds each program's (load, number) as load x PROGRAMS + number, and a round sorts them, so
    that rank r holds the program of rank r (lanes past the programs have load 2^40 and rank last); the program
    of rank r would take run s + r; the first m of them take theirs, m the lowest rank whose program would not
    stay below the least load plus its run (run s + k, k < m, costs at least run s + m - 1's, so every program
    served stays above the next rank's load: one run at a time makes the same choices). A sort of PROGRAMS keys
    per round, where ranking by a (PROGRAMS, PROGRAMS) comparison took 153 us for 2,112 runs on 132 programs
    (the H200, 2026-12-02)."""
    ranks = tl.arange(0, PROGRAMS)
    real = ranks < num_programs  # the programs rank first: their loads stay below 2^40
    ranks64 = ranks.to(tl.int64)
    keys = tl.where(real, ranks64, ranks64 + (1 << 40) * PROGRAMS)
    s = tl.full((), 0, tl.int32)  # runs placed so far
    while s < n:
        keys = tl.sort(keys)
        load, program = keys // PROGRAMS, keys % PROGRAMS
        run = s + ranks
        c = tl.load(Costs + run, mask=real & (run < n), other=0).to(tl.int64)
        fits = real & (run < n) & (c > 0) & (load < tl.min(load, 0) + c)
        m = tl.min(tl.where(fits, PROGRAMS, ranks), 0)  # 0 only where run s costs 0: the rest are unused
        take = ranks < m
        tl.store(Owners + run, program, mask=take)
        keys += tl.where(take, c * PROGRAMS, 0)
        s = tl.where(m > 0, s + m, n)


@triton.jit
def _item_lists(idx, valid, tiles, heads, g_batch, g_heads, g_blocks, g_block, TILE: tl.constexpr):
    """The mask list of items idx = (b * heads + h) * tiles + t: ((b % g_batch) * g_heads + h % g_heads) *
    g_blocks + t * TILE // g_block."""
    b = idx // (heads * tiles)
    h = (idx // tiles) % heads
    t = idx % tiles
    return tl.where(valid, ((b % g_batch) * g_heads + h % g_heads) * g_blocks + (t * TILE) // g_block, 0)


@triton.jit
def _item_length(FullOffsets, PartOffsets, lst, valid):
    """Blocks of list `lst`, full and partial (0 where not `valid`)."""
    full = tl.load(FullOffsets + lst + 1, mask=valid, other=0) - tl.load(FullOffsets + lst, mask=valid, other=0)
    part = tl.load(PartOffsets + lst + 1, mask=valid, other=0) - tl.load(PartOffsets + lst, mask=valid, other=0)
    return full + part


@triton.jit
def _order_items_kernel(FullOffsets, PartOffsets, Scratch, Placed, Starts,
                        n, tiles, heads, n_own, other_heads, other_mul, other_div, n_other, g_batch, g_heads,
                        g_blocks, g_block, num_programs, heavy_factor,
                        LONGEST: tl.constexpr, BALANCE: tl.constexpr, TILE: tl.constexpr, ITEMS: tl.constexpr,
                        CHUNK: tl.constexpr, PROGRAMS: tl.constexpr):
    """Program pid: the records of items pid * ITEMS + [0, ITEMS) of a (B, heads, tiles) grid of tiles (as
    `whole_items(row_items or column_items)`), each at its position in the start order (`order_items`), from
    a count over all items of those that start before it: with LONGEST (`longest_first`) longest first (ties
    in item order), otherwise heavy lists first, each class in item order. With BALANCE the records go to Scratch (6 fields per
    position) for `_deal_items_kernel`; without, item at position pos goes to program pos % num_programs and
    its record straight to Placed (`assign_programs`: each program's items in start order), and program 0
    writes Starts.

    Item idx = (b * heads + h) * tiles + t: own row (b * heads + h) * n_own + t * TILE, other row
    (b * other_heads + h * other_mul // other_div) * n_other, and the full and partial list ranges of its
    mask list (`_item_lists`)."""
    idx = tl.program_id(0) * ITEMS + tl.arange(0, ITEMS)
    valid = idx < n
    b = idx // (heads * tiles)
    h = (idx // tiles) % heads
    t = idx % tiles
    own = (b * heads + h) * n_own + t * TILE
    other = (b * other_heads + h * other_mul // other_div) * n_other
    lst = _item_lists(idx, valid, tiles, heads, g_batch, g_heads, g_blocks, g_block, TILE)
    lo = tl.load(FullOffsets + lst, mask=valid, other=0)
    hi = tl.load(FullOffsets + lst + 1, mask=valid, other=0)
    plo = tl.load(PartOffsets + lst, mask=valid, other=0)
    phi = tl.load(PartOffsets + lst + 1, mask=valid, other=0)
    length = (hi - lo) + (phi - plo)
    pos = tl.zeros([ITEMS], tl.int32)
    if LONGEST:  # longer lists, then equal ones of lower item number
        for first in range(0, n, CHUNK):
            j = first + tl.arange(0, CHUNK)
            vj = j < n
            other_length = _item_length(FullOffsets, PartOffsets,
                                        _item_lists(j, vj, tiles, heads, g_batch, g_heads, g_blocks, g_block, TILE), vj)
            before = (other_length[None, :] > length[:, None]) | ((other_length[None, :] == length[:, None])
                                                                   & (j[None, :] < idx[:, None]))
            pos += tl.sum((before & vj[None, :]).to(tl.int32), 1)
    else:  # heavy lists (longer than heavy_factor x the mean) first; within each class, item order
        total = tl.zeros([CHUNK], tl.int32)
        for first in range(0, n, CHUNK):
            j = first + tl.arange(0, CHUNK)
            vj = j < n
            total += _item_length(FullOffsets, PartOffsets,
                                  _item_lists(j, vj, tiles, heads, g_batch, g_heads, g_blocks, g_block, TILE), vj)
        above = heavy_factor * (tl.sum(total, 0).to(tl.float32) / n)  # the float32 mean, exact as torch's
        heavy = length.to(tl.float32) > above
        heavy_total = tl.zeros([ITEMS], tl.int32)
        for first in range(0, n, CHUNK):
            j = first + tl.arange(0, CHUNK)
            vj = j < n
            other_heavy = _item_length(FullOffsets, PartOffsets, _item_lists(j, vj, tiles, heads, g_batch, g_heads,
                                                                            g_blocks, g_block, TILE),
                                       vj).to(tl.float32) > above
            other_heavy = other_heavy[None, :] & vj[None, :]
            heavy_total += tl.sum(other_heavy.to(tl.int32), 1)
            earlier = j[None, :] < idx[:, None]
            same = (other_heavy == heavy[:, None]) & vj[None, :]
            pos += tl.sum((earlier & same).to(tl.int32), 1)
        pos = tl.where(heavy, pos, heavy_total + pos)
    if BALANCE:
        at = Scratch + pos * 6
    else:  # program p takes positions p, p + num_programs, ...: those before it hold n // P + (q < n % P) each
        program = pos % num_programs
        at = Placed + (program * (n // num_programs) + tl.minimum(program, n % num_programs)
                       + pos // num_programs) * 8
        tl.store(at + 6, tl.full([ITEMS], -1, tl.int32), mask=valid)
        tl.store(at + 7, tl.zeros([ITEMS], tl.int32), mask=valid)
        if tl.program_id(0) == 0:
            q = tl.arange(0, PROGRAMS)
            tl.store(Starts + q, q * (n // num_programs) + tl.minimum(q, n % num_programs), mask=q < num_programs)
            tl.store(Starts + num_programs, n)
    tl.store(at + 0, own, mask=valid)
    tl.store(at + 1, other, mask=valid)
    tl.store(at + 2, lo, mask=valid)
    tl.store(at + 3, hi, mask=valid)
    tl.store(at + 4, plo, mask=valid)
    tl.store(at + 5, phi, mask=valid)


@triton.jit
def _deal_items_kernel(Scratch, Placed, Starts, n, num_programs, run, sub, ITEM_COST: tl.constexpr,
                       BLOCK: tl.constexpr, RUNS: tl.constexpr, PROGRAMS: tl.constexpr):
    """One program: the records that `_order_items_kernel` left in start order (Scratch, 6 fields per
    position) placed as `assign_programs` balances them: runs of `run` consecutive positions, heaviest first
    (ties in run order), each to the least loaded program (`_deal`); each program takes its runs in run order.
    Scratch: int32, 7 * BLOCK + 3 * RUNS + PROGRAMS. Placed: int32 (n, 8); Starts: int32 (num_programs + 1,)."""
    pos = tl.arange(0, BLOCK)
    valid = pos < n
    at = Scratch + pos * 6
    o_lo = tl.load(at + 2, mask=valid, other=0)
    o_hi = tl.load(at + 3, mask=valid, other=0)
    o_plo = tl.load(at + 4, mask=valid, other=0)
    o_phi = tl.load(at + 5, mask=valid, other=0)
    # runs' costs from a prefix sum, heaviest first (ties in run order)
    cost = ((o_hi - o_lo) + (o_phi - o_plo)) * sub + ITEM_COST
    cum = tl.cumsum(tl.where(valid, cost, 0), 0)
    CumAt = Scratch + 6 * BLOCK
    tl.store(CumAt + pos, cum, mask=valid)
    tl.debug_barrier()
    r = tl.arange(0, RUNS)
    num_runs = (n + run - 1) // run
    real_run = r < num_runs
    last = tl.minimum((r + 1) * run, n) - 1
    before = tl.load(CumAt + r * run - 1, mask=real_run & (r > 0), other=0)
    run_cost = tl.where(real_run, tl.load(CumAt + last, mask=real_run, other=0) - before, 0)
    run_key = tl.where(real_run, (2147483647 - run_cost).to(tl.int64) * RUNS + r, 9223372036854775807)
    by_cost = (tl.sort(run_key) % RUNS).to(tl.int32)  # the run at each rank, heaviest first
    SortedCost = Scratch + 7 * BLOCK
    RunOwner = SortedCost + RUNS
    RunStart = RunOwner + RUNS
    CountAt = RunStart + RUNS
    tl.debug_barrier()
    tl.store(SortedCost + r, tl.where(real_run, tl.load(CumAt + tl.minimum((by_cost + 1) * run, n) - 1,
                                                               mask=real_run, other=0)
                                      - tl.load(CumAt + by_cost * run - 1, mask=real_run & (by_cost > 0),
                                                other=0), 0))
    tl.debug_barrier()
    _deal(SortedCost, RunOwner, num_runs, num_programs, PROGRAMS)  # each run's program, by rank
    tl.debug_barrier()
    owner_by_rank = tl.load(RunOwner + r, mask=real_run, other=0)
    tl.debug_barrier()
    tl.store(RunOwner + by_cost, owner_by_rank, mask=real_run)  # by run
    tl.debug_barrier()
    # each program's runs in run order, the programs in turn: where each run starts in the placed records
    owner = tl.load(RunOwner + r, mask=real_run, other=0)
    by_owner = tl.sort(tl.where(real_run, owner * RUNS + r, 2147483647)) % RUNS  # < PROGRAMS x RUNS
    size = tl.where(by_owner < num_runs, tl.minimum((by_owner + 1) * run, n) - by_owner * run, 0)
    tl.store(RunStart + by_owner, tl.cumsum(size, 0) - size, mask=by_owner < num_runs)
    lanes = tl.arange(0, PROGRAMS)
    tl.store(CountAt + lanes, tl.zeros_like(lanes))
    tl.debug_barrier()
    tl.atomic_add(CountAt + owner, tl.minimum((r + 1) * run, n) - r * run, mask=real_run)
    dest = Placed + (tl.load(RunStart + pos // run, mask=valid, other=0) + pos % run) * 8
    for f in tl.static_range(6):
        tl.store(dest + f, tl.load(at + f, mask=valid, other=0), mask=valid)
    tl.store(dest + 6, tl.full([BLOCK], -1, tl.int32), mask=valid)
    tl.store(dest + 7, tl.zeros([BLOCK], tl.int32), mask=valid)
    tl.debug_barrier()
    ends = tl.cumsum(tl.load(CountAt + lanes), 0)
    tl.store(Starts + 1 + lanes, ends, mask=lanes < num_programs)
    tl.store(Starts + lanes, tl.zeros_like(lanes), mask=lanes == 0)


def walk_tiles(B, Hkv, Nq, Nk, causal: bool, index: KernelIndex | None, geometry: MaskGeometry | None, sub: int,
               BLOCK_N: int, BLOCK_M: int) -> int:
    """How many BLOCK_M-row query tiles the `column_items` of a call walk in all (each query head of a group
    once), from host sizes only: no synchronisation. A mask's column lists serve every batch and KV head that
    they broadcast to, and each of their blocks' BLOCK_N-key tiles; `sub` query tiles per list block."""
    if index is None:
        q_tiles, tiles = Nq // BLOCK_M, Nk // BLOCK_N
        per_head = (sum(max(q_tiles - (n * BLOCK_N) // BLOCK_M, 0) for n in range(tiles)) if causal
                    else q_tiles * tiles)
        return B * Hkv * per_head
    g = geometry
    entries = index.col_full.indices.numel() + index.col_partial.indices.numel()
    return entries * sub * (B // g.batch) * (Hkv // g.heads) * (g.block_k // BLOCK_N)


def _walk(f, lengths, total: int):
    """(item, position) of each of the `total` steps of items walking `lengths` steps each, in item order."""
    first = torch.cumsum(lengths, 0) - lengths
    item = torch.repeat_interleave(torch.arange(f.shape[0], device=f.device), lengths, output_size=total)
    return item, torch.arange(total, device=f.device) - first[item]


def _query_tile(f, item, e, sub: int, q_per_block: int, blocks):
    """The query tile (BLOCK_M rows, counted within the head) of list tile e of each item's list tiles (the full
    list's, then the partial list's). `blocks`: the mask's full and partial column lists as one tensor, or
    None for the dense items (whose lists count tiles)."""
    n_full = (f[item, 3] - f[item, 2]) * sub
    full = e < n_full
    entry = torch.where(full, f[item, 2] * sub + e, f[item, 4] * sub + e - n_full)
    if blocks is None:
        return entry
    at = entry // sub + torch.where(full, 0, blocks[1])
    return blocks[0][at].long() * q_per_block + entry % sub


def one_pass_walks(items, starts, Nq: int, Nk: int, groups: int, sub: int, block_q: int, BLOCK_M: int,
                   index: KernelIndex | None, total: int, ordered: bool):
    """The walks of the one-pass backward's items (`gluon/bwd.py`) and, `ordered`, the turn of every step.

    Rotation (item field 7): each item walks its list tiles (full list, then partial list) starting at the
    first tile at or past its own keys' position (the tile on the diagonal for self-attention; the first one
    where none is) and wraps around. Items of neighbouring key tiles that run at once then reach each query tile
    a step or two apart instead of all at once.

    Turns: the dQ tile of every step gets the additions of all the steps that reach it in a fixed order. The
    order follows a model of the run (each program walks its items one after the other from time 0, one unit
    per step and `ITEM_COST` per item): the steps that reach a tile are ranked by (model time, program). Each
    program's steps rise in that order, so a step waits only for steps that come before it in one total order:
    with all programs resident, some step can always proceed (no deadlock), and where the run follows the
    model the wait is short. `turns` (int32, one per step, the programs' steps one after the other) gives each
    step its rank; `step_starts` (int32, programs + 1) where each program's steps begin.

    `items`, `starts`: placed items (`whole_plan`) of `groups` query heads each; `total`: their list tiles
    (`walk_tiles`). No host synchronisation. Returns (items, turns, step_starts); turns and step_starts are
    None unless `ordered`.

    Example: two dense items of 4 query tiles (keys 0-127 and 128-255 of 256) on two programs.
        >>> items = torch.tensor([[0, 0, 0, 4, 0, 0, -1, 0], [128, 0, 0, 4, 0, 0, -1, 0]], dtype=torch.int32)
        >>> walked, turns, step_starts = one_pass_walks(items, torch.tensor([0, 1, 2]), 256, 256, 1, 1, 64, 64,
        ...                                             None, 8, True)
        >>> walked[:, 7].tolist()  # the second starts at tile 2 (rows 128-191)
        [0, 2]
        >>> turns.tolist()  # each reaches its first two tiles first and the other's second
        [0, 0, 1, 1, 0, 0, 1, 1]
    """
    dev = items.device
    f = items.long()
    n = ((f[:, 3] - f[:, 2]) + (f[:, 5] - f[:, 4])) * sub
    q_per_block = block_q // BLOCK_M
    blocks = None if index is None else (torch.cat([index.col_full.indices, index.col_partial.indices]),
                                         index.col_full.indices.numel())
    item, e = _walk(f, n, total)
    tile = _query_tile(f, item, e, sub, q_per_block, blocks)
    own = (f[:, 0] % Nk) * Nq // Nk // BLOCK_M  # the query tile level with the item's first key
    span = Nq // BLOCK_M + 1
    candidate = torch.where(tile >= own[item], tile * span + e, span * span)
    first = torch.full_like(n, span * span).scatter_reduce_(0, item, candidate, "amin")
    rotation = torch.where(first < span * span, first % span, 0)
    items = torch.cat([items[:, :7], rotation.to(items.dtype)[:, None]], 1).contiguous()
    if not ordered:
        return items, None, None
    f = items.long()
    item, t = _walk(f, n * groups, total * groups)
    length = n[item]
    g = t // length
    e = t - g * length + f[item, 7]
    e = torch.where(e >= length, e - length, e)
    dq_tile = (f[item, 1] + g * Nq) // BLOCK_M + _query_tile(f, item, e, sub, q_per_block, blocks)
    P = starts.numel() - 1
    cost = n * groups + ITEM_COST
    done = torch.cat([cost.new_zeros(1), torch.cumsum(cost, 0)])  # model time at each item's start, all programs
    program = torch.repeat_interleave(torch.arange(P, device=dev), starts.diff().long(), output_size=f.shape[0])
    begin = done[:-1] - done[starts.long()][program]  # at its start, on its own program
    when = (begin[item] + ITEM_COST + t) * P + program[item]
    order = torch.argsort(when, stable=True)
    order = order[torch.argsort(dq_tile[order], stable=True)]  # by tile, each tile's steps by (time, program)
    sorted_tile = dq_tile[order]
    position = torch.arange(order.numel(), device=dev)
    new = torch.ones_like(sorted_tile, dtype=torch.bool)
    new[1:] = sorted_tile[1:] != sorted_tile[:-1]
    first_of_tile = torch.cummax(torch.where(new, position, 0), 0).values
    turns = torch.empty(order.numel(), dtype=torch.int32, device=dev)
    turns[order] = (position - first_of_tile).to(torch.int32)
    steps = torch.cat([n.new_zeros(1), torch.cumsum(n * groups, 0)])
    step_starts = steps[starts.long()].to(torch.int32)
    if turns.numel() == 0:
        turns = torch.zeros(1, dtype=torch.int32, device=dev)
    return items, turns, step_starts

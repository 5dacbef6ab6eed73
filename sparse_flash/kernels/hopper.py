"""What the Hopper kernels (`fwd_hopper.py`, `dq_hopper.py`, `bwd_hopper.py`) share: Gluon names that
changed between Triton versions, device-side helpers, which GPUs and tensors they run on, their prepared
launches, and the host-side work items: their order, the cutting of very long lists (backward) and their
placement on the resident programs.
"""

from __future__ import annotations

import heapq
import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .launch import BoundLaunch

GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
WARPS = 4  # per compute partition (a warpgroup); the launch's num_warps
HEAVY_FACTOR = 4  # items with lists longer than this many times the mean start first
BALANCE = os.environ.get("SPARSE_FLASH_HOPPER_BALANCE") != "0"  # items to programs by load (`assign_programs`)
# Time per item besides its key tiles (Q load, first S, last O += P V, O store), in key tiles, for balancing:
# 3.2 us against 1.74 us per tile, fitted on local masks of 3 and 9 blocks per row (NOTES, step 44).
ITEM_COST = 2
BUNDLES_PER_PROGRAM = 16  # runs of items per program that the balancing places (bounds its host time)
ROW_BLOCK = 128  # query rows per item of the kernels that walk row lists (`row_items`), and key rows per list tile

# Names that changed after Triton 3.6: a barrier among the warps of one partition, a TMA load and store.
partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@gluon.jit
def list_tile_start(Idx, j, SUB: gl.constexpr, MASK_BLOCK: gl.constexpr, BLOCK: gl.constexpr, DENSE: gl.constexpr):
    """First row of tile j of a list: tile j % SUB of mask block Idx[j // SUB], or tile j itself when dense
    (the dense items' lists count tiles)."""
    if DENSE:
        start = j * BLOCK
    else:
        start = gl.load(Idx + j // SUB) * MASK_BLOCK + (j % SUB) * BLOCK
    return start


@gluon.jit
def load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, row, t):
    """K and V rows [row, row + BLOCK_N) into the next buffers of the rings, once those are free."""
    K_STAGES: gl.constexpr = k_smem.type.shape[0]
    V_STAGES: gl.constexpr = v_smem.type.shape[0]
    sk = t % K_STAGES
    # Barriers start with phase 1 complete: the first wait on a free buffer passes at once.
    mbarrier.wait(k_empty.index(sk), ((t // K_STAGES) & 1) ^ 1)
    mbarrier.expect(k_ready.index(sk), k_desc.block_type.nbytes)
    tma_load(k_desc, [row, 0], k_ready.index(sk), k_smem.index(sk))
    sv = t % V_STAGES
    mbarrier.wait(v_empty.index(sv), ((t // V_STAGES) & 1) ^ 1)
    mbarrier.expect(v_ready.index(sv), v_desc.block_type.nbytes)
    tma_load(v_desc, [row, 0], v_ready.index(sv), v_smem.index(sv))


@gluon.jit
def release(bar, pred=True):
    """Free a buffer once every warp of this warpgroup is past its last read (the arrive is one thread's)."""
    partition_barrier()
    mbarrier.arrive(bar, count=1, pred=pred)


@gluon.jit
def release_after_store(bar):
    """Free a buffer that this warpgroup's TMA stores read from, once they have read it."""
    tma.store_wait(0)
    release(bar)


_SM90: dict = {}  # device -> whether it is an sm_90 GPU, asked once per device


def runs_on(*tensors) -> bool:
    """Whether the tensors are on an sm_90 GPU (H100, H200), contiguous and 16-byte aligned (TMA)."""
    device = tensors[0].device
    if not tensors[0].is_cuda:
        return False
    sm90 = _SM90.get(device)
    if sm90 is None:
        sm90 = _SM90[device] = torch.cuda.get_device_capability(device) == (9, 0)
    return sm90 and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)


def shapes_fit(q_shape, k_shape, dtype, mask_geometry, dense: bool, head_dims=(128, )) -> bool:
    """What every Hopper kernel needs of a call, the GPU aside: 16-bit inputs, a head dim in `head_dims`,
    both lengths multiples of ROW_BLOCK, int32 row numbers, and for a mask blocks that are multiples of
    ROW_BLOCK and divide the lengths (no block ends in a sequence tail)."""
    B, Hq, Nq, D = q_shape
    Nk = k_shape[2]
    if dtype not in GL_DTYPES or D not in head_dims or Nq % ROW_BLOCK or Nk % ROW_BLOCK:
        return False
    if B * Hq * Nq >= 2**31 or k_shape[0] * k_shape[1] * Nk >= 2**31:
        return False
    if not dense:
        block_q, block_k = mask_geometry[4], mask_geometry[5]
        if block_q % ROW_BLOCK or block_k % ROW_BLOCK or Nq % block_q or Nk % block_k:
            return False
    return True


def row_descriptor(t, rows: int, layout):
    """A TMA descriptor of contiguous t as a (rows of D) matrix, read or written `rows` rows at a time."""
    D = t.shape[-1]
    return TensorDescriptor(t, [t.numel() // D, D], [D, 1], [rows, D], layout)


def bound_launch(kernel, grid: int, tail: tuple, constexprs: dict, maxnreg: int) -> BoundLaunch:
    """The prepared launch of a Hopper kernel (`launch.BoundLaunch`): a few microseconds of host time per
    call where `kernel[grid](...)` took tens per kernel, which eager calls of short lists waited on. The
    kernels take num_warps as their last constexpr."""
    return BoundLaunch(kernel, grid, tail, {**constexprs, "num_warps": WARPS}, WARPS, 3, maxnreg)


def num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def list_ranges(offsets, lists):
    """(full start, full end, partial start, partial end) of the given lists (any shape of list numbers),
    from `(full offsets, partial offsets)` of a `KernelIndex` part."""
    full_off, part_off = offsets[0].long(), offsets[1].long()
    return full_off[lists], full_off[lists + 1], part_off[lists], part_off[lists + 1]


def row_items(B, Hq, Hkv, Nq, Nk, causal: bool, index, mask_geometry, device):
    """int32 `(items, 6)` records, one per ROW_BLOCK-row query tile of each (batch, head): (first Q/O/LSE
    row, first K/V row of its head, full list start, full list end, partial list start, partial list end);
    lists count mask blocks of the tile's mask row (`index`: `KernelIndex.rows()`), or for the dense path
    ROW_BLOCK-key tiles (causal: the tile on the diagonal is the partial list).

    Order (`order_items`): causal calls longest list first, other calls heavy lists first, then by
    (batch, head) and query tile, so that the programs in flight share one head's K and V in L2.
    """
    tiles = Nq // ROW_BLOCK
    b = torch.arange(B, device=device).view(B, 1, 1)
    h = torch.arange(Hq, device=device).view(1, Hq, 1)
    i = torch.arange(tiles, device=device).view(1, 1, tiles)
    shape = (B, Hq, tiles)
    q_row = ((b * Hq + h) * Nq + i * ROW_BLOCK).expand(shape)
    kv_row = ((b * Hkv + h // (Hq // Hkv)) * Nk).expand(shape)
    if len(index) == 0:  # dense: key tiles [0, Nk / ROW_BLOCK), or below and on the diagonal when causal
        key_tiles = Nk // ROW_BLOCK
        lo = torch.zeros(shape, dtype=torch.long, device=device)
        hi = (i.clamp(max=key_tiles) if causal else torch.full_like(i, key_tiles)).expand(shape)
        plo, phi = (hi, (i + 1).clamp(max=key_tiles).expand(shape)) if causal else (lo, lo)
    else:
        Bm, Hm, Mq, _, block_q, _, _ = mask_geometry
        row = (((b % Bm) * Hm + h % Hm) * Mq + (i * ROW_BLOCK) // block_q).expand(shape)  # each tile's mask row
        lo, hi, plo, phi = list_ranges((index[0], index[2]), row)
    return order_items(torch.stack([q_row, kv_row, lo, hi, plo, phi], -1).reshape(-1, 6), causal)


def order_items(items, causal: bool):
    """Items (fields 2-5: full and partial list ranges) in the order they start: causal calls longest list
    first (their lists grow along the diagonal, and the long ones must not come last); other calls heavy
    lists first, then as given (by (batch, head) and tile, so that the programs in flight share one head's
    tensors in L2). Returns int32 records."""
    length = items[:, 3] - items[:, 2] + items[:, 5] - items[:, 4]
    if causal:
        order = torch.argsort(-length, stable=True)
    else:
        heavy = length > HEAVY_FACTOR * length.float().mean()
        order = torch.argsort((~heavy).to(torch.int8), stable=True)
    return items[order].to(torch.int32).contiguous()


def split_long_items(items, num_programs: int, sub: int):
    """Items with a 7th field, their scratch slot, after cutting the few lists much longer than the others
    (the global rows and columns of BigBird and Longformer) into chunks; and the merge records.

    A program's load is its items' tiles (`assign_programs`), so one item longer than the mean load of a
    program would end after all the others. An item whose full list is longer than HEAVY_FACTOR times the
    mean list and than a program's mean load (in list entries: tiles / `sub`) becomes chunks of at most
    that many entries, each with its own scratch slot (the partial list goes with the last chunk); the
    others get slot -1. Each chunk adds its share of the output tile (first record field: its first row)
    into its slot, and a merge adds the chunks in order (`chunk_sum.py`): one int32 `(first row, first slot,
    chunks)` record per cut item. Items are int32 `(items, 6)` from `row_items` or `_dkdv_items`, in their
    order (chunks take the place of their item).
    """
    items = items.long()
    full = items[:, 3] - items[:, 2]
    length = full + items[:, 5] - items[:, 4]
    mean_load = float((length * sub + ITEM_COST).sum()) / num_programs
    limit = max(1, -(-int(mean_load) // sub))  # list entries per chunk
    cut = (full > limit) & (full > HEAVY_FACTOR * length.double().mean())
    chunks = torch.where(cut, -(-full // limit), torch.ones_like(full))
    owner = torch.repeat_interleave(torch.arange(items.shape[0], device=items.device), chunks)
    first_chunk = torch.cumsum(chunks, 0) - chunks  # position of each item's first chunk
    c = torch.arange(owner.shape[0], device=items.device) - first_chunk[owner]  # chunk number in its item
    rec = items[owner]
    in_cut = cut[owner]
    lo = rec[:, 2] + c * limit
    rec[:, 2] = torch.where(in_cut, lo, rec[:, 2])
    rec[:, 3] = torch.where(in_cut, torch.minimum(lo + limit, rec[:, 3]), rec[:, 3])
    before_last = in_cut & (c < chunks[owner] - 1)
    rec[:, 4] = torch.where(before_last, rec[:, 5], rec[:, 4])  # the partial list goes with the last chunk
    slot = torch.where(in_cut, torch.cumsum(in_cut.long(), 0) - 1, torch.full_like(c, -1))
    merges = torch.stack([items[cut, 0], slot[first_chunk[cut]], chunks[cut]], -1)
    return (torch.cat([rec, slot[:, None]], 1).to(torch.int32).contiguous(), merges.to(torch.int32).contiguous())


def assign_programs(items, num_programs: int, sub: int):
    """Items regrouped by the resident program that runs them, and `starts` (int32, `num_programs + 1`):
    program p runs items [starts[p], starts[p + 1]).

    The programs never wait for each other, so the call lasts as long as the most loaded one. A program's
    load counts its items' tiles (list length x `sub`) plus ITEM_COST each. BALANCE: runs of consecutive
    items (about BUNDLES_PER_PROGRAM runs per program, so that the host loop stays short; each chunk of a
    cut list, `split_long_items`, is a run of its own) go heaviest
    first to the least loaded program; each program then takes its runs in their order in `items` (as
    `order_items` left them). Without BALANCE, item i goes to program i % num_programs, whatever its length.
    """
    n = items.shape[0]
    program = torch.arange(n) % num_programs
    if BALANCE and n > num_programs:
        cost = ((items[:, 3] - items[:, 2] + items[:, 5] - items[:, 4]).long().cpu() * sub + ITEM_COST).double()
        run = -(-n // (BUNDLES_PER_PROGRAM * num_programs))  # items per run
        new_run = torch.arange(n) % run == 0
        if items.shape[1] > 6:  # a chunk of a cut list (`split_long_items`) is a run of its own
            chunk = (items[:, 6] >= 0).cpu()
            new_run |= chunk | torch.cat([torch.zeros(1, dtype=torch.bool), chunk[:-1]])
        run_of = torch.cumsum(new_run.long(), 0) - 1
        run_cost = torch.zeros(int(run_of[-1]) + 1, dtype=torch.float64).index_add_(0, run_of, cost)
        owner = [0] * run_cost.shape[0]
        loads = [(0.0, p) for p in range(num_programs)]  # a heap of (load, program)
        for r in torch.argsort(run_cost, descending=True, stable=True).tolist():
            load, p = heapq.heappop(loads)
            owner[r] = p
            heapq.heappush(loads, (load + float(run_cost[r]), p))
        program = torch.tensor(owner)[run_of]
    order = torch.argsort(program, stable=True)  # by program, each program's items in their order in `items`
    counts = torch.bincount(program, minlength=num_programs)
    starts = torch.zeros(num_programs + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(counts, 0)
    return items[order.to(items.device)].contiguous(), starts.to(items.device)

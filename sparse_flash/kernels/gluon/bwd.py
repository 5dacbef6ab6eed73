"""One-pass backward for Hopper GPUs, written in Gluon: dK, dV and dQ in one launch, five tensor-core products
per tile pair where the two-pass backward (`gluon/dq.py`, then `gluon/dkdv.py`) computes seven.

The work items are the dK/dV kernel's (a 128-key tile of one (batch, KV head) with the lists of query tiles,
STEP_ROWS[D] rows each, that see it, for every query head of the group), and so is the load warp
(`dkdv._bwd_load_partition`, here with one K/V buffer: 226 KB of shared memory). Per query tile, each of the two
compute warpgroups (one per 64-key half of the item) runs S^T = K Q^T and dP^T = V dO^T, P^T = exp2(S^T - lse),
dV += P^T dO, dS^T = P^T (dP^T - delta), dK += dS^T Q; both write dS^T into one (128 keys, rows) tile in shared
memory, and each takes a 64 x 64 share of the tile's dQ = dS K over all 128 keys, which it leaves in shared
memory for the *add warp*:

- D = 128 (64-row steps): half of D each;
- D = 64 (128-row steps, whose S^T and dP^T products are 64 x 128: a 64 x 64 product with both operands in
  shared memory reads it at its full rate, tuning log step 120): half of the rows each.

Each item walks its list tiles from the one level with its own keys on (the diagonal), wrapping around
(`schedule.one_pass_walks`; item field 7), so the items of neighbouring key tiles in flight reach each query
tile a step or two apart. The add warp adds each step's two tiles into a float32 buffer by TMA reductions
(`pipeline.tma_add`). With `ordered` (deterministic: `dispatch.deterministic()`) the additions into each dQ
tile go in a fixed order: every step has a turn (`one_pass_walks`: the steps that reach a tile ranked by the
time a model of the run gives them, then by program), a semaphore per dQ tile counts the additions done, and
the add warp waits until its tile's semaphore reaches the step's turn, adds, waits for the reductions to
complete and counts. Every program's steps rise in that one total order, so some step can always proceed
once all programs are resident; the launch is cooperative (the driver starts the grid only when they all can
be), so a kernel holding SMs beside it delays it rather than deadlocking it. Without `ordered` the additions
go in any order (no program waits for another; dQ varies in its last bits from run to run).

Two small Triton launches surround it: `_prepare_kernel` (delta = rowsum(dO * O) and the log-sum-exp in log2
units, +inf for an empty row, which the steps read as they are; the float32 buffer and the
semaphores zero) and `_convert_kernel` (dQ = scale x the buffer, in the inputs' dtype).

Exactness under non-finite inputs, as the two-pass kernels: a left-out pair on the causal diagonal has dS = 0,
but 0 x NaN is NaN where K holds a NaN or infinity; a diagonal tile whose dQ share comes out non-finite, with a
non-finite key in its product, is summed again on the CUDA cores over the allowed pairs only (`_exact_dq_into`;
only such inputs pay for it).

Measured on the H200 (tuning log, step 83), backward only: on dense non-causal calls 1.09-1.16x the two passes
in order at D = 128 (0.77-0.82x at D = 64, where a step is shorter than the add warp's wait, add, complete,
count) and 1.05-1.2x in any order; on causal and sparse calls 0.53-0.89x in order, 0.64-1.02x in any order. It
serves (`supported`) what the dK/dV kernel
serves, except masks whose work plan cuts long lists; `dispatch.py` decides when it runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ...mask_index import KernelIndex, MaskGeometry
from ..aot import compile_gluon_sm90, descriptor_type
from ..memory import new_output
from ..schedule import one_pass_walks, walk_tiles, whole_plan
from ..triton.common import LOG2E
from ..launch import BoundLaunch
from .dkdv import _bwd_load_partition, probabilities_t, scores_grad_t, step_buffers
from .pipeline import (FIRST_HALF, GL_DTYPES, ITEM_WIDTH, SECOND_HALF, bound_launch, list_tile_start, num_sms,
                       partition_barrier, release, release_after_store, ring_barriers, row_spec, runs_on, tile_spec,
                       tma_add, tma_store, vector_spec, walk_position, walk_tile_start)

BLOCK_N = 128  # keys per item (64 per compute warpgroup)
# Query rows per step and Q / dO / lse / delta slots in flight, by head dim. At D = 128 each compute warpgroup adds
# half of dQ's columns over the step's 64 rows (SPLIT_D), at D = 64 all of its columns over half of the step's 128
# rows (SPLIT_M): a 64 x 64 float32 share each, two TMA reductions per step either way
STEP_ROWS = {128: 64, 64: 128}
STEP_BUFFERS = {128: 2, 64: 2}
DQ_SHARE = 64  # rows and columns of a warpgroup's dQ share
LOAD_REGS = 24
COMPUTE_REGS = 240
MAX_REGS = 168


@gluon.jit
def _wait_turn(sem, rank):
    """Spin until the semaphore reaches `rank` (acquire), then order the TMA reductions that follow after the
    read (a cross-proxy fence)."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 a; WAIT_${:uid}: ld.acquire.gpu.global.b32 a, [$1]; setp.lt.s32 p, a, $2; "
        "@p bra WAIT_${:uid}; fence.proxy.async.global; mov.b32 $0, a; }",
        "=r,l,r", [sem, rank], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _read_count(sem):
    """The semaphore's count (acquire), with the TMA reductions that follow ordered after the read."""
    return gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1]; fence.proxy.async.global;", "=r,l", [sem],
                                     dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _complete_but_two(x):
    """Wait until every TMA reduction this thread issued, but the last two, has completed."""
    return gl.inline_asm_elementwise("cp.async.bulk.wait_group 2; fence.proxy.async.global; mov.b32 $0, 0;",
                                     "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _complete_all(x):
    """Wait until every TMA reduction this thread issued has completed."""
    return gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.b32 $0, 0;",
                                     "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _count_one(sem, first):
    """Add one to the semaphore, by one thread (`first` nonzero), with release semantics."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p red.release.gpu.global.add.s32 [$1], 1; mov.b32 $0, 0; }",
        "=r,l,r", [sem, first], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _dq_add_partition(dq_desc, dq_smem0, dq_smem1, dq_full, dq_empty, Sem, Turns, StepStarts, Items, Starts, FullIdx,
                      PartIdx, Nq, GROUPS: gl.constexpr, SUB: gl.constexpr, MASK_BLOCK_Q: gl.constexpr,
                      DENSE: gl.constexpr, SPLIT_D: gl.constexpr, ORDERED: gl.constexpr, BM: gl.constexpr):
    """The add warp: for each step, once both compute warpgroups have put their dQ tiles in shared memory, adds
    them into the float32 buffer by TMA reductions. ORDERED (deterministic): a step's reductions go once the dQ
    tile's semaphore has reached the step's turn (`schedule.one_pass_walks`; read ahead, while the compute
    warpgroups finish the step); the step is counted and its buffers freed once its reductions have completed,
    after the next step's reductions are issued. A step whose turn has not come first counts the step held, and
    only then waits: no program waits while it holds an uncounted step, so a wait is only ever for steps that
    come before it in one total order. Otherwise the buffers of a step are freed once its reductions have read
    them (one step later, or at the item's end)."""
    QM: gl.constexpr = dq_smem0.type.shape[1]  # a share's rows
    DQ_D: gl.constexpr = dq_smem0.type.shape[2]  # and columns
    PER_STEP: gl.constexpr = 2  # reductions per step: one per warpgroup
    lanes = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
    first = (lanes == 0).to(gl.int32)  # the thread that counts
    zero = lanes * 0
    turns = Turns + gl.load(StepStarts + gl.program_id(0))  # this program's steps' turns
    t = 0  # steps taken (dQ buffer positions, as in the compute warpgroups)
    held = 0  # ORDERED: 1 while step t - 1's reductions are issued and the step not yet counted
    held_sem = Sem + zero
    for it in range(gl.load(Starts + gl.program_id(0)), gl.load(Starts + gl.program_id(0) + 1)):
        rec = Items + it * ITEM_WIDTH
        q_row0 = gl.load(rec + 1)
        full_lo = gl.load(rec + 2) * SUB
        n_full = gl.load(rec + 3) * SUB - full_lo
        part_lo = gl.load(rec + 4) * SUB
        n = n_full + gl.load(rec + 5) * SUB - part_lo
        rot = gl.load(rec + 7)
        for g in range(GROUPS):
            q_row = q_row0 + g * Nq
            for j in range(n):
                row = q_row + walk_tile_start(FullIdx, PartIdx, walk_position(j, rot, n), n_full, full_lo, part_lo,
                                              SUB, MASK_BLOCK_Q, BM, DENSE)
                b = t % 2
                if ORDERED:
                    sem = Sem + row // BM + zero
                    turn = gl.load(turns + t)
                    seen = gl.min(_read_count(sem), 0)  # read ahead (turn 0: the first to reach the tile)
                mbarrier.wait(dq_full.index(b), (t // 2) & 1)
                if ORDERED:
                    if seen < turn:  # not yet: count the step held first, then wait
                        if held > 0:
                            done = _complete_all(first)
                            _count_one(held_sem, first + done)
                            mbarrier.arrive(dq_empty.index((t + 1) % 2), count=1)
                            held = 0
                        _wait_turn(sem, turn + zero)
                if SPLIT_D:  # each warpgroup's half of the columns
                    tma_add(dq_desc, [row, 0], dq_smem0.index(b))
                    tma_add(dq_desc, [row, DQ_D], dq_smem1.index(b))
                else:  # each warpgroup's half of the rows
                    tma_add(dq_desc, [row, 0], dq_smem0.index(b))
                    tma_add(dq_desc, [row + QM, 0], dq_smem1.index(b))
                if ORDERED:
                    if held > 0:  # step t - 1: its reductions completed (this step's two may still run)
                        done = _complete_but_two(first)
                        _count_one(held_sem, first + done)
                        mbarrier.arrive(dq_empty.index((t + 1) % 2), count=1)
                    held = 1
                    held_sem = sem
                elif g + j > 0:  # the previous step of this item: read by its reductions
                    tma.store_wait(PER_STEP)
                    mbarrier.arrive(dq_empty.index((t + 1) % 2), count=1)
                t += 1
        if not ORDERED:
            if n * GROUPS > 0:  # the item's last step
                tma.store_wait(0)
                mbarrier.arrive(dq_empty.index((t + 1) % 2), count=1)
    if ORDERED:
        if held > 0:  # the program's last step
            done = _complete_all(first)
            _count_one(held_sem, first + done)
            mbarrier.arrive(dq_empty.index((t + 1) % 2), count=1)


@gluon.jit
def _finite_keys(K, k_row, col0, KEYS: gl.constexpr, DQ_D: gl.constexpr, HEAD_D: gl.constexpr, blk: gl.constexpr):
    """1 if K rows [k_row, k_row + KEYS), columns [col0, col0 + DQ_D) (rows of HEAD_D) are all finite, else 0
    (16 rows at a time)."""
    offs_r = gl.arange(0, 16, layout=gl.SliceLayout(1, blk))
    offs_c = col0 + gl.arange(0, DQ_D, layout=gl.SliceLayout(0, blk))
    ok = 1
    for r in range(0, KEYS, 16):
        kk = gl.load(K + (k_row + r + offs_r).to(gl.int64)[:, None] * HEAD_D + offs_c[None, :]).to(gl.float32)
        ok = gl.minimum(ok, gl.min(gl.min(((kk == kk) & (gl.abs(kk) < float("inf"))).to(gl.int32), 1), 0))
    return ok


# Triton 3.8 cannot lower a call that is not inlined inside a warp-specialised partition ("function missing
# 'ws_num_warps' attribute"); 3.6, 3.7 and 3.9 can. There the exact path is inlined (more spills, same results).
_EXACT_DQ_OUT_OF_LINE = not triton.__version__.startswith("3.8.")


@gluon.jit(noinline=_EXACT_DQ_OUT_OF_LINE)
def _exact_dq_into(out, q, do, lse_s, delta_s, K, V, k_row, key0, q_tok, qk_scale, col0, KEYS: gl.constexpr,
                   blk: gl.constexpr):
    """dS K of a causal diagonal tile over its allowed pairs only (key <= query), into shared memory `out`
    ((BM, DQ_D) float32), 16 rows at a time and one key at a time on the CUDA cores: `KEYS` keys from K/V
    row `k_row` (sequence position `key0`), dQ columns [col0, col0 + DQ_D). S and dP from Q and dO (shared
    memory, (BM, D)) and K and V (global memory), with the rows' lse (log2 units, `_prepare_kernel`) and delta
    (shared memory); dS rounded to
    the inputs' dtype as the tensor cores take it. `blk`: a blocked layout of (16, D) tiles. Not inlined
    (except on Triton 3.8, `_EXACT_DQ_OUT_OF_LINE`): a rare path (non-finite inputs) whose registers ptxas
    otherwise spills around the whole causal step (D = 128: 832 -> 392 spill bytes, of which far fewer in the
    compute partitions; GPU A/B pending)."""
    BM: gl.constexpr = q.shape[0]
    HEAD_D: gl.constexpr = q.shape[1]
    DQ_D: gl.constexpr = out.shape[1]
    rows_layout: gl.constexpr = gl.SliceLayout(1, blk)
    offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, blk))  # (HEAD_D,)
    offs_c = col0 + gl.arange(0, DQ_D, layout=gl.SliceLayout(0, blk))  # (DQ_D,)
    for r0 in gl.static_range(0, BM, 16):
        rows = q_tok + r0 + gl.arange(0, 16, layout=rows_layout)  # (16,)
        lse = lse_s.slice(r0, 16).load(rows_layout)  # log2 units; +inf for an empty row: P = 0
        delta = delta_s.slice(r0, 16).load(rows_layout)
        q_r = q.slice(r0, 16).load(blk).to(gl.float32)  # (16, HEAD_D)
        do_r = do.slice(r0, 16).load(blk).to(gl.float32)
        acc = gl.zeros([16, DQ_D], gl.float32, blk)
        for j in range(KEYS):
            base = (k_row + j).to(gl.int64) * HEAD_D
            k_j = gl.load(K + base + offs_d).to(gl.float32)  # (HEAD_D,)
            v_j = gl.load(V + base + offs_d).to(gl.float32)
            p_j = gl.exp2(gl.sum(q_r * k_j[None, :], 1) * qk_scale - lse)  # (16,)
            ds_j = (p_j * (gl.sum(do_r * v_j[None, :], 1) - delta)).to(q.dtype).to(gl.float32)  # as the MMA takes it
            kc_j = gl.load(K + base + offs_c).to(gl.float32)  # (DQ_D,)
            acc += gl.where((key0 + j <= rows)[:, None], ds_j[:, None] * kc_j[None, :], 0.0)
        out.slice(r0, 16).store(acc)


@gluon.jit
def _one_pass_step(k, v, k_dq, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, step_ready, step_empty,
                   ds_ready, dq_full, dq_empty, K, V, dk, dv, t, u, qk_scale, key0, item_row, item_key0, q_tok0,
                   dq_col, MASKED: gl.constexpr, SPLIT_D: gl.constexpr, HALF: gl.constexpr,
                   s_layout: gl.constexpr, p_layout: gl.constexpr, dq_layout: gl.constexpr, blk: gl.constexpr):
    """One query tile (slot t % STAGES) into this warpgroup's dK and dV (64 keys), and its share of the tile's
    dQ over the item's 128 keys into its dQ buffer t % 2 for the add warp: both warpgroups' dS^T go into one
    (128 keys, BM) tile first. SPLIT_D (D = 128): the share is columns [dq_col, dq_col + 64) of the tile's 64
    rows; else (D = 64) all columns of rows [HALF x 64, HALF x 64 + 64) of its 128. The keys start at K/V row
    item_row, sequence position item_key0. MASKED: a tile on the causal diagonal (query < key gets P = 0)."""
    STAGES: gl.constexpr = q_smem.type.shape[0]
    BM: gl.constexpr = q_smem.type.shape[1]
    BN: gl.constexpr = k.shape[0]
    QM: gl.constexpr = dq_smem.type.shape[1]  # the share's rows
    DQ_D: gl.constexpr = dq_smem.type.shape[2]  # and columns
    s = t % STAGES
    mbarrier.wait(step_ready.index(s), (t // STAGES) & 1)
    q = q_smem.index(s)  # (BM, D)
    do = do_smem.index(s)  # (BM, D)
    zero_s = gl.zeros([BN, BM], gl.float32, s_layout)  # unused (use_acc=False)
    st = warpgroup_mma(k, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)  # (64, BM) scores^T
    dpt = warpgroup_mma(v, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)  # (64, BM) dP^T
    st, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(st, dpt))
    pt = probabilities_t(st, lse_smem.index(s), qk_scale, key0, q_tok0, MASKED, True)  # (64, BM) P^T
    if SPLIT_D:  # dV's product under dS^T's arithmetic
        dv = warpgroup_mma(gl.convert_layout(pt.to(q.dtype), p_layout), do, dv, is_async=True)
        dst = scores_grad_t(pt, dpt, delta_smem.index(s), MASKED).to(q.dtype)  # (64, BM) dS^T
    else:  # 128-row steps: P^T and dP^T in float32 gone before P^T in 16 bits is held for dV's product
        dst = scores_grad_t(pt, dpt, delta_smem.index(s), MASKED).to(q.dtype)  # (64, BM) dS^T
        dv = warpgroup_mma(gl.convert_layout(pt.to(q.dtype), p_layout), do, dv, is_async=True)
    r = u % 2
    ds_tile = ds_smem.index(r)  # both halves' dS^T, (128, BM)
    ds_tile.slice(HALF * BN, BN).store(dst)
    dk = warpgroup_mma(gl.convert_layout(dst, p_layout), q, dk, is_async=True)
    fence_async_shared()
    partition_barrier()
    mbarrier.arrive(ds_ready.index(r), count=1)  # the other half's dS^T written too
    mbarrier.wait(ds_ready.index(r), (u // 2) & 1)
    if SPLIT_D:
        q_share = q
        do_share = do
        lse_share = lse_smem.index(s)
        delta_share = delta_smem.index(s)
        ds_share = ds_tile.permute((1, 0))  # (BM, 128 keys)
        q_tok = q_tok0
    else:  # this warpgroup's rows of the tile
        q_share = q.slice(HALF * QM, QM)
        do_share = do.slice(HALF * QM, QM)
        lse_share = lse_smem.index(s).slice(HALF * QM, QM)
        delta_share = delta_smem.index(s).slice(HALF * QM, QM)
        ds_share = ds_tile.slice(HALF * QM, QM, dim=1).permute((1, 0))  # (QM, 128 keys)
        q_tok = q_tok0 + HALF * QM
    dq = warpgroup_mma(ds_share, k_dq, gl.zeros([QM, DQ_D], gl.float32, dq_layout), use_acc=False,
                       is_async=True)  # (QM, DQ_D)
    dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq))
    b = t % 2
    mbarrier.wait(dq_empty.index(b), ((t // 2) & 1) ^ 1)  # the add warp's reductions from it two steps ago read it
    exact = 0
    if MASKED:  # a non-finite tile with a non-finite key in the product (0 x NaN): the allowed pairs again
        if gl.max(gl.max(((dq != dq) | (gl.abs(dq) == float("inf"))).to(gl.int32), 1), 0) > 0:
            if _finite_keys(K, item_row, dq_col, 2 * BN, DQ_D, q.shape[1], blk) == 0:
                _exact_dq_into(dq_smem.index(b), q_share, do_share, lse_share, delta_share, K, V, item_row,
                               item_key0, q_tok, qk_scale, dq_col, 2 * BN, blk)
                exact = 1
    if exact == 0:
        dq_smem.index(b).store(dq)
    release(step_empty.index(s))
    fence_async_shared()
    partition_barrier()
    mbarrier.arrive(dq_full.index(b), count=1)
    return dk, dv


@gluon.jit
def _one_pass_compute_partition(q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem,
                                kv_ready, kv_empty, step_ready, step_empty, ds_ready, dq_full, dq_empty,
                                dk_desc, dv_desc, K, V,
                                Items, Starts, FullIdx, PartIdx, Nq, Nk, qk_scale, sm_scale, GROUPS: gl.constexpr,
                                SUB: gl.constexpr, MASK_BLOCK_Q: gl.constexpr, DENSE: gl.constexpr,
                                CAUSAL: gl.constexpr, HALF: gl.constexpr, WARPS: gl.constexpr):
    """One compute warpgroup: keys [HALF * 64, HALF * 64 + 64) of each item; dK and dV accumulate over the
    item's query tiles (every head of the group) and leave through this half of the K/V buffer by TMA; each
    tile's share of dQ (`_one_pass_step`) goes to the add warp through this warpgroup's dQ buffers."""
    BN: gl.constexpr = k_smem.type.shape[1] // 2  # this warpgroup's keys
    HEAD_D: gl.constexpr = k_smem.type.shape[2]
    BM: gl.constexpr = q_smem.type.shape[1]
    DQ_D: gl.constexpr = dq_smem.type.shape[2]
    SPLIT_D: gl.constexpr = DQ_D < HEAD_D
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BM, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                        instr_shape=[16, DQ_D, 16])  # (QM, DQ_D) shares
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [WARPS, 1], [1, 0])  # (16, 64-128) tiles
    t = 0  # steps consumed so far (slot positions, as in the load warp; dQ buffer positions, as in the add warp)
    c = 0  # items taken so far (K/V buffer phase)
    u = 0  # dS rounds (steps and item ends)
    for it in range(gl.load(Starts + gl.program_id(0)), gl.load(Starts + gl.program_id(0) + 1)):
        rec = Items + it * ITEM_WIDTH
        item_row = gl.load(rec)  # the item's first K/V row
        kv_row = item_row + HALF * BN  # this warpgroup's first K/V row
        key0 = kv_row % Nk  # its position in the sequence
        q_row0 = gl.load(rec + 1)
        full_lo = gl.load(rec + 2) * SUB
        n_full = gl.load(rec + 3) * SUB - full_lo
        part_lo = gl.load(rec + 4) * SUB
        n = n_full + gl.load(rec + 5) * SUB - part_lo
        rot = gl.load(rec + 7)  # the list tile the walk starts at (`schedule.one_pass_walks`)
        item_key0 = item_row % Nk
        mbarrier.wait(kv_ready.index(0), c & 1)
        k = k_smem.index(0).slice(HALF * BN, BN)  # (64, D) in shared memory
        v = v_smem.index(0).slice(HALF * BN, BN)
        if SPLIT_D:  # dQ's columns [HALF * DQ_D, ...) over all 128 keys
            dq_col = HALF * DQ_D
            k_dq = k_smem.index(0).slice(HALF * DQ_D, DQ_D, dim=1)  # (128 keys, D / 2)
        else:  # all of dQ's columns over all 128 keys (for half of the rows)
            dq_col = 0
            k_dq = k_smem.index(0)  # (128 keys, D)
        dk = gl.zeros([BN, HEAD_D], gl.float32, acc_layout)  # (64, D)
        dv = gl.zeros([BN, HEAD_D], gl.float32, acc_layout)  # (64, D)
        for g in range(GROUPS):
            # the list tiles from `rot` on, wrapping around (a partial list's, on the causal diagonal: masked
            # where query < key)
            for j in range(n):
                e = walk_position(j, rot, n)
                if CAUSAL and e >= n_full:
                    q_tok0 = list_tile_start(PartIdx, e - n_full + part_lo, SUB, MASK_BLOCK_Q, BM, DENSE)
                    dk, dv = _one_pass_step(
                        k, v, k_dq, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, step_ready, step_empty,
                        ds_ready, dq_full, dq_empty, K, V, dk, dv, t, u, qk_scale, key0, item_row, item_key0,
                        q_tok0, dq_col, True, SPLIT_D, HALF, s_layout, p_layout, dq_layout, blk)
                else:
                    dk, dv = _one_pass_step(
                        k, v, k_dq, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, step_ready, step_empty,
                        ds_ready, dq_full, dq_empty, K, V, dk, dv, t, u, qk_scale, key0, item_row, item_key0,
                        key0, dq_col, False, SPLIT_D, HALF, s_layout, p_layout, dq_layout, blk)
                t += 1
                u += 1
        # both warpgroups past their last dQ product (it reads all 128 rows of K) before dK takes K's buffer
        mbarrier.arrive(ds_ready.index(u % 2), count=1)
        mbarrier.wait(ds_ready.index(u % 2), (u // 2) & 1)
        u += 1
        k.store((dk * sm_scale).to(k.dtype))  # dK and dV out through this half of the K/V buffer
        v.store(dv.to(v.dtype))
        fence_async_shared()
        partition_barrier()
        tma_store(dk_desc, [kv_row, 0], k)
        tma_store(dv_desc, [kv_row, 0], v)
        release_after_store(kv_empty.index(0))  # the next item's K and V may load
        c += 1


@gluon.jit
def _one_pass_bwd_kernel(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, dk_desc, dv_desc, dq_desc, K, V, Sem,
                         Turns, StepStarts, Items, Starts, FullIdx, PartIdx, Nq, Nk, qk_scale, sm_scale,
                         GROUPS: gl.constexpr, SUB: gl.constexpr, MASK_BLOCK_Q: gl.constexpr, DENSE: gl.constexpr,
                         CAUSAL: gl.constexpr,
                         ORDERED: gl.constexpr, STAGES: gl.constexpr, LOAD_WARP_REGS: gl.constexpr,
                         COMPUTE_REGS: gl.constexpr, num_warps: gl.constexpr):
    """One resident program per SM; program p walks items [Starts[p], Starts[p + 1]) (ORDERED: its steps'
    turns from Turns[StepStarts[p]] on)."""
    BM: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    BN: gl.constexpr = k_desc.block_type.shape[0]
    QM: gl.constexpr = dq_desc.block_type.shape[0]  # a warpgroup's dQ share: rows
    DQ_D: gl.constexpr = dq_desc.block_type.shape[1]  # and columns
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem = step_buffers(q_desc, do_desc, lse_desc, delta_desc,
                                                                         k_desc, v_desc, STAGES, 1)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BM], q_desc.dtype)
    ds_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BN, BM], ds_layout)  # both halves' dS^T, two rounds
    dq_smem0 = gl.allocate_shared_memory(gl.float32, [2, QM, DQ_D], dq_desc.layout)
    dq_smem1 = gl.allocate_shared_memory(gl.float32, [2, QM, DQ_D], dq_desc.layout)
    kv_ready, kv_empty = ring_barriers(1)
    step_ready, step_empty = ring_barriers(STAGES)
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)
        mbarrier.init(dq_full.index(i), count=2)
        mbarrier.init(dq_empty.index(i), count=1)
    gl.warp_specialize([
        (_one_pass_compute_partition, (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem0,
                                       kv_ready, kv_empty, step_ready, step_empty, ds_ready, dq_full, dq_empty,
                                       dk_desc, dv_desc, K, V, Items, Starts, FullIdx, PartIdx, Nq, Nk, qk_scale,
                                       sm_scale, GROUPS, SUB, MASK_BLOCK_Q, DENSE, CAUSAL, FIRST_HALF, num_warps)),
        (_one_pass_compute_partition, (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem1,
                                       kv_ready, kv_empty, step_ready, step_empty, ds_ready, dq_full, dq_empty,
                                       dk_desc, dv_desc, K, V, Items, Starts, FullIdx, PartIdx, Nq, Nk, qk_scale,
                                       sm_scale, GROUPS, SUB, MASK_BLOCK_Q, DENSE, CAUSAL, SECOND_HALF, num_warps)),
        (_bwd_load_partition, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem,
                               v_smem, lse_smem, delta_smem, kv_ready, kv_empty, step_ready, step_empty, Items,
                               Starts, FullIdx, PartIdx, Nq, GROUPS, SUB, MASK_BLOCK_Q, DENSE, True)),
        (_dq_add_partition, (dq_desc, dq_smem0, dq_smem1, dq_full, dq_empty, Sem, Turns, StepStarts, Items, Starts,
                             FullIdx, PartIdx, Nq, GROUPS, SUB, MASK_BLOCK_Q, DENSE, DQ_D < HEAD_D,
                             ORDERED, BM)),
    ], [num_warps, 1, 1], [COMPUTE_REGS, LOAD_WARP_REGS, LOAD_WARP_REGS])


@triton.jit
def _prepare_kernel(Out, DO, Lse, Delta, Lse2, DLse, Acc, Sem, semaphores, D: tl.constexpr, ROWS: tl.constexpr,
                    HAS_DLSE: tl.constexpr):
    """Rows [pid * ROWS, ...): delta = rowsum(dO * O) (less the log-sum-exp's gradient with HAS_DLSE), the
    log-sum-exp in log2 units (+inf for an empty row: P = 0) into Lse2, their dQ buffer rows zero; and ROWS of
    the semaphores zero."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = r.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    o = tl.load(Out + offs).to(tl.float32)
    do = tl.load(DO + offs).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:  # dS = P (dP - delta + dlse) (`dispatch.attn_bwd`)
        delta -= tl.load(DLse + r)
    tl.store(Delta + r, delta)
    lse = tl.load(Lse + r)
    tl.store(Lse2 + r, tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634))
    zero = tl.zeros([ROWS, D], tl.float32)
    tl.store(Acc + offs, zero)
    tl.store(Sem + r, tl.zeros([ROWS], tl.int32), mask=r < semaphores)


@triton.jit
def _convert_kernel(Acc, DQ, scale, D: tl.constexpr, ROWS: tl.constexpr):
    """dQ rows [pid * ROWS, ...) = scale x the buffer's rows, in DQ's dtype."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = r.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    acc = tl.load(Acc + offs)
    tl.store(DQ + offs, (acc * scale).to(DQ.dtype.element_ty))


def supported(do, q, k, v, index: KernelIndex | None, geometry: MaskGeometry | None) -> bool:
    """Whether this kernel serves the backward of the call (see module); the two-pass backward serves the rest."""
    return runs_on(q, k, v, do) and shape_supported(q.shape, k.shape, q.dtype, index, geometry)


def shape_supported(q_shape, k_shape, dtype, index: KernelIndex | None, geometry: MaskGeometry | None) -> bool:
    """The part of `supported` that does not ask the GPU: the dK/dV kernel's conditions, and a work plan that
    cuts no list."""
    from .dkdv import shape_supported as dkdv_supported
    return dkdv_supported(q_shape, k_shape, dtype, index, geometry) and (index is None
                                                                        or index.col_plan.split.shape[0] == 0)


def _layouts(D: int, dtype):
    """Shared layouts: Q/dO tiles, K/V tiles, row vectors, dQ shares (`DQ_SHARE` x `DQ_SHARE` float32)."""
    return (gl.NVMMASharedLayout.get_default_for([STEP_ROWS[D], D], dtype),
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype),
            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1),
            gl.NVMMASharedLayout.get_default_for([DQ_SHARE, DQ_SHARE], gl.float32))


class BwdPlan:
    """What one call signature fixes: the items and their walks (`ordered`: with the turn of every step,
    `schedule.one_pass_walks`), descriptor layouts, grid, constexprs and the three launches. In order the
    kernel is launched cooperatively: the driver starts it only when all its programs can be resident at once,
    which its waits need."""

    def __init__(self, q, k, index: KernelIndex | None, geometry: MaskGeometry | None, causal: bool, scale: float,
                 ordered: bool = True, dlse: bool = False):
        B, Hq, Nq, D = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        G = Hq // Hkv
        dense = index is None
        BLOCK_M = STEP_ROWS[D]
        block_q = BLOCK_M if dense else geometry.block_q
        sub = block_q // BLOCK_M
        grid = min(B * Hkv * (Nk // BLOCK_N), num_sms(q.device))
        items, self.starts = whole_plan("cols", B, Hq, Hkv, Nq, Nk, causal, index, geometry, q.device, grid, sub * G,
                                        BLOCK_N, BLOCK_M)
        total = walk_tiles(B, Hkv, Nq, Nk, causal, index, geometry, sub, BLOCK_N, BLOCK_M)
        self.items, turns, step_starts = one_pass_walks(items, self.starts, Nq, Nk, G, sub, block_q, BLOCK_M, index,
                                                        total, ordered)
        self.turns, self.step_starts = (turns, step_starts) if ordered else (self.items, self.starts)  # unread
        self.full_idx, self.part_idx = ((self.items, self.items) if dense else
                                        (index.col_full.indices, index.col_partial.indices))
        self.q_layout, self.kv_layout, self.row_layout, self.dq_layout = _layouts(D, GL_DTYPES[q.dtype])
        self.rows = B * Hq * Nq
        self.dq_block, self.block_m = (DQ_SHARE, DQ_SHARE), BLOCK_M
        self.semaphores = self.rows // BLOCK_M if ordered else 0  # one per dQ tile
        self.launch = bound_launch(_one_pass_bwd_kernel, grid, (
            self.turns, self.step_starts, self.items, self.starts, self.full_idx, self.part_idx, Nq, Nk,
            scale * LOG2E, scale),
            dict(GROUPS=G, SUB=sub, MASK_BLOCK_Q=block_q, DENSE=dense, CAUSAL=causal, ORDERED=ordered,
                 STAGES=STEP_BUFFERS[D], LOAD_WARP_REGS=LOAD_REGS, COMPUTE_REGS=COMPUTE_REGS), MAX_REGS,
            cooperative=ordered)
        programs = self.rows // BLOCK_M
        consts = dict(D=D, ROWS=BLOCK_M)
        self.prepare = BoundLaunch(_prepare_kernel, programs, (self.semaphores, ), dict(consts, HAS_DLSE=dlse), 4, 1)
        self.dlse = dlse  # the calls pass the log-sum-exp's gradient (float32 `(B, Hq, Nq)`, contiguous)
        self.convert = BoundLaunch(_convert_kernel, programs, (scale, ), consts, 4, 1)
        self.q_shape, self.k_shape, self.dtype, self.device = q.shape, k.shape, q.dtype, q.device

    def __call__(self, q, k, v, out, do, lse, dlse=None):
        delta = new_output(self.q_shape[:3], torch.float32, self.device)
        lse2 = new_output(self.q_shape[:3], torch.float32, self.device)  # the steps' lse, converted once
        acc = torch.empty((self.rows, self.q_shape[3]), dtype=torch.float32, device=self.device)
        sem = torch.empty(max(self.semaphores, 1), dtype=torch.int32, device=self.device)
        self.prepare(out, do, lse, delta, lse2, dlse if self.dlse else delta, acc, sem)
        dk = new_output(self.k_shape, self.dtype, self.device)
        dv = new_output(self.k_shape, self.dtype, self.device)
        half = BLOCK_N // 2  # each compute warpgroup stores its 64 rows
        BLOCK_M = self.block_m
        descs = (row_spec(q, BLOCK_M, self.q_layout), row_spec(do, BLOCK_M, self.q_layout),
                 row_spec(k, BLOCK_N, self.kv_layout), row_spec(v, BLOCK_N, self.kv_layout),
                 vector_spec(lse2, BLOCK_M, self.row_layout), vector_spec(delta, BLOCK_M, self.row_layout),
                 row_spec(dk, half, self.kv_layout), row_spec(dv, half, self.kv_layout),
                 tile_spec(acc, self.dq_block, self.dq_layout))
        self.launch(*descs, k, v, sem)
        dq = new_output(self.q_shape, self.dtype, self.device)
        self.convert(acc, dq)
        return dq, dk, dv


def compile_sm90(dtype: torch.dtype = torch.bfloat16, dense: bool = False, causal: bool = False,
                 block_q: int = BLOCK_N, groups: int = 1, head_dim: int = 128, ordered: bool = True):
    """The kernel compiled for sm_90a on any machine (no GPU needed), as the launcher would launch it at
    D = `head_dim`; for compile checks (tests/test_codegen.py) and `benchmarks/kernel_resources.py`."""
    D = head_dim
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    BLOCK_M = STEP_ROWS[D]
    q_layout, kv_layout, row_layout, dq_layout = _layouts(D, GL_DTYPES[dtype])
    q_desc, kv_desc = descriptor_type(name, (BLOCK_M, D), q_layout), descriptor_type(name, (BLOCK_N, D), kv_layout)
    out_desc = descriptor_type(name, (BLOCK_N // 2, D), kv_layout)
    row_desc = descriptor_type("fp32", (BLOCK_M, ), row_layout)
    dq_desc = descriptor_type("fp32", (DQ_SHARE, DQ_SHARE), dq_layout)
    sig = dict(q_desc=q_desc, do_desc=q_desc, k_desc=kv_desc, v_desc=kv_desc, lse_desc=row_desc, delta_desc=row_desc,
               dk_desc=out_desc, dv_desc=out_desc, dq_desc=dq_desc, K=f"*{name}", V=f"*{name}", Sem="*i32",
               Turns="*i32", StepStarts="*i32", Items="*i32", Starts="*i32", FullIdx="*i32", PartIdx="*i32",
               Nq="i32", Nk="i32", qk_scale="fp32", sm_scale="fp32")
    constexprs = dict(GROUPS=groups, SUB=1 if dense else block_q // BLOCK_M, MASK_BLOCK_Q=BLOCK_M if dense else block_q,
                      DENSE=dense, CAUSAL=causal, ORDERED=ordered, STAGES=STEP_BUFFERS[D], LOAD_WARP_REGS=LOAD_REGS,
                      COMPUTE_REGS=COMPUTE_REGS, num_warps=4)
    return compile_gluon_sm90(_one_pass_bwd_kernel, sig, constexprs, MAX_REGS)

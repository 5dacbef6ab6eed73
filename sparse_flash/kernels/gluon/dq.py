"""dQ kernel for Hopper GPUs with producer and consumer warps, written in Gluon (the backward's first
launch: it also stores delta = rowsum(dO * O), which the dK/dV launch reads).

Built like the forward (`gluon/fwd.py`), with the same work items (`schedule.row_items`: a 128-row query
tile of one (batch, head) and its lists of key blocks). Inside a program:

- one *load* warp issues TMA copies: the item's Q and dO tiles into one of two buffers each, then the K and
  V tiles of its lists, TILES[D][0] keys at a time (64 at D = 128), into rings of TILES[D][1] buffers;
- two *compute* warpgroups (4 warps each), one per 64-row half of the item, first compute delta for their
  rows (dO from shared memory, O from global memory) and store it, then per key tile run S = Q K^T and
  dP = dO V^T, P = exp2(S - lse), dS = P (dP - delta) and dQ += dS K on the tensor cores; at the item's
  end dQ leaves through the warpgroup's half of the Q buffer by TMA (tuning log, step 44).

The few lists much longer than the others (the global rows of BigBird and Longformer) come in the chunks of
the mask's work plan (`schedule.split_items`, as for the forward and the Triton kernels); each chunk writes
its share of dQ in float32 to a scratch tile, and a second launch adds them in chunk order (`merge.ChunkSum`).

It serves (`supported`) 16-bit inputs with D = 128 or 64 (`pipeline.head_dims`), lengths multiples of 128 and of the mask's blocks
(multiples of 128); causal or not. `dispatch.py` runs it in place of the Triton dQ kernel where it serves,
unless `settings.hopper_backward` is off (SPARSE_FLASH_HOPPER_BWD=0). Measured with the dK/dV kernel in the
tuning log, step 47.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ...mask_index import KernelIndex, MaskGeometry
from ..aot import compile_gluon_sm90, descriptor_type
from ..memory import new_output
from ..schedule import ROW_BLOCK, assign_programs, split_items, whole_plan
from ..triton.common import LOG2E
from ..triton.split import SplitPlan
from .merge import ChunkSum
from .pipeline import (FIRST_HALF, GL_DTYPES, ITEM_WIDTH, SECOND_HALF, bound_launch, list_tile_start, load_kv,
                       num_sms, partition_barrier, release, release_after_store, ring_barriers, row_spec,
                       runs_on, shapes_fit, takes_plan, tma_load, tma_store)

# (keys per step, K and V tiles in flight each) by head dim; with two Q and two dO buffers, 224 KB of shared
# memory at D = 128 and 192 KB at D = 64 (128-key steps: half the waits per product of the 64-key ones)
TILES = {128: (64, 3), 64: (128, 4)}
LOAD_REGS = 24
COMPUTE_REGS = 240  # each compute warpgroup's (the first gets what the launch cap leaves: also 240)
MAX_REGS = 168


@gluon.jit
def _dq_load_partition(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                       k_empty, v_ready, v_empty, Items, Starts, FullIdx, PartIdx, SUB: gl.constexpr,
                       MASK_BLOCK_K: gl.constexpr, DENSE: gl.constexpr):
    """The load warp: for each of this program's items, Q and dO into a free pair of buffers, then every K
    and V tile of the item's full list and then of its partial list into the next free ring buffers."""
    BN: gl.constexpr = k_desc.block_type.shape[0]
    t = 0  # K/V tiles issued so far (ring positions)
    c = 0  # items issued so far (Q/dO buffer position)
    for it in range(gl.load(Starts + gl.program_id(0)), gl.load(Starts + gl.program_id(0) + 1)):
        rec = Items + it * ITEM_WIDTH
        q_row = gl.load(rec)
        kv_row = gl.load(rec + 1)
        qb = c % 2
        mbarrier.wait(q_empty.index(qb), ((c // 2) & 1) ^ 1)  # barriers start with phase 1 complete
        mbarrier.expect(q_ready.index(qb), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma_load(q_desc, [q_row, 0], q_ready.index(qb), q_smem.index(qb))
        tma_load(do_desc, [q_row, 0], q_ready.index(qb), do_smem.index(qb))
        for j in range(gl.load(rec + 2) * SUB, gl.load(rec + 3) * SUB):
            start = list_tile_start(FullIdx, j, SUB, MASK_BLOCK_K, BN, DENSE)
            load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, kv_row + start, t)
            t += 1
        for j in range(gl.load(rec + 4) * SUB, gl.load(rec + 5) * SUB):
            start = list_tile_start(PartIdx, j, SUB, MASK_BLOCK_K, BN, DENSE)
            load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, kv_row + start, t)
            t += 1
        c += 1


@gluon.jit
def _dq_step(q, do, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, dq, lse, delta, t, qk_scale, q_tok, key0,
             K, V, kv_row, MASKED: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr):
    """One key tile (ring position t) into this warpgroup's dQ (64 rows): S = Q K^T and dP = dO V^T,
    P = exp2(S - lse), dS = P (dP - delta), dQ += dS K. MASKED: a tile on the causal diagonal (key > query
    gets P = 0), whose dS K is taken into an accumulator of its own: where it holds a non-finite value,
    which a NaN or infinity in K would also put into the rows before its key (a left-out pair has dS = 0,
    and 0 x NaN is NaN), the tile is summed again on the CUDA cores over the allowed pairs only
    (`_diagonal_dq_exact`; only inputs with such values pay for it)."""
    K_STAGES: gl.constexpr = k_smem.type.shape[0]
    V_STAGES: gl.constexpr = v_smem.type.shape[0]
    BM: gl.constexpr = q.shape[0]
    BN: gl.constexpr = k_smem.type.shape[1]
    sk = t % K_STAGES
    sv = t % V_STAGES
    zero_s = gl.zeros([BM, BN], gl.float32, s_layout)  # unused (use_acc=False)
    mbarrier.wait(k_ready.index(sk), (t // K_STAGES) & 1)
    s = warpgroup_mma(q, k_smem.index(sk).permute((1, 0)), zero_s, use_acc=False, is_async=True)  # (BM, BN)
    mbarrier.wait(v_ready.index(sv), (t // V_STAGES) & 1)
    dp = warpgroup_mma(do, v_smem.index(sv).permute((1, 0)), zero_s, use_acc=False, is_async=True)  # (BM, BN)
    s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
    release(v_empty.index(sv))  # V is read only by dP
    p = gl.exp2(s * qk_scale - lse[:, None])  # (BM, BN)
    ds = p * (dp - delta[:, None])  # (BM, BN) dS
    if MASKED:  # a pair left out has dS = 0 even where dP or delta is not finite (never 0 x NaN)
        rows = q_tok + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))  # (BM,)
        cols = key0 + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))  # (BN,)
        ds = gl.where(cols[None, :] <= rows[:, None], ds, 0.0)
    if MASKED:
        tile = warpgroup_mma(gl.convert_layout(ds.to(q.dtype), p_layout), k_smem.index(sk), gl.zeros_like(dq),
                             use_acc=False, is_async=True)
        tile = warpgroup_mma_wait(num_outstanding=0, deps=(tile, ))
        release(k_empty.index(sk))
        finite = (tile == tile) & (gl.abs(tile) < float("inf"))
        if gl.max(gl.max(gl.where(finite, 0, 1), 1), 0) > 0:
            dq = _diagonal_dq_exact(dq, q, do, K, V, kv_row + key0, key0, q_tok, lse, delta, qk_scale, BN)
        else:
            dq = dq + tile
    else:
        dq = warpgroup_mma(gl.convert_layout(ds.to(q.dtype), p_layout), k_smem.index(sk), dq, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
        release(k_empty.index(sk))
    return dq


@gluon.jit
def _diagonal_dq_exact(dq, q, do, K, V, k_row, key0, q_tok, lse, delta, qk_scale, K_TILE: gl.constexpr):
    """`dq` plus dS K of a causal diagonal tile over its allowed pairs only (key <= query), one key at a time:
    S and dP from Q and dO (this warpgroup's rows in shared memory) and K and V in global memory, dS rounded to
    the inputs' dtype as the tensor cores take it. A non-finite value at key j reaches the rows that attend j
    and no other. (BM, HEAD_D) float32."""
    BM: gl.constexpr = dq.type.shape[0]
    HEAD_D: gl.constexpr = dq.type.shape[1]
    BN: gl.constexpr = K_TILE
    acc_layout: gl.constexpr = dq.type.layout
    rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    rows = q_tok + gl.arange(0, BM, layout=rows_layout)  # (BM,)
    offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, acc_layout))  # (HEAD_D,)
    lse_r = gl.convert_layout(lse, rows_layout)
    delta_r = gl.convert_layout(delta, rows_layout)
    for j in range(BN):  # Q and dO are read from shared memory for each key: fewer registers held
        k_j = gl.load(K + (k_row + j).to(gl.int64) * HEAD_D + offs_d).to(gl.float32)  # (HEAD_D,)
        v_j = gl.load(V + (k_row + j).to(gl.int64) * HEAD_D + offs_d).to(gl.float32)
        p_j = gl.exp2(gl.sum(q.load(acc_layout).to(gl.float32) * k_j[None, :], 1) * qk_scale - lse_r)  # (BM,)
        dp_j = gl.sum(do.load(acc_layout).to(gl.float32) * v_j[None, :], 1)  # (BM,)
        ds_j = (p_j * (dp_j - delta_r)).to(q.dtype).to(gl.float32)  # (BM,) rounded as the tensor cores take dS
        dq += gl.where((key0 + j <= rows)[:, None], ds_j[:, None] * k_j[None, :], 0.0)
    return dq


@gluon.jit
def _dq_compute_partition(q_smem, do_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                          dq_desc, Out, Lse, Delta, Lse2, DLse, DqPart, K, V, Items, Starts, PartIdx, Nq, qk_scale,
                          sm_scale, SUB: gl.constexpr, MASK_BLOCK_K: gl.constexpr, DENSE: gl.constexpr,
                          CAUSAL: gl.constexpr, STORE_LSE2: gl.constexpr, HAS_DLSE: gl.constexpr, HALF: gl.constexpr,
                          WARPS: gl.constexpr):
    """One compute warpgroup: rows [HALF * 64, HALF * 64 + 64) of each item; delta first (and with STORE_LSE2
    the log-sum-exp in log2 units into Lse2: both for the Gluon dK/dV launch), then dQ over the item's key tiles, out through this half of the Q buffer by TMA, or for a chunk of a cut list (scratch
    slot >= 0) into its rows of DqPart in float32."""
    BM: gl.constexpr = q_smem.type.shape[1] // 2  # this warpgroup's rows
    HEAD_D: gl.constexpr = q_smem.type.shape[2]
    BN: gl.constexpr = k_smem.type.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BN, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    rows_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    # O and dO rows for delta: 8 contiguous elements (16 bytes) per thread
    o_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    offs_r = gl.arange(0, BM, layout=gl.SliceLayout(1, o_layout))  # (BM,)
    offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))  # (HEAD_D,)
    offs_m = gl.arange(0, BM, layout=rows_layout)  # (BM,)
    t = 0  # K/V tiles consumed so far (ring positions, as in the load warp)
    c = 0  # items taken so far (Q/dO buffer position)
    for it in range(gl.load(Starts + gl.program_id(0)), gl.load(Starts + gl.program_id(0) + 1)):
        rec = Items + it * ITEM_WIDTH
        q_row = gl.load(rec) + HALF * BM  # this warpgroup's first row of Q, dO, O, dQ, lse and delta
        q_tok = q_row % Nq  # its position in the sequence
        n_full = (gl.load(rec + 3) - gl.load(rec + 2)) * SUB
        part_lo = gl.load(rec + 4) * SUB
        part_hi = gl.load(rec + 5) * SUB
        qb = c % 2
        # O and lse asked for before the wait for Q and dO: their reads overlap it (tuning log, step 108)
        o = gl.load(Out + (q_row.to(gl.int64) + offs_r)[:, None] * HEAD_D + offs_d[None, :])  # (BM, D)
        lse = gl.load(Lse + q_row + offs_m)  # (BM,) natural log; -inf for a row with no allowed key
        mbarrier.wait(q_ready.index(qb), (c // 2) & 1)
        q = q_smem.index(qb).slice(HALF * BM, BM)  # (BM, D) in shared memory
        do = do_smem.index(qb).slice(HALF * BM, BM)
        if c > 0:  # the item before's dQ has left its Q buffer: the item after next may load there
            release_after_store(q_empty.index((c + 1) % 2))
        # delta = rowsum(dO * O), stored for the dK/dV launch
        delta = gl.sum(o.to(gl.float32) * do.load(o_layout).to(gl.float32), 1)  # (BM,)
        if HAS_DLSE:  # the log-sum-exp's gradient: dS = P (dP - delta + dlse) (`dispatch.attn_bwd`)
            delta -= gl.load(DLse + q_row + offs_r)
        gl.store(Delta + q_row + offs_r, delta)
        delta = gl.convert_layout(delta, rows_layout)
        lse = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # log2; empty rows: P = 0
        if STORE_LSE2:  # the dK/dV kernel reads it as is: no conversion per tile there (tuning log, step 97)
            gl.store(Lse2 + q_row + offs_m, lse)
        dq = gl.zeros([BM, HEAD_D], gl.float32, acc_layout)  # (BM, D)
        # The full list's tiles, then the partial list's (on the causal diagonal: masked where key > query), in
        # one loop: as two loops, an item with an empty full list read shared memory out of bounds in the
        # second (sm_90, Triton 3.6; tuning log, step 47).
        # The full list's steps take the unmasked path: no select on the causal rows' hot loop.
        for j in range(n_full + part_hi - part_lo):
            if CAUSAL and j >= n_full:
                key0 = list_tile_start(PartIdx, j - n_full + part_lo, SUB, MASK_BLOCK_K, BN, DENSE)
                dq = _dq_step(q, do, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, dq, lse, delta, t,
                              qk_scale, q_tok, key0, K, V, gl.load(rec + 1), True, s_layout, p_layout)
            else:
                dq = _dq_step(q, do, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, dq, lse, delta, t,
                              qk_scale, q_tok, q_tok, K, V, 0, False, s_layout, p_layout)
            t += 1
        slot = gl.load(rec + 6)
        if slot < 0:
            q.store((dq * sm_scale).to(q.dtype))  # the item's last products are done: Q is free
            fence_async_shared()
            partition_barrier()
            tma_store(dq_desc, [q_row, 0], q)
        else:  # a chunk: its share, added to the others' by the merge launch (`merge.ChunkSum`)
            part_rows = (slot * (2 * BM) + HALF * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout)))
            offs_c = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, acc_layout))  # (HEAD_D,)
            gl.store(DqPart + part_rows.to(gl.int64)[:, None] * HEAD_D + offs_c[None, :], dq * sm_scale)
        c += 1
    tma.store_wait(0)


@gluon.jit
def _attn_bwd_dq_hopper_kernel(q_desc, do_desc, k_desc, v_desc, dq_desc, Out, Lse, Delta, Lse2, DLse, DqPart, K, V,
                               Items, Starts, FullIdx, PartIdx, Nq, qk_scale, sm_scale, SUB: gl.constexpr,
                               MASK_BLOCK_K: gl.constexpr, DENSE: gl.constexpr, CAUSAL: gl.constexpr,
                               STORE_LSE2: gl.constexpr, HAS_DLSE: gl.constexpr, KV_STAGES: gl.constexpr,
                               LOAD_WARP_REGS: gl.constexpr, COMPUTE_REGS: gl.constexpr, num_warps: gl.constexpr):
    """One resident program per SM; program p walks items [Starts[p], Starts[p + 1])."""
    BM: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    BN: gl.constexpr = k_desc.block_type.shape[0]
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BM, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [2, BM, HEAD_D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [KV_STAGES, BN, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [KV_STAGES, BN, HEAD_D], v_desc.layout)
    q_ready, q_empty = ring_barriers(2)
    k_ready, k_empty = ring_barriers(KV_STAGES)
    v_ready, v_empty = ring_barriers(KV_STAGES)
    gl.warp_specialize([
        (_dq_compute_partition, (q_smem, do_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                                 v_empty, dq_desc, Out, Lse, Delta, Lse2, DLse, DqPart, K, V, Items, Starts, PartIdx,
                                 Nq, qk_scale, sm_scale, SUB, MASK_BLOCK_K, DENSE, CAUSAL, STORE_LSE2, HAS_DLSE, FIRST_HALF,
                                 num_warps)),  # rows [0, 64)
        (_dq_compute_partition, (q_smem, do_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                                 v_empty, dq_desc, Out, Lse, Delta, Lse2, DLse, DqPart, K, V, Items, Starts, PartIdx,
                                 Nq, qk_scale, sm_scale, SUB, MASK_BLOCK_K, DENSE, CAUSAL, STORE_LSE2, HAS_DLSE, SECOND_HALF,
                                 num_warps)),  # rows [64, 128)
        (_dq_load_partition, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_ready, q_empty,
                              k_ready, k_empty, v_ready, v_empty, Items, Starts, FullIdx, PartIdx, SUB, MASK_BLOCK_K,
                              DENSE)),
    ], [num_warps, 1], [COMPUTE_REGS, LOAD_WARP_REGS])


def supported(do, q, k, v, out, index: KernelIndex | None, geometry: MaskGeometry | None) -> bool:
    """Whether this kernel serves the dQ launch of the call (see module); the Triton kernel serves the rest."""
    return runs_on(q, k, v, do, out) and shape_supported(q.shape, k.shape, q.dtype, index, geometry)


def shape_supported(q_shape, k_shape, dtype, index: KernelIndex | None, geometry: MaskGeometry | None) -> bool:
    """The part of `supported` that does not ask the GPU: dtype, shapes, the mask's blocks and its row plan
    (`pipeline.takes_plan`; index and geometry None: the dense path)."""
    return shapes_fit(q_shape, k_shape, dtype, geometry) and takes_plan(None if index is None else index.row_plan)


class DqPlan:
    """What one call signature fixes: the item records and their placement on programs, descriptor
    layouts, grid and constexprs. `store_lse2`: the calls also pass `lse2` (float32 `(B, Hq, Nq)`), which the
    launch fills with the log-sum-exp in log2 units (+inf for an empty row) for the Gluon dK/dV launch
    (`dkdv.DkdvPlan(lse_log2=True)`)."""

    def __init__(self, q, k, index: KernelIndex | None, geometry: MaskGeometry | None, causal: bool, scale: float,
                 store_lse2: bool = False, dlse: bool = False):
        B, Hq, Nq, D = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        dense = index is None
        block_k = ROW_BLOCK if dense else geometry.block_k  # dense lists count ROW_BLOCK-key tiles
        block_n, kv_buffers = TILES[D]
        sub = block_k // block_n
        split = SplitPlan(q.device) if dense else SplitPlan(q.device, index.row_plan, B, Hq, geometry, D)
        if split.num_split:  # the chunks of the lists the mask's work plan splits (host sizes: no wait otherwise)
            items, merges = split_items("rows", B, Hq, Hkv, Nq, Nk, index, geometry, split.copy_strides, split.copies,
                                        q.device, ROW_BLOCK, unit=ROW_BLOCK)
            self.grid = (min(items.shape[0], num_sms(q.device)), )
            self.items, self.starts = assign_programs(items, self.grid[0], sub)
        else:
            merges = None
            self.grid = (min(B * Hq * (Nq // ROW_BLOCK), num_sms(q.device)), )
            self.items, self.starts = whole_plan("rows", B, Hq, Hkv, Nq, Nk, causal, index, geometry, q.device,
                                                 self.grid[0], sub)
        self.chunk_sum = ChunkSum(merges, split, ROW_BLOCK, D)
        # the dense path reads no list (any tensor will do)
        self.full_idx, self.part_idx = ((self.items, self.items) if dense else
                                        (index.row_full.indices, index.row_partial.indices))
        dtype = GL_DTYPES[q.dtype]
        self.q_layout = gl.NVMMASharedLayout.get_default_for([ROW_BLOCK, D], dtype)
        self.kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, D], dtype)
        self.block_n = block_n
        self.launch = bound_launch(_attn_bwd_dq_hopper_kernel, self.grid[0], (
            self.items, self.starts, self.full_idx, self.part_idx, Nq, scale * LOG2E, scale),
            dict(SUB=sub, MASK_BLOCK_K=block_k, DENSE=dense, CAUSAL=causal, STORE_LSE2=store_lse2, HAS_DLSE=dlse,
                 KV_STAGES=kv_buffers, LOAD_WARP_REGS=LOAD_REGS, COMPUTE_REGS=COMPUTE_REGS), MAX_REGS)
        self.q_shape, self.dtype, self.device, self.store_lse2 = q.shape, q.dtype, q.device, store_lse2
        self.dlse = dlse

    def __call__(self, q, k, v, out, do, lse, delta, lse2=None, dlse=None):
        """dQ; also writes `delta` (float32 `(B, Hq, Nq)`), which the dK/dV launch reads: rowsum(dO * O), less
        `dlse` (the log-sum-exp's gradient, like lse) where the plan takes one; and `lse2` where the plan stores
        it (`store_lse2`; any float32 tensor stands in otherwise: the launch never touches it)."""
        if self.store_lse2 != (lse2 is not None):
            raise ValueError(f"a dQ plan with store_lse2={self.store_lse2} was called with lse2 "
                             f"{'None' if lse2 is None else 'given'}")
        dq = new_output(self.q_shape, self.dtype, self.device)
        part = self.chunk_sum.scratch(self.device)
        descs = (row_spec(q, ROW_BLOCK, self.q_layout), row_spec(do, ROW_BLOCK, self.q_layout),
                 row_spec(k, self.block_n, self.kv_layout), row_spec(v, self.block_n, self.kv_layout),
                 row_spec(dq, ROW_BLOCK // 2, self.q_layout))  # dQ: each warpgroup stores its 64 rows
        self.launch(*descs, out, lse, delta, delta if lse2 is None else lse2, dlse if self.dlse else delta, part, k, v)  # k and v also as pointers: `_diagonal_dq_exact` reads them
        self.chunk_sum(dq, part)
        return dq


def compile_sm90(dtype: torch.dtype = torch.bfloat16, dense: bool = False, causal: bool = False,
                 block_k: int = ROW_BLOCK, head_dim: int = 128, store_lse2: bool = True, dlse: bool = False):
    """The kernel compiled for sm_90a on any machine (no GPU needed), as the launcher would launch it at
    D = `head_dim`; for compile checks (tests/test_codegen.py) and `benchmarks/kernel_resources.py`."""
    D = head_dim
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    q_layout = gl.NVMMASharedLayout.get_default_for([ROW_BLOCK, D], GL_DTYPES[dtype])
    block_n, kv_buffers = TILES[D]
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, D], GL_DTYPES[dtype])
    q_desc, kv_desc = descriptor_type(name, (ROW_BLOCK, D), q_layout), descriptor_type(name, (block_n, D), kv_layout)
    sig = dict(q_desc=q_desc, do_desc=q_desc, k_desc=kv_desc, v_desc=kv_desc,
               dq_desc=descriptor_type(name, (ROW_BLOCK // 2, D), q_layout), Out=f"*{name}", Lse="*fp32",
               Delta="*fp32", Lse2="*fp32", DLse="*fp32", DqPart="*fp32", K=f"*{name}", V=f"*{name}", Items="*i32", Starts="*i32", FullIdx="*i32", PartIdx="*i32", Nq="i32",
               qk_scale="fp32", sm_scale="fp32")
    block = ROW_BLOCK if dense else block_k
    constexprs = dict(SUB=block // block_n, MASK_BLOCK_K=block, DENSE=dense, CAUSAL=causal, STORE_LSE2=store_lse2,
                      HAS_DLSE=dlse, KV_STAGES=kv_buffers,
                      LOAD_WARP_REGS=LOAD_REGS, COMPUTE_REGS=COMPUTE_REGS, num_warps=4)
    return compile_gluon_sm90(_attn_bwd_dq_hopper_kernel, sig, constexprs, MAX_REGS)

"""dK/dV kernel for Hopper GPUs with producer and consumer warps, written in Gluon (the backward's second
launch; the dQ launch before it, `gluon/dq.py` or the Triton kernel, stores delta = rowsum(dO * O)).

Built like the forward (`gluon/fwd.py`): one resident program per SM walks its share of the work items,
here a 128-key tile of one (batch, KV head) and the lists of query tiles (STEP_ROWS[D] rows) that see it, for every
query head sharing that KV head (GQA). Inside a program:

- one *load* warp issues TMA copies: the item's K and V tiles into one of two K/V buffers, then for each
  query tile its Q and dO rows and its log-sum-exp and delta into a ring of STEP_BUFFERS[D] slots, each
  signalled on an mbarrier;
- two *compute* warpgroups (4 warps each), one per 64-key half of the tile, run per query tile
  S^T = K Q^T and dP^T = V dO^T, then P^T = exp2(S^T - lse), dV += P^T dO, dS^T = P^T (dP^T - delta)
  and dK += dS^T Q on the tensor cores, and release the slot; at the item's end each writes its dK and dV
  rows into its half of the K/V buffer and stores them by TMA (storing from the accumulators' registers
  cost the forward 8-20%, tuning log, step 44).

Registers: at D = 128 each warpgroup holds dK and dV (64 x 128 fp32 each) and two 64 x 64 score tiles, hence
64-row query tiles (FlashAttention-3 makes the same split at D = 128). At D = 64 dK and dV take half as many,
which leaves room for two 64 x 128 score tiles: 128-row steps, whose S^T and dP^T products are twice as wide
(a 64 x 64 product with both operands in shared memory reads as many bytes per clock as the tensor cores
consume) and which halve the waits and releases per query row (sm_90a: no spills, 6.9 instructions per
exponential in the step loop against 7.7 with 64-row steps).

The few column lists much longer than the others (the global columns of BigBird and Longformer) come in the
chunks of the mask's work plan (`schedule.split_items`, as for the forward and the Triton kernels); each chunk
writes its share of dK and dV in float32 to a scratch tile, and two more launches add them in chunk order
(`merge.ChunkSum`).

It serves (`supported`) 16-bit inputs with D = 128 or 64 (`pipeline.head_dims`), lengths multiples of 128 and of the mask's blocks
(multiples of 128), and GQA only with a mask shared by the heads; causal or not. `dispatch.py` runs it in
place of the Triton dK/dV kernel where it serves, unless `settings.hopper_backward` is off
(SPARSE_FLASH_HOPPER_BWD=0; tuning log, steps 45 and 47).
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
from ..schedule import assign_programs, split_items, whole_plan
from ..triton.common import LOG2E
from ..triton.split import SplitPlan
from .merge import ChunkSum
from .pipeline import (FIRST_HALF, GL_DTYPES, ITEM_WIDTH, SECOND_HALF, bound_launch, list_tile_start, num_sms,
                       partition_barrier, release, release_after_store, ring_barriers, row_spec, runs_on, vector_spec,
                       shapes_fit, takes_plan, tma_load, tma_store, walk_position, walk_tile_start)

BLOCK_N = 128  # keys per item (64 per compute warpgroup)
# Query rows per step and Q / dO / lse / delta slots in flight, by head dim; with two K/V buffers, 226 KB of shared
# memory at D = 128 (64-row steps, 3 slots) and 196 KB at D = 64 (128-row steps, 4 slots)
STEP_ROWS = {128: 64, 64: 128}
STEP_BUFFERS = {128: 3, 64: 4}
LOAD_REGS = 24
COMPUTE_REGS = 240  # each compute warpgroup's (the first gets what the launch cap leaves: also 240)
MAX_REGS = 168


@gluon.jit
def _load_step(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem, ready, empty, row, t):
    """Q and dO rows [row, row + STEP_ROWS[D]) and their lse and delta into slot t % STAGES, once it is free."""
    STAGES: gl.constexpr = q_smem.type.shape[0]
    s = t % STAGES
    mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)  # barriers start with phase 1 complete
    nbytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes + lse_desc.block_type.nbytes
                            + delta_desc.block_type.nbytes)
    mbarrier.expect(ready.index(s), nbytes)
    tma_load(q_desc, [row, 0], ready.index(s), q_smem.index(s))
    tma_load(do_desc, [row, 0], ready.index(s), do_smem.index(s))
    tma_load(lse_desc, [row], ready.index(s), lse_smem.index(s))
    tma_load(delta_desc, [row], ready.index(s), delta_smem.index(s))


@gluon.jit
def _bwd_load_partition(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem,
                        lse_smem, delta_smem, kv_ready, kv_empty, step_ready, step_empty, Items, Starts, FullIdx,
                        PartIdx, Nq, GROUPS: gl.constexpr, SUB: gl.constexpr, MASK_BLOCK_Q: gl.constexpr,
                        DENSE: gl.constexpr, ROTATE: gl.constexpr = False):
    """The load warp: for each of this program's items, K and V into a free K/V buffer, then for each query
    head of the group the query tiles of the full list and then of the partial list into the next slots.
    Also the load warp of the one-pass backward (`gluon/bwd.py`), whose items walk their list tiles from the
    one in their field 7 on (ROTATE, `pipeline.walk_position`)."""
    BM: gl.constexpr = q_desc.block_type.shape[0]
    KV_BUFFERS: gl.constexpr = k_smem.type.shape[0]  # two here; one in the one-pass backward (`gluon/bwd.py`)
    t = 0  # steps issued so far (slot positions)
    c = 0  # items issued so far (K/V buffer position)
    for it in range(gl.load(Starts + gl.program_id(0)), gl.load(Starts + gl.program_id(0) + 1)):
        rec = Items + it * ITEM_WIDTH
        kv_row = gl.load(rec)
        q_row0 = gl.load(rec + 1)
        kb = c % KV_BUFFERS
        mbarrier.wait(kv_empty.index(kb), ((c // KV_BUFFERS) & 1) ^ 1)
        mbarrier.expect(kv_ready.index(kb), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma_load(k_desc, [kv_row, 0], kv_ready.index(kb), k_smem.index(kb))
        tma_load(v_desc, [kv_row, 0], kv_ready.index(kb), v_smem.index(kb))
        if ROTATE:
            rot = gl.load(rec + 7)
            full_lo = gl.load(rec + 2) * SUB
            n_full = gl.load(rec + 3) * SUB - full_lo
            part_lo = gl.load(rec + 4) * SUB
            n = n_full + gl.load(rec + 5) * SUB - part_lo
            for g in range(GROUPS):
                q_row = q_row0 + g * Nq
                for j in range(n):
                    start = walk_tile_start(FullIdx, PartIdx, walk_position(j, rot, n), n_full, full_lo, part_lo, SUB,
                                            MASK_BLOCK_Q, BM, DENSE)
                    _load_step(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem,
                               step_ready, step_empty, q_row + start, t)
                    t += 1
        else:
            for g in range(GROUPS):
                q_row = q_row0 + g * Nq
                for j in range(gl.load(rec + 2) * SUB, gl.load(rec + 3) * SUB):
                    start = list_tile_start(FullIdx, j, SUB, MASK_BLOCK_Q, BM, DENSE)
                    _load_step(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem,
                               step_ready, step_empty, q_row + start, t)
                    t += 1
                for j in range(gl.load(rec + 4) * SUB, gl.load(rec + 5) * SUB):
                    start = list_tile_start(PartIdx, j, SUB, MASK_BLOCK_Q, BM, DENSE)
                    _load_step(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem,
                               step_ready, step_empty, q_row + start, t)
                    t += 1
        c += 1


@gluon.jit
def probabilities_t(st, lse_slot, qk_scale, key0, q_tok0, MASKED: gl.constexpr, LSE_LOG2: gl.constexpr = False):
    """P^T = exp2(S^T * qk_scale - lse) of a (keys, BM) tile of scores^T (keys from position key0, queries
    from q_tok0), lse read from its shared-memory slot (natural log; -inf for a query row with no allowed key:
    P = 0; LSE_LOG2: already in log2 units, +inf for such a row, as the Gluon dQ pass stores it). MASKED: a tile
    on the causal diagonal (query < key gets P = 0). Also the one-pass backward's."""
    s_layout: gl.constexpr = st.type.layout
    cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    lse = lse_slot.load(cols)  # (BM,)
    if not LSE_LOG2:  # three instructions per query column of every tile (tuning log, step 97)
        lse = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # log2; empty rows get P = 0
    pt = gl.exp2(st * qk_scale - lse[None, :])
    if MASKED:
        keys = key0 + gl.arange(0, st.shape[0], layout=gl.SliceLayout(1, s_layout))
        queries = q_tok0 + gl.arange(0, st.shape[1], layout=cols)
        pt = gl.where(queries[None, :] >= keys[:, None], pt, 0.0)
    return pt


@gluon.jit
def scores_grad_t(pt, dpt, delta_slot, MASKED: gl.constexpr):
    """dS^T = P^T (dP^T - delta), delta = rowsum(dO * O) read from its shared-memory slot. MASKED: a pair
    left out (P = 0) has dS = 0 even where dP or delta is not finite (never 0 x NaN); selected on the factor,
    not on the product: that made ptxas fence the dK product (tuning log, step 80)."""
    delta = delta_slot.load(gl.SliceLayout(0, pt.type.layout))  # (BM,)
    ds_in = dpt - delta[None, :]
    if MASKED:
        ds_in = gl.where(pt == 0.0, 0.0, ds_in)
    return pt * ds_in


@gluon.jit
def _bwd_step(k, v, q_smem, do_smem, lse_smem, delta_smem, step_ready, step_empty, dk, dv, t, qk_scale, key0,
              q_tok0, MASKED: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr, LSE_LOG2: gl.constexpr):
    """One query tile (slot t % STAGES) into this warpgroup's dK and dV (64 keys):
    S^T = K Q^T and dP^T = V dO^T, P^T = exp2(S^T - lse), dV += P^T dO, dS^T = P^T (dP^T - delta),
    dK += dS^T Q. MASKED: a tile on the causal diagonal (query < key gets P = 0)."""
    STAGES: gl.constexpr = q_smem.type.shape[0]
    BM: gl.constexpr = q_smem.type.shape[1]
    s = t % STAGES
    mbarrier.wait(step_ready.index(s), (t // STAGES) & 1)
    q = q_smem.index(s)  # (BM, D)
    do = do_smem.index(s)  # (BM, D)
    BN: gl.constexpr = k.shape[0]
    zero_s = gl.zeros([BN, BM], gl.float32, s_layout)  # unused (use_acc=False)
    st = warpgroup_mma(k, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)  # (64, BM) scores^T
    dpt = warpgroup_mma(v, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)  # (64, BM) dP^T
    st, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(st, dpt))
    pt = probabilities_t(st, lse_smem.index(s), qk_scale, key0, q_tok0, MASKED, LSE_LOG2)  # (64, BM) P^T
    dv = warpgroup_mma(gl.convert_layout(pt.to(q.dtype), p_layout), do, dv, is_async=True)
    dst = scores_grad_t(pt, dpt, delta_smem.index(s), MASKED)  # (64, BM) dS^T
    dk = warpgroup_mma(gl.convert_layout(dst.to(q.dtype), p_layout), q, dk, is_async=True)
    dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
    release(step_empty.index(s))
    return dk, dv


@gluon.jit
def _bwd_compute_partition(q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, kv_ready, kv_empty, step_ready,
                           step_empty, dk_desc, dv_desc, DkPart, DvPart, Items, Starts, PartIdx, Nk, qk_scale,
                           sm_scale, GROUPS: gl.constexpr, SUB: gl.constexpr, MASK_BLOCK_Q: gl.constexpr,
                           DENSE: gl.constexpr, CAUSAL: gl.constexpr, LSE_LOG2: gl.constexpr, HALF: gl.constexpr,
                           WARPS: gl.constexpr):
    """One compute warpgroup: keys [HALF * 64, HALF * 64 + 64) of each item; dK and dV accumulate over the
    item's query tiles (every head of the group) and leave through this half of the K/V buffer by TMA, or
    for a chunk of a cut list (scratch slot >= 0) into its rows of DkPart and DvPart in float32."""
    BN: gl.constexpr = k_smem.type.shape[1] // 2  # this warpgroup's keys
    HEAD_D: gl.constexpr = k_smem.type.shape[2]
    BM: gl.constexpr = q_smem.type.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BM, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    t = 0  # steps consumed so far (slot positions, as in the load warp)
    c = 0  # items taken so far (K/V buffer position)
    for it in range(gl.load(Starts + gl.program_id(0)), gl.load(Starts + gl.program_id(0) + 1)):
        rec = Items + it * ITEM_WIDTH
        kv_row = gl.load(rec) + HALF * BN  # this warpgroup's first K/V row
        key0 = kv_row % Nk  # its position in the sequence
        n_full = (gl.load(rec + 3) - gl.load(rec + 2)) * SUB
        part_lo = gl.load(rec + 4) * SUB
        part_hi = gl.load(rec + 5) * SUB
        kb = c % 2
        mbarrier.wait(kv_ready.index(kb), (c // 2) & 1)
        k = k_smem.index(kb).slice(HALF * BN, BN)  # (64, D) in shared memory
        v = v_smem.index(kb).slice(HALF * BN, BN)
        if c > 0:  # the item before's dK and dV have left its K/V buffer: the item after next may load there
            release_after_store(kv_empty.index((c + 1) % 2))
        dk = gl.zeros([BN, HEAD_D], gl.float32, acc_layout)  # (64, D)
        dv = gl.zeros([BN, HEAD_D], gl.float32, acc_layout)  # (64, D)
        for g in range(GROUPS):
            # the full list's tiles, then the partial list's (on the causal diagonal: masked where query < key),
            # in one loop (as in gluon/dq.py: two loops faulted on items with an empty full list)
            # (the full list's steps take the unmasked path: no select on the causal rows' hot loop)
            for j in range(n_full + part_hi - part_lo):
                if CAUSAL and j >= n_full:
                    q_tok0 = list_tile_start(PartIdx, j - n_full + part_lo, SUB, MASK_BLOCK_Q, BM, DENSE)
                    dk, dv = _bwd_step(k, v, q_smem, do_smem, lse_smem, delta_smem, step_ready, step_empty, dk, dv,
                                       t, qk_scale, key0, q_tok0, True, s_layout, p_layout, LSE_LOG2)
                else:
                    dk, dv = _bwd_step(k, v, q_smem, do_smem, lse_smem, delta_smem, step_ready, step_empty, dk, dv,
                                       t, qk_scale, key0, key0, False, s_layout, p_layout, LSE_LOG2)
                t += 1
        slot = gl.load(rec + 6)
        if slot < 0:  # dK and dV out through this half of the K/V buffer (the item's last products are done)
            k.store((dk * sm_scale).to(k.dtype))
            v.store(dv.to(v.dtype))
            fence_async_shared()
            partition_barrier()
            tma_store(dk_desc, [kv_row, 0], k)
            tma_store(dv_desc, [kv_row, 0], v)
        else:  # a chunk: its share, added to the others' by the merge launches (`merge.ChunkSum`)
            part_rows = (slot * (2 * BN) + HALF * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_layout)))
            offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, acc_layout))  # (HEAD_D,)
            offs = part_rows.to(gl.int64)[:, None] * HEAD_D + offs_d[None, :]  # (64, HEAD_D)
            gl.store(DkPart + offs, dk * sm_scale)
            gl.store(DvPart + offs, dv)
        c += 1
    tma.store_wait(0)


@gluon.jit
def step_buffers(q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, STAGES: gl.constexpr,
                 KV_BUFFERS: gl.constexpr):
    """The shared buffers that the load warp fills (`_bwd_load_partition`): STAGES slots of a query tile's Q, dO,
    lse and delta, and KV_BUFFERS of an item's K and V. Also the one-pass backward's."""
    BM: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    BN: gl.constexpr = k_desc.block_type.shape[0]
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BM, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES, BM, HEAD_D], do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BM], lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BM], delta_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [KV_BUFFERS, BN, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [KV_BUFFERS, BN, HEAD_D], v_desc.layout)
    return q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem


@gluon.jit
def _attn_bwd_dkdv_hopper_kernel(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, dk_desc, dv_desc, DkPart,
                                 DvPart, Items, Starts, FullIdx, PartIdx, Nq, Nk, qk_scale, sm_scale,
                                 GROUPS: gl.constexpr, SUB: gl.constexpr, MASK_BLOCK_Q: gl.constexpr,
                                 DENSE: gl.constexpr, CAUSAL: gl.constexpr, LSE_LOG2: gl.constexpr,
                                 STAGES: gl.constexpr, LOAD_WARP_REGS: gl.constexpr, COMPUTE_REGS: gl.constexpr,
                                 num_warps: gl.constexpr):
    """One resident program per SM; program p walks items [Starts[p], Starts[p + 1]) (`schedule.column_items`)."""
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem = step_buffers(q_desc, do_desc, lse_desc, delta_desc,
                                                                         k_desc, v_desc, STAGES, 2)
    kv_ready, kv_empty = ring_barriers(2)
    step_ready, step_empty = ring_barriers(STAGES)
    gl.warp_specialize([
        (_bwd_compute_partition, (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, kv_ready, kv_empty,
                                  step_ready, step_empty, dk_desc, dv_desc, DkPart, DvPart, Items, Starts, PartIdx,
                                  Nk, qk_scale, sm_scale, GROUPS, SUB, MASK_BLOCK_Q, DENSE, CAUSAL, LSE_LOG2, FIRST_HALF,
                                  num_warps)),  # keys [0, 64) of each item
        (_bwd_compute_partition, (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, kv_ready, kv_empty,
                                  step_ready, step_empty, dk_desc, dv_desc, DkPart, DvPart, Items, Starts, PartIdx,
                                  Nk, qk_scale, sm_scale, GROUPS, SUB, MASK_BLOCK_Q, DENSE, CAUSAL, LSE_LOG2, SECOND_HALF,
                                  num_warps)),  # keys [64, 128)
        (_bwd_load_partition, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem,
                               v_smem, lse_smem, delta_smem, kv_ready, kv_empty, step_ready, step_empty, Items,
                               Starts, FullIdx, PartIdx, Nq, GROUPS, SUB, MASK_BLOCK_Q, DENSE)),
    ], [num_warps, 1], [COMPUTE_REGS, LOAD_WARP_REGS])


def supported(do, q, k, v, index: KernelIndex | None, geometry: MaskGeometry | None) -> bool:
    """Whether this kernel serves the dK/dV launch of the call (see module); the Triton kernel serves the
    rest."""
    return runs_on(q, k, v, do) and shape_supported(q.shape, k.shape, q.dtype, index, geometry)


def shape_supported(q_shape, k_shape, dtype, index: KernelIndex | None, geometry: MaskGeometry | None) -> bool:
    """The part of `supported` that does not ask the GPU: dtype, shapes, the mask's blocks, heads and column
    plan (`pipeline.takes_plan`; index and geometry None: the dense path)."""
    if not shapes_fit(q_shape, k_shape, dtype, geometry) or not takes_plan(None if index is None else index.col_plan):
        return False
    if geometry is not None:
        Hq, Hkv = q_shape[1], k_shape[1]
        if Hq != Hkv and geometry.heads > 1:  # GQA walks every group head's list in one item: they must be one list
            return False
    return True


class DkdvPlan:
    """What one call signature fixes: the item records and their placement on programs, descriptor
    layouts, grid and constexprs. `lse_log2`: the calls pass the log-sum-exp as the Gluon dQ pass stores it for
    this launch (log2 units, +inf for an empty row; `dq.DqPlan`), not the forward's."""

    def __init__(self, q, k, index: KernelIndex | None, geometry: MaskGeometry | None, causal: bool, scale: float,
                 lse_log2: bool = False):
        B, Hq, Nq, D = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        dense = index is None
        BLOCK_M = STEP_ROWS[D]
        block_q = BLOCK_M if dense else geometry.block_q
        sub = block_q // BLOCK_M
        split = (SplitPlan(q.device) if dense else
                 SplitPlan(q.device, index.col_plan, B, Hkv, geometry, D, along="cols", parts=2))
        if split.num_split:  # the chunks of the lists the mask's work plan splits (host sizes: no wait otherwise)
            items, merges = split_items("cols", B, Hq, Hkv, Nq, Nk, index, geometry, split.copy_strides,
                                        split.copies, q.device, BLOCK_N, unit=BLOCK_N)
            self.grid = (min(items.shape[0], num_sms(q.device)), )
            self.items, self.starts = assign_programs(items, self.grid[0], sub * (Hq // Hkv))
        else:
            merges = None
            self.grid = (min(B * Hkv * (Nk // BLOCK_N), num_sms(q.device)), )
            self.items, self.starts = whole_plan("cols", B, Hq, Hkv, Nq, Nk, causal, index, geometry, q.device,
                                                 self.grid[0], sub * (Hq // Hkv), BLOCK_N, BLOCK_M)
        self.chunk_sum = ChunkSum(merges, split, BLOCK_N, D)
        # the dense path reads no list (any tensor will do)
        self.full_idx, self.part_idx = ((self.items, self.items) if dense else
                                        (index.col_full.indices, index.col_partial.indices))
        dtype = GL_DTYPES[q.dtype]
        self.q_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], dtype)
        self.kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
        self.row_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
        self.launch = bound_launch(_attn_bwd_dkdv_hopper_kernel, self.grid[0], (
            self.items, self.starts, self.full_idx, self.part_idx, Nq, Nk, scale * LOG2E, scale),
            dict(GROUPS=Hq // Hkv, SUB=sub, MASK_BLOCK_Q=block_q, DENSE=dense, CAUSAL=causal, LSE_LOG2=lse_log2,
                 STAGES=STEP_BUFFERS[D],
                 LOAD_WARP_REGS=LOAD_REGS, COMPUTE_REGS=COMPUTE_REGS), MAX_REGS)
        self.k_shape, self.dtype, self.device, self.block_m = k.shape, q.dtype, q.device, BLOCK_M

    def __call__(self, q, k, v, do, lse, delta):
        dk = new_output(self.k_shape, self.dtype, self.device)
        dv = new_output(self.k_shape, self.dtype, self.device)
        dk_part, dv_part = self.chunk_sum.scratch(self.device), self.chunk_sum.scratch(self.device)
        half = BLOCK_N // 2  # each compute warpgroup stores its 64 rows
        rows = self.block_m
        descs = (row_spec(q, rows, self.q_layout), row_spec(do, rows, self.q_layout),
                 row_spec(k, BLOCK_N, self.kv_layout), row_spec(v, BLOCK_N, self.kv_layout),
                 vector_spec(lse, rows, self.row_layout), vector_spec(delta, rows, self.row_layout),
                 row_spec(dk, half, self.kv_layout), row_spec(dv, half, self.kv_layout))
        self.launch(*descs, dk_part, dv_part)
        self.chunk_sum(dk, dk_part)
        self.chunk_sum(dv, dv_part)
        return dk, dv


def compile_sm90(dtype: torch.dtype = torch.bfloat16, dense: bool = False, causal: bool = False,
                 block_q: int = BLOCK_N, groups: int = 1, head_dim: int = 128, lse_log2: bool = True):
    """The kernel compiled for sm_90a on any machine (no GPU needed), as the launcher would launch it at
    D = `head_dim`; for compile checks (tests/test_codegen.py) and `benchmarks/kernel_resources.py`."""
    D = head_dim
    BLOCK_M = STEP_ROWS[D]
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    q_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], GL_DTYPES[dtype])
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], GL_DTYPES[dtype])
    row_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    q_desc, kv_desc = descriptor_type(name, (BLOCK_M, D), q_layout), descriptor_type(name, (BLOCK_N, D), kv_layout)
    out_desc, row_desc = descriptor_type(name, (BLOCK_N // 2, D), kv_layout), descriptor_type("fp32", (BLOCK_M, ), row_layout)
    sig = dict(q_desc=q_desc, do_desc=q_desc, k_desc=kv_desc, v_desc=kv_desc, lse_desc=row_desc, delta_desc=row_desc,
               dk_desc=out_desc, dv_desc=out_desc, DkPart="*fp32", DvPart="*fp32", Items="*i32", Starts="*i32",
               FullIdx="*i32", PartIdx="*i32", Nq="i32", Nk="i32", qk_scale="fp32", sm_scale="fp32")
    constexprs = dict(GROUPS=groups, SUB=1 if dense else block_q // BLOCK_M, MASK_BLOCK_Q=BLOCK_M if dense else block_q,
                      DENSE=dense, CAUSAL=causal, LSE_LOG2=lse_log2, STAGES=STEP_BUFFERS[D], LOAD_WARP_REGS=LOAD_REGS,
                      COMPUTE_REGS=COMPUTE_REGS, num_warps=4)
    return compile_gluon_sm90(_attn_bwd_dkdv_hopper_kernel, sig, constexprs, MAX_REGS)

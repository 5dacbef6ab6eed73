"""Forward kernel for Hopper GPUs with producer and consumer warps, written in Gluon.

Gluon is Triton's lower-level dialect: shared-memory buffers, barriers, layouts and warp roles are
spelled out. This kernel runs one resident program per SM, each looping over its share of the work
items (a query tile of one (batch, head) and its lists of key blocks: the full blocks, then the blocks on
the causal diagonal, which take an element mask), shares balanced by their key tiles on the host
(`schedule.assign_programs`). Inside a program:

- one *load* warp issues TMA copies: the next item's Q tile into one of two Q buffers, and K and V tiles
  into rings of K_BUFFERS and V_BUFFERS buffers, each signalled on an mbarrier when it lands;
- two *compute* warpgroups (4 warps each), one per half of the item's 128 query rows, run S = Q K^T and
  O += P V on the tensor cores (`warpgroup_mma`) with the online softmax between them, release each K
  and V buffer and the Q buffer as soon as the products that read them are done, and store O and the
  log-sum-exp. The two warpgroups share the K and V tiles but do not wait for each other, so one's
  softmax runs while the other's products do.

The load warp runs ahead of the products, across items: the next item's Q and first K/V tiles arrive
while this item's last products and its store run, which the one-item-per-program kernel (`triton/fwd.py`)
cannot overlap (docs/tuning-log.md, step 37: about 70 us per call at 16,384 tokens, D = 128).

It serves the calls it was written for (`supported`), and `triton/fwd.py` serves everything else: 16-bit
inputs, D = 128 or 64 (`pipeline.head_dims`), both sequence lengths multiples of 128 and of the mask's blocks (so no block ends in a
sequence tail), mask blocks multiples of 128, contiguous tensors, and a GPU of compute capability 9.0
(H100, H200); causal or not. Where the mask's work plan splits long lists (global rows), each chunk is an
item of its own writing to scratch rows, and a second launch merges the chunks (`merge.py`; switched by
`settings.hopper_split`). Importing this module needs a Triton with Gluon (3.5 or newer); `dispatch.py`
imports it only when it can.
"""

from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ...mask_index import KernelIndex, MaskGeometry
from ..aot import compile_gluon_sm90, descriptor_type
from ..launch import cached_plan, plan_key
from ..memory import new_output
from ..schedule import assign_programs, split_items, whole_plan
from ..triton.common import LOG2E
from ..triton.split import SplitPlan
from .merge import RowMerge
from .pipeline import (FIRST_HALF, GL_DTYPES, ITEM_WIDTH, SECOND_HALF, bound_launch, list_tile_start, load_kv,
                       num_sms, partition_barrier, release, release_after_store, ring_barriers, row_spec,
                       runs_on, shapes_fit, takes_plan, tma_load, tma_store)

BLOCK = 128  # query rows per item and key rows per K/V stage
K_BUFFERS, V_BUFFERS = 2, 3  # K and V tiles in flight per program: with two Q buffers, 224 KB at D = 128
LOAD_REGS = 24  # registers per thread of the load warp
COMPUTE_REGS = 224  # registers per thread of the second compute warpgroup (the first gets what is left: 256)
PAIRED_REGS = 240  # the same where two tiles share a turn at D = 128 (both compute warpgroups get 240)
MAX_REGS = 168  # registers per thread of the whole program (12 warps: 8 compute, 4 for the load warp's group)


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                    v_empty, Items, Starts, FullIdx, PartIdx, Nq, SUB: gl.constexpr, MASK_BLOCK_K: gl.constexpr,
                    DENSE: gl.constexpr, DEAD_TILES: gl.constexpr):
    """The load warp: for each of this program's items, Q into a free Q buffer, then every K and V tile of
    the item's full list and then of its partial list (those holding an allowed pair, `_partial_tiles`) into
    the next free buffers of the K and V rings. Waits only for buffers to be freed."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    t = 0  # K/V tiles issued so far (ring positions)
    c = 0  # items issued so far (Q buffer position)
    for it in range(gl.load(Starts + gl.program_id(0)), gl.load(Starts + gl.program_id(0) + 1)):
        rec = Items + it * ITEM_WIDTH
        q_row = gl.load(rec)
        kv_row = gl.load(rec + 1)
        qb = c % 2
        mbarrier.wait(q_empty.index(qb), ((c // 2) & 1) ^ 1)
        mbarrier.expect(q_ready.index(qb), q_desc.block_type.nbytes)
        tma_load(q_desc, [q_row, 0], q_ready.index(qb), q_smem.index(qb))
        for j in range(gl.load(rec + 2) * SUB, gl.load(rec + 3) * SUB):
            start = list_tile_start(FullIdx, j, SUB, MASK_BLOCK_K, BLOCK_N, DENSE)
            load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, kv_row + start, t)
            t += 1
        plo = gl.load(rec + 4)
        n_part = _partial_tiles(PartIdx, plo, gl.load(rec + 5), q_row % Nq + BLOCK_M - 1, SUB, MASK_BLOCK_K, BLOCK_N,
                                DENSE, DEAD_TILES)
        for j in range(plo * SUB, plo * SUB + n_part):
            start = list_tile_start(PartIdx, j, SUB, MASK_BLOCK_K, BLOCK_N, DENSE)
            load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, kv_row + start, t)
            t += 1
        c += 1


@gluon.jit
def _partial_tiles(PartIdx, plo, phi, q_last, SUB: gl.constexpr, MASK_BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr,
                   DENSE: gl.constexpr, DEAD_TILES: gl.constexpr):
    """How many tiles of the item's partial list [plo, phi) the item walks: with DEAD_TILES (causal, mask
    blocks over 128 tokens: a partial block may reach past the item's last query), those starting at or
    before its last query `q_last` (the tiles after the diagonal one allow no pair: they are skipped, which
    also keeps a non-finite value there out of the item's rows, never 0 x NaN); all of them otherwise."""
    n = (phi - plo) * SUB
    if DEAD_TILES:
        live = 0
        for j in range(plo * SUB, phi * SUB):
            live += (list_tile_start(PartIdx, j, SUB, MASK_BLOCK_K, BLOCK_N, DENSE) <= q_last).to(gl.int32)
        n = live
    return n


@gluon.jit
def _issue_qk(q, k_smem, k_ready, t, zero_s):
    """Start S = Q K^T for K tile number t of the ring (asynchronous: wait before reading it)."""
    K_STAGES: gl.constexpr = k_smem.type.shape[0]
    sk = t % K_STAGES
    mbarrier.wait(k_ready.index(sk), (t // K_STAGES) & 1)
    return warpgroup_mma(q, k_smem.index(sk).permute((1, 0)), zero_s, use_acc=False, is_async=True)


@gluon.jit
def _softmax(qk, m_i, l_i, qk_scale):
    """Online softmax of one score tile, log2 units: (p, alpha, m_new, l_new)."""
    m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)  # (BLOCK_M,)
    # A row with no allowed key so far keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(qk * qk_scale - m_use[:, None])  # (BLOCK_M, BLOCK_N); scale and shift in one multiply-add
    alpha = gl.exp2(m_i - m_use)  # (BLOCK_M,) rescales what was accumulated under the old maximum
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _mask_partial(qk, j, n_full, plo, PartIdx, q_tok, SUB: gl.constexpr, MASK_BLOCK_K: gl.constexpr,
                  DENSE: gl.constexpr, CAUSAL: gl.constexpr):
    """Scores of the item's tile j with the causal element mask (key <= query) where j is a tile of its
    partial list (the blocks on the diagonal); the full list's tiles need none."""
    if CAUSAL:
        if j >= n_full:
            BLOCK_M: gl.constexpr = qk.type.shape[0]
            BLOCK_N: gl.constexpr = qk.type.shape[1]
            start = list_tile_start(PartIdx, plo * SUB + j - n_full, SUB, MASK_BLOCK_K, BLOCK_N, DENSE)
            cols = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, qk.type.layout))  # (BLOCK_N,)
            rows = q_tok + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, qk.type.layout))  # (BLOCK_M,)
            qk = gl.where(cols[None, :] <= rows[:, None], qk, float("-inf"))
    return qk


@gluon.jit
def _issue_pv(acc, alpha, p, v_smem, v_ready, t, o_rows: gl.constexpr, p_layout: gl.constexpr):
    """Rescale O and start O += P V for V tile number t of the ring (asynchronous)."""
    V_STAGES: gl.constexpr = v_smem.type.shape[0]
    sv = t % V_STAGES
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    p16 = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    mbarrier.wait(v_ready.index(sv), (t // V_STAGES) & 1)
    return warpgroup_mma(p16, v_smem.index(sv), acc, is_async=True)


@gluon.jit
def _tile_step(qk, acc, m_i, l_i, t, q, k_smem, k_ready, k_empty, v_smem, v_ready, v_empty, zero_s, qk_scale,
               o_rows: gl.constexpr, p_layout: gl.constexpr):
    """A tile of an item (ring position t) but its last: S of the next tile starts on the tensor cores, the
    online softmax of this one (`qk`) runs under it, then O += P V; both K and V buffers are released once every
    warp of the warpgroup is past both products. Returns `(acc, qk of the next tile, m_i, l_i)`.

    No causal element mask: only an item's last live tile can need one. Its query rows and the key tiles are
    128-aligned (`supported`), so a tile before the diagonal one is wholly allowed, and the lists walk their
    blocks in ascending order, the diagonal block (partial list) after the full list, the dead tiles of a
    block larger than a tile left out (`_partial_tiles`)."""
    K_STAGES: gl.constexpr = k_smem.type.shape[0]
    V_STAGES: gl.constexpr = v_smem.type.shape[0]
    qk_next = _issue_qk(q, k_smem, k_ready, t + 1, zero_s)  # runs under this tile's softmax
    p, alpha, m_i, l_i = _softmax(qk, m_i, l_i, qk_scale)
    acc = _issue_pv(acc, alpha, p, v_smem, v_ready, t, o_rows, p_layout)
    acc, qk_next = warpgroup_mma_wait(num_outstanding=0, deps=(acc, qk_next))
    partition_barrier()  # every warp of the warpgroup is past both products
    mbarrier.arrive(v_empty.index(t % V_STAGES), count=1)
    mbarrier.arrive(k_empty.index((t + 1) % K_STAGES), count=1)
    return acc, qk_next, m_i, l_i


@gluon.jit
def _diagonal_pv(acc, alpha, p, m_i, q, v_smem, v_ready, t, K, V, kv_row, key0, q_tok, qk_scale,
                 o_layout: gl.constexpr, p_layout: gl.constexpr, HEAD_D: gl.constexpr):
    """Rescale O and add P V of the causal diagonal tile (V tile number t of the ring, keys from `key0`, rows
    `kv_row + key0 ..` of K and V), exactly under the rule for non-finite inputs.

    The tile's product runs on the tensor cores into its own accumulator. Where it holds a non-finite value,
    which a NaN or infinity in V would also put into rows that do not attend its key (a left-out pair has
    P = 0, and 0 x NaN is NaN), the tile is summed again on the CUDA cores over the allowed pairs only
    (`_diagonal_exact`): only inputs with such values pay for it. The test is one sum of the tile: a NaN or
    an infinity among its elements leaves the sum non-finite (a sum of finite elements that overflows only
    sends a finite tile down the exact path, which gives the same values); comparing every element cost the
    causal forward 3-4% (tuning log, step 111). P is not kept for that rare path (it cost the common one 72
    bytes of register spills): the exact path recomputes it."""
    V_STAGES: gl.constexpr = v_smem.type.shape[0]
    BLOCK_M: gl.constexpr = acc.type.shape[0]
    sv = t % V_STAGES
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    mbarrier.wait(v_ready.index(sv), (t // V_STAGES) & 1)
    tile = warpgroup_mma(gl.convert_layout(p.to(v_smem.dtype), p_layout), v_smem.index(sv),
                         gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout), use_acc=False, is_async=True)
    tile = warpgroup_mma_wait(num_outstanding=0, deps=(tile, ))
    total = gl.sum(gl.sum(tile, 1), 0)  # non-finite where any element of the tile is
    if (total != total) | (gl.abs(total) == float("inf")):
        acc = _diagonal_exact(acc, m_i, q, K, V, kv_row + key0, key0, q_tok, qk_scale, o_layout, v_smem.dtype,
                              v_smem.type.shape[1])
    else:
        acc = acc + tile
    return acc


@gluon.jit
def _diagonal_exact(acc, m_i, q, K, V, k_row, key0, q_tok, qk_scale, o_layout: gl.constexpr, dtype: gl.constexpr,
                    BLOCK_N: gl.constexpr):
    """`acc` plus P V of a causal diagonal tile over its allowed pairs only (key <= query), one key at a time:
    S from Q (`q`, this warpgroup's rows in shared memory) and K in global memory, P = exp2(S - m) rounded to
    V's dtype as the tensor cores take it, V from global memory. (BLOCK_M, HEAD_D) float32. A non-finite value
    at key j reaches the rows that attend j and no other."""
    BLOCK_M: gl.constexpr = acc.type.shape[0]
    HEAD_D: gl.constexpr = acc.type.shape[1]
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    rows = q_tok + gl.arange(0, BLOCK_M, layout=o_rows)  # (BLOCK_M,)
    offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))  # (HEAD_D,)
    m = gl.convert_layout(m_i, o_rows)
    m = gl.where(m == float("-inf"), 0.0, m)  # as `_softmax` shifts
    qf = q.load(o_layout).to(gl.float32)  # (BLOCK_M, HEAD_D)
    for j in range(BLOCK_N):
        k_j = gl.load(K + (k_row + j).to(gl.int64) * HEAD_D + offs_d).to(gl.float32)  # (HEAD_D,)
        v_j = gl.load(V + (k_row + j).to(gl.int64) * HEAD_D + offs_d).to(gl.float32)  # (HEAD_D,)
        p_j = gl.exp2(gl.sum(qf * k_j[None, :], 1) * qk_scale - m).to(dtype).to(gl.float32)  # (BLOCK_M,)
        acc += gl.where((key0 + j <= rows)[:, None], p_j[:, None] * v_j[None, :], 0.0)
    return acc


@gluon.jit
def _store_lse(L, row, m_i, l_safe, empty, offs_m):
    """Rows [row, row + BLOCK_M) of the log-sum-exp L: natural log, -inf for an empty row."""
    gl.store(L + row + offs_m, gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453))


@gluon.jit
def _store_tile(O, L, row, out, m_i, l_safe, empty, offs_mo, offs_m, offs_d):
    """Rows [row, row + BLOCK_M) of O (in O's dtype) and of the log-sum-exp L, from registers."""
    HEAD_D: gl.constexpr = offs_d.shape[0]
    rows = row.to(gl.int64) + offs_mo  # (BLOCK_M,)
    gl.store(O + rows[:, None] * HEAD_D + offs_d[None, :], out.to(O.dtype.element_ty))
    _store_lse(L, row, m_i, l_safe, empty, offs_m)


@gluon.jit
def _store_tile_tma(o_desc, o_smem, L, row, out, m_i, l_safe, empty, offs_m):
    """Rows [row, row + BLOCK_M) of O through `o_smem` by an asynchronous TMA store (storing from the
    accumulator's registers took 16-33% of the time on short lists, tuning log, step 44), and of the log-sum-exp."""
    o_smem.store(out.to(o_smem.dtype))
    fence_async_shared()  # the shared-memory writes before the TMA engine reads them
    partition_barrier()  # every warp's rows are written
    tma_store(o_desc, [row, 0], o_smem)
    _store_lse(L, row, m_i, l_safe, empty, offs_m)


@gluon.jit
def _compute_partition(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc, Lse,
                       OutPart, LsePart, K, V, Items, Starts, PartIdx, Nq, qk_scale, SUB: gl.constexpr,
                       MASK_BLOCK_K: gl.constexpr, DENSE: gl.constexpr, CAUSAL: gl.constexpr, DEAD_TILES: gl.constexpr,
                       SPLIT: gl.constexpr, PAIRED: gl.constexpr, HALF: gl.constexpr, WARPS: gl.constexpr):
    """One compute warpgroup: the online softmax over each item's K/V tiles for its half of the item's
    query rows, then O and the log-sum-exp (SPLIT: for a chunk of a split list, into its scratch rows).

    S for tile j + 1 is computed on the tensor cores while the softmax of tile j runs on the CUDA cores;
    O += P V then runs alone in this warpgroup, under the other warpgroup's softmax.
    """
    BLOCK_M: gl.constexpr = q_smem.type.shape[1] // 2  # this warpgroup's half of the item's query rows
    HEAD_D: gl.constexpr = q_smem.type.shape[2]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    K_STAGES: gl.constexpr = k_smem.type.shape[0]
    V_STAGES: gl.constexpr = v_smem.type.shape[0]
    # wgmma accumulators: rows split over the warps (16 rows each), k = 16 for 16-bit operands
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_cols: gl.constexpr = gl.SliceLayout(0, o_layout)

    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)  # (BLOCK_M, BLOCK_N), unused (use_acc=False)
    offs_m = gl.arange(0, BLOCK_M, layout=s_rows)  # (BLOCK_M,)
    offs_mo = gl.arange(0, BLOCK_M, layout=o_rows)  # (BLOCK_M,)
    offs_d = gl.arange(0, HEAD_D, layout=o_cols)  # (HEAD_D,)
    t = 0  # K/V tiles consumed so far (ring positions, as in the load warp)
    c = 0
    for it in range(gl.load(Starts + gl.program_id(0)), gl.load(Starts + gl.program_id(0) + 1)):
        rec = Items + it * ITEM_WIDTH
        q_row = gl.load(rec) + HALF * BLOCK_M  # this warpgroup's first row of Q, O and the log-sum-exp
        q_tok = q_row % Nq  # its position in the sequence
        n_full = (gl.load(rec + 3) - gl.load(rec + 2)) * SUB
        plo = gl.load(rec + 4)
        n_tiles = n_full + _partial_tiles(PartIdx, plo, gl.load(rec + 5), q_tok - HALF * BLOCK_M + 2 * BLOCK_M - 1, SUB,
                                          MASK_BLOCK_K, BLOCK_N, DENSE, DEAD_TILES)
        qb = c % 2
        mbarrier.wait(q_ready.index(qb), (c // 2) & 1)
        q = q_smem.index(qb).slice(HALF * BLOCK_M, BLOCK_M)  # (BLOCK_M, HEAD_D) in shared memory
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, s_rows)  # running max, log2 units
        l_i = gl.zeros([BLOCK_M], gl.float32, s_rows)  # running sum of exp2
        acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)  # (BLOCK_M, HEAD_D) unnormalised O
        if n_tiles > 0:
            qk = _issue_qk(q, k_smem, k_ready, t, zero_s)
            qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))  # (BLOCK_M, BLOCK_N) scores of tile 0
            release(k_empty.index(t % K_STAGES))
            if c > 0:  # the item before's O has left its Q buffer: the item after next may load its Q there
                release_after_store(q_empty.index((c + 1) % 2))
            # PAIRED (`_paired`): two tiles per turn, S alternating between two register sets (qk, qk_odd), so
            # no turn copies the next tile's scores into the set the loop carries (64 moves per tile, 13% of its
            # instructions; tuning log, steps 96 and 99).
            for pair in range((n_tiles - 1) // 2 if PAIRED else 0):
                acc, qk_odd, m_i, l_i = _tile_step(qk, acc, m_i, l_i, t, q, k_smem, k_ready, k_empty, v_smem, v_ready,
                                                   v_empty, zero_s, qk_scale, o_rows, p_layout)
                acc, qk, m_i, l_i = _tile_step(qk_odd, acc, m_i, l_i, t + 1, q, k_smem, k_ready, k_empty, v_smem,
                                               v_ready, v_empty, zero_s, qk_scale, o_rows, p_layout)
                t += 2
            for j in range(2 * ((n_tiles - 1) // 2) if PAIRED else 0, n_tiles - 1):
                acc, qk, m_i, l_i = _tile_step(qk, acc, m_i, l_i, t, q, k_smem, k_ready, k_empty, v_smem, v_ready,
                                               v_empty, zero_s, qk_scale, o_rows, p_layout)
                t += 1
            qk = _mask_partial(qk, n_tiles - 1, n_full, plo, PartIdx, q_tok, SUB, MASK_BLOCK_K, DENSE, CAUSAL)
            p, alpha, m_i, l_i = _softmax(qk, m_i, l_i, qk_scale)
            if CAUSAL:
                if n_tiles > n_full:  # the last tile is a partial one: on the causal diagonal
                    key0 = list_tile_start(PartIdx, plo * SUB + n_tiles - 1 - n_full, SUB, MASK_BLOCK_K, BLOCK_N,
                                           DENSE)
                    acc = _diagonal_pv(acc, alpha, p, m_i, q, v_smem, v_ready, t, K, V, gl.load(rec + 1), key0,
                                       q_tok, qk_scale, o_layout, p_layout, HEAD_D)
                else:
                    acc = _issue_pv(acc, alpha, p, v_smem, v_ready, t, o_rows, p_layout)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            else:
                acc = _issue_pv(acc, alpha, p, v_smem, v_ready, t, o_rows, p_layout)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            release(v_empty.index(t % V_STAGES))
            t += 1
        elif c > 0:
            release_after_store(q_empty.index((c + 1) % 2))
        # Empty rows (no allowed key): output 0 and lse -inf, never 0/0.
        empty = l_i == 0.0
        l_safe = gl.where(empty, 1.0, l_i)
        out = acc / gl.convert_layout(l_safe, o_rows)[:, None]  # (BLOCK_M, HEAD_D)
        # O goes out through this warpgroup's half of the item's Q buffer (its last S is done) by a TMA
        # store; the buffer is released once the store has read it, during the next item.
        o_smem = q_smem.index(qb).slice(HALF * BLOCK_M, BLOCK_M)
        if SPLIT:  # a chunk of a split list: into its scratch rows (-1: the list is not split)
            scratch = gl.load(rec + 6)
            if scratch >= 0:
                _store_tile(OutPart, LsePart, scratch + HALF * BLOCK_M, out, m_i, l_safe, empty, offs_mo, offs_m,
                            offs_d)
            else:
                _store_tile_tma(o_desc, o_smem, Lse, q_row, out, m_i, l_safe, empty, offs_m)
        else:
            _store_tile_tma(o_desc, o_smem, Lse, q_row, out, m_i, l_safe, empty, offs_m)
        c += 1
    tma.store_wait(0)  # the last O stores read shared memory until they complete


@gluon.jit
def _attn_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, Lse, OutPart, LsePart, K, V, Items, Starts, FullIdx,
                            PartIdx, Nq, qk_scale, SUB: gl.constexpr, MASK_BLOCK_K: gl.constexpr, DENSE: gl.constexpr,
                            CAUSAL: gl.constexpr, DEAD_TILES: gl.constexpr, SPLIT: gl.constexpr,
                            K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, PAIRED: gl.constexpr,
                            LOAD_WARP_REGS: gl.constexpr, COMPUTE_REGS: gl.constexpr, num_warps: gl.constexpr):
    """One resident program per SM; program p walks items [Starts[p], Starts[p + 1]) (`hopper.assign_programs`)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_M, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [K_STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [V_STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_ready, q_empty = ring_barriers(2)
    k_ready, k_empty = ring_barriers(K_STAGES)
    v_ready, v_empty = ring_barriers(V_STAGES)
    gl.warp_specialize([
        (_compute_partition, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc, Lse,
                              OutPart, LsePart, K, V, Items, Starts, PartIdx, Nq, qk_scale, SUB, MASK_BLOCK_K, DENSE,
                              CAUSAL, DEAD_TILES, SPLIT, PAIRED, FIRST_HALF, num_warps)),  # rows [0, 64) of each item
        (_compute_partition, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc, Lse,
                              OutPart, LsePart, K, V, Items, Starts, PartIdx, Nq, qk_scale, SUB, MASK_BLOCK_K, DENSE,
                              CAUSAL, DEAD_TILES, SPLIT, PAIRED, SECOND_HALF, num_warps)),  # query rows [64, 128)
        (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                           v_empty, Items, Starts, FullIdx, PartIdx, Nq, SUB, MASK_BLOCK_K, DENSE, DEAD_TILES)),
    ], [num_warps, 1], [COMPUTE_REGS, LOAD_WARP_REGS])


def supported(q, k, v, index: KernelIndex | None, geometry: MaskGeometry | None) -> bool:
    """Whether this kernel serves the call (see module), causal or not; `triton/fwd.py` serves the rest."""
    return runs_on(q, k, v) and shape_supported(q.shape, k.shape, q.dtype, index, geometry)


def shape_supported(q_shape, k_shape, dtype, index: KernelIndex | None, geometry: MaskGeometry | None) -> bool:
    """The part of `supported` that does not ask the GPU: dtype, shapes and the mask's blocks and lists.

    D = 128, and 64 with `settings.hopper_d64` (`pipeline.head_dims`). Masks whose work plan splits long
    lists (tuning log, steps 43-44): `pipeline.takes_plan`.
    """
    return shapes_fit(q_shape, k_shape, dtype, geometry) and takes_plan(None if index is None else index.row_plan)


class FwdPlan:
    """What one call signature fixes: the item records, descriptor layouts, grid and constexprs, and for
    split lists their scratch (`split.SplitPlan`) and merge records."""

    def __init__(self, q, k, v, index: KernelIndex | None, geometry: MaskGeometry | None, causal: bool, scale: float):
        B, Hq, Nq, D = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        dense = index is None
        split = not dense and index.row_plan.split.shape[0] > 0
        self.split = SplitPlan(q.device)
        self.merge = None
        if split:
            self.split = SplitPlan(q.device, index.row_plan, B, Hq, geometry, D, with_lse=True)
            self.items, merges = split_items("rows", B, Hq, Hkv, Nq, Nk, index, geometry,
                                             self.split.copy_strides, self.split.copies, q.device, BLOCK)
            self.merge = RowMerge(merges, self.split.copies, geometry.block_q, BLOCK, D)
        block_k = BLOCK if dense else geometry.block_k
        if split:
            self.grid = (min(self.items.shape[0], num_sms(q.device)), )
            self.items, self.starts = assign_programs(self.items, self.grid[0], block_k // BLOCK)
        else:
            self.grid = (min(B * Hq * (Nq // BLOCK), num_sms(q.device)), )
            self.items, self.starts = whole_plan("rows", B, Hq, Hkv, Nq, Nk, causal, index, geometry, q.device,
                                                 self.grid[0], block_k // BLOCK)
        # the dense path reads no list (any tensor will do)
        self.full_idx, self.part_idx = ((self.items, self.items) if dense else
                                        (index.row_full.indices, index.row_partial.indices))
        self.layout = gl.NVMMASharedLayout.get_default_for([BLOCK, D], GL_DTYPES[q.dtype])
        self.D = D
        self.launch = bound_launch(_attn_fwd_hopper_kernel, self.grid[0], (
            self.items, self.starts, self.full_idx, self.part_idx, Nq, scale * LOG2E),
            _constexprs(block_k, dense, causal, split, BLOCK if dense else geometry.block_q, D,
                        math.inf if dense else _mean_tiles(index, geometry)), MAX_REGS)
        self.out_shape, self.lse_shape, self.dtype, self.device = q.shape, (B, Hq, Nq), q.dtype, q.device

    def __call__(self, q, k, v):
        out = new_output(self.out_shape, self.dtype, self.device)
        lse = new_output(self.lse_shape, torch.float32, self.device)
        part, _, lse_part = self.split.scratch()
        descs = [row_spec(t, rows, self.layout)
                 for t, rows in ((q, BLOCK), (k, BLOCK), (v, BLOCK), (out, BLOCK // 2))]  # out: per warpgroup
        self.launch(*descs, lse, part, lse_part, k, v)  # k and v also as pointers: `_diagonal_exact` reads them
        if self.merge is not None:
            self.merge(out, lse, part, lse_part)
        return out, lse


PAIRED_MIN_TILES = 6  # the mean K/V tiles per item from which two tiles share a turn (`_paired`)


def _paired(head_dim: int, causal: bool, sub: int, mean_tiles: float = math.inf) -> bool:
    """Whether the compute warpgroups take two score tiles per turn of their loop: at D = 64 (step 96), and at
    D = 128 without the causal flag on 128-token key blocks, with 240 registers for each compute warpgroup
    (step 99; ptxas: 522 -> 440 instructions per tile, no spills). At D = 128 the causal kernel spills paired
    (256 bytes; 491 instructions per tile against 456 in one tile per turn, step 104) and so does the one of
    256-token key blocks (2.1 KB): they keep one tile per turn.

    Only where the items walk `PAIRED_MIN_TILES` tiles or more on average (`mean_tiles`): on the H200 the
    paired loop gained 1-6% on dense rows and on lists of 6-52 tiles, and lost 8-22% on lists of 4-5
    (Longformer, random at 4,096 tokens; tuning log, step 102), whose items run the pair's code and the odd
    tile's both, once each."""
    return mean_tiles >= PAIRED_MIN_TILES and (head_dim <= 64 or (not causal and sub == 1))


def _mean_tiles(index: KernelIndex, geometry: MaskGeometry) -> float:
    """The K/V tiles (`BLOCK` keys each) that a query block's row list holds on average: its blocks, full and
    partial, over the lists (host sizes: nothing read from the device)."""
    lists = geometry.batch * geometry.heads * geometry.blocks_q
    blocks = int(index.row_full.indices.shape[0]) + int(index.row_partial.indices.shape[0])
    return blocks * (geometry.block_k // BLOCK) / max(lists, 1)


def _constexprs(block_k: int, dense: bool, causal: bool, split: bool, block_q: int, head_dim: int,
                mean_tiles: float = math.inf) -> dict:
    dead_tiles = causal and max(block_q, block_k) > BLOCK  # a partial block may reach past an item's rows
    paired = _paired(head_dim, causal, block_k // BLOCK, mean_tiles)
    return dict(SUB=block_k // BLOCK, MASK_BLOCK_K=block_k, DENSE=dense, CAUSAL=causal, DEAD_TILES=dead_tiles,
                SPLIT=split, K_STAGES=K_BUFFERS, V_STAGES=V_BUFFERS, PAIRED=paired, LOAD_WARP_REGS=LOAD_REGS,
                COMPUTE_REGS=PAIRED_REGS if paired and head_dim > 64 else COMPUTE_REGS)


def attn_fwd(q, k, v, index: KernelIndex | None, geometry: MaskGeometry | None, causal: bool, scale: float,
             plans: dict | None = None):
    """`triton.fwd.attn_fwd` for the calls that `supported` accepts; same arguments and results."""
    key = plan_key((q, k, v), "fwd-gluon", causal, scale)
    plan = cached_plan(plans, key, lambda: FwdPlan(q, k, v, index, geometry, causal, scale))
    return plan(q, k, v)


def compile_sm90(dtype: torch.dtype = torch.bfloat16, dense: bool = False, causal: bool = False, block_k: int = BLOCK,
                 split: bool = False, block_q: int | None = None, head_dim: int = 128, mean_tiles: float = math.inf):
    """The kernel compiled for sm_90a on any machine (no GPU needed), as the launcher would launch it at
    D = `head_dim` for items of `mean_tiles` K/V tiles on average (`_paired`); for compile checks
    (tests/test_codegen.py) and `benchmarks/kernel_resources.py`."""
    D = head_dim
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK, D], GL_DTYPES[dtype])
    desc = descriptor_type(name, (BLOCK, D), layout)
    sig = dict(q_desc=desc, k_desc=desc, v_desc=desc, o_desc=descriptor_type(name, (BLOCK // 2, D), layout),
               Lse="*fp32", OutPart="*fp32", LsePart="*fp32", K=f"*{name}", V=f"*{name}", Items="*i32",
               Starts="*i32", FullIdx="*i32",
               PartIdx="*i32", Nq="i32", qk_scale="fp32")
    constexprs = _constexprs(block_k, dense, causal, split, block_q or (BLOCK if dense else block_k), D, mean_tiles)
    return compile_gluon_sm90(_attn_fwd_hopper_kernel, sig, dict(constexprs, num_warps=4), MAX_REGS)

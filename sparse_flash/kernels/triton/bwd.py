"""Backward kernels: recompute P from q, k and the saved log-sum-exp, block by block.

Two launches; gradients are deterministic (no atomics on them):
1. `_attn_bwd_dq_kernel`: one program per (query tile, batch x head) first computes delta = rowsum(dO * O)
   for its rows and stores it, then walks its row lists, accumulating dQ.
2. `_attn_bwd_dkdv_kernel`: one program per (key tile, batch x KV head) walks its key block's column lists
   of query blocks, for every query head sharing that KV head (GQA), accumulating dK and dV on chip; it
   reads the delta that launch 1 stored.
A list that the mask's work plan splits gets one program per chunk; chunks write partial sums to scratch
and the list's last chunk adds them up in chunk order (`split.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...mask_index import KernelIndex, MaskGeometry
from ..launch import BoundLaunch, cdiv
from ..memory import new_output
from .common import (ITEM_BLOCK, LOG2E, dense_key_tiles, dot_precision, item_ranges, list_ranges, list_tile_start,
                     load_unmasked_rows, schedule, store_rows)
from .configs import block_d, bwd_config, schedule_heads
from .split import SplitPlan, chunk_rows, last_chunk, store_chunk_sum
from .tma import descriptor_layout, make_descriptor


@triton.jit
def _load_lse_log2(Lse, offs_m, Nq):
    """The saved lse in log2 units; empty rows (lse = -inf) become +inf so that their P is 0, not inf."""
    lse = tl.load(Lse + offs_m, mask=offs_m < Nq, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)


@triton.jit
def _dkdv_tile(
    dk, dv, k, v, Q, DO, q_b, q_h, Lse, Delta, start_m, offs_n, offs_d, stride_qm, stride_dm, Nq, qk_scale,
    HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    """Add one query tile's contribution to the dK and dV of a key tile.

    TMA: Q and DO are tensor descriptors of the whole (B, Hq, Nq, D) tensors, read at (q_b, q_h, start_m);
    otherwise pointers already offset to this (batch, head).
    """
    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    d_ok = offs_d < HEAD_DIM
    if TMA:  # rows past Nq and columns past HEAD_DIM arrive as zeros
        BLOCK_D: tl.constexpr = offs_d.shape[0]
        qt = tl.trans(Q.load([q_b, q_h, start_m, 0]).reshape(BLOCK_M, BLOCK_D))  # (BLOCK_D, BLOCK_M)
        do = DO.load([q_b, q_h, start_m, 0]).reshape(BLOCK_M, BLOCK_D)  # (BLOCK_M, BLOCK_D)
    elif MASKED:
        m_ok = offs_m < Nq
        qt = tl.load(Q + offs_m[None, :] * stride_qm + offs_d[:, None], mask=d_ok[:, None] & m_ok[None, :], other=0.0)
        do = tl.load(DO + offs_m[:, None] * stride_dm + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        qt = load_unmasked_rows(Q + offs_m[None, :] * stride_qm + offs_d[:, None], d_ok[:, None], EVEN_D)  # (BLOCK_D, BLOCK_M)
        do = load_unmasked_rows(DO + offs_m[:, None] * stride_dm + offs_d[None, :], d_ok[None, :], EVEN_D)  # (BLOCK_M, BLOCK_D)
    lse = _load_lse_log2(Lse, offs_m, Nq)  # (BLOCK_M,)
    delta = tl.load(Delta + offs_m, mask=offs_m < Nq, other=0.0)  # (BLOCK_M,)
    st = tl.dot(k, qt, input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M) scores^T, log2 units
    pt = tl.math.exp2(st - lse[None, :])  # (BLOCK_N, BLOCK_M) P^T
    if MASKED and CAUSAL:
        pt = tl.where(offs_m[None, :] >= offs_n[:, None], pt, 0.0)
    dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_D)
    dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M) dP^T
    dst = pt * (dpt - delta[None, :])  # (BLOCK_N, BLOCK_M) dS^T
    if MASKED and CAUSAL:  # a pair left out stays 0 even where dP or delta is not finite (never 0 x NaN)
        dst = tl.where(offs_m[None, :] >= offs_n[:, None], dst, 0.0)
    dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_D)
    return dk, dv


@triton.jit
def _dkdv_list(
    dk, dv, k, v, Q, DO, q_b, q_h, Lse, Delta, Idx, lo, hi, first, offs_n, offs_d, stride_qm, stride_dm, Nq, qk_scale,
    HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, MASK_BLOCK_Q: tl.constexpr, TMA: tl.constexpr,
):
    """Add the query blocks of list entries [lo, hi) to a key tile's dK and dV; each mask block is SUB tiles.
    `first` is entry lo's block (from the work item, so the first tile needs no index load)."""
    SUB: tl.constexpr = MASK_BLOCK_Q // BLOCK_M
    start_m = first * MASK_BLOCK_Q
    for t in range(lo * SUB, hi * SUB):
        next_m = list_tile_start(Idx, t + 1, hi * SUB, SUB, MASK_BLOCK_Q, BLOCK_M)
        dk, dv = _dkdv_tile(dk, dv, k, v, Q, DO, q_b, q_h, Lse, Delta, start_m, offs_n, offs_d, stride_qm, stride_dm,
                            Nq, qk_scale, HEAD_DIM, EVEN_D, BLOCK_M, MASKED, CAUSAL, DOT_PRECISION, TMA)
        start_m = next_m
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, DKPart, DVPart, Counters,
    ColFullOff, ColFullIdx, ColPartOff, ColPartIdx, ColItems, ColLead,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_dm,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    Hq, Hkv, BH, groups, Nq, Nk, mask_stride_b, mask_stride_h, item_stride_b, item_stride_h,
    copy_stride_b, copy_stride_h, copies, qk_scale, sm_scale, head_group,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_BLOCK_Q: tl.constexpr, MASK_BLOCK_K: tl.constexpr,
    CAUSAL: tl.constexpr, DENSE: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    # Columns are ordered by the lists of the group's first query head.
    b, hk, tile, item, valid = schedule(tl.program_id(0), tl.num_programs(0), Hkv, BH, ColItems, ColLead,
                                        item_stride_b, item_stride_h, groups, tl.cdiv(Nk, BLOCK_N), head_group,
                                        MASK_BLOCK_K, BLOCK_N, DENSE, False)
    start_n = tile * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    kv_ok = (offs_n[:, None] < tl.where(valid, Nk, 0)) & (offs_d[None, :] < HEAD_DIM)  # padding: nothing
    k = tl.load(K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh + offs_n[:, None] * stride_kn
                + offs_d[None, :], mask=kv_ok, other=0.0)  # (BLOCK_N, BLOCK_D)
    v = tl.load(V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh + offs_n[:, None] * stride_vn
                + offs_d[None, :], mask=kv_ok, other=0.0)  # (BLOCK_N, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    slot = -1
    if not DENSE:
        # The group's first head plans the chunks; its ranges come with the work item.
        full_lo, full_hi, part_lo, part_hi, full_first, part_first, slot = item_ranges(item)
    for g in range(0, groups):  # every query head that shares this KV head
        h = hk * groups + g
        if TMA:
            Qh = Q
            DOh = DO
        else:
            Qh = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
            DOh = DO + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh
        Lseh = Lse + (b * Hq + h).to(tl.int64) * Nq
        Deltah = Delta + (b * Hq + h).to(tl.int64) * Nq
        if DENSE:
            m_end = tl.cdiv(Nq, BLOCK_M)
            m_full_end = Nq // BLOCK_M  # query tiles past it hold the sequence tail
            m_start = 0
            m_full_start = 0
            if CAUSAL:
                m_start = start_n // BLOCK_M  # earlier query tiles see none of these keys
                m_full_start = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M), m_full_end)
            m_full_start = tl.maximum(m_full_start, m_start)
            for m in range(m_start, m_full_start):
                dk, dv = _dkdv_tile(dk, dv, k, v, Qh, DOh, b, h, Lseh, Deltah, m * BLOCK_M, offs_n, offs_d, stride_qm,
                                    stride_dm, Nq, qk_scale, HEAD_DIM, EVEN_D, BLOCK_M, True, CAUSAL, DOT_PRECISION,
                                    TMA)
            for m in range(m_full_start, m_full_end):
                dk, dv = _dkdv_tile(dk, dv, k, v, Qh, DOh, b, h, Lseh, Deltah, m * BLOCK_M, offs_n, offs_d, stride_qm,
                                    stride_dm, Nq, qk_scale, HEAD_DIM, EVEN_D, BLOCK_M, False, CAUSAL, DOT_PRECISION,
                                    TMA)
            for m in range(tl.maximum(m_full_end, m_full_start), m_end):
                dk, dv = _dkdv_tile(dk, dv, k, v, Qh, DOh, b, h, Lseh, Deltah, m * BLOCK_M, offs_n, offs_d, stride_qm,
                                    stride_dm, Nq, qk_scale, HEAD_DIM, EVEN_D, BLOCK_M, True, CAUSAL, DOT_PRECISION,
                                    TMA)
        else:
            # This program's chunk of every group head's column list (chunked like the first head's).
            if (g > 0) & (mask_stride_h != 0):  # another head's list
                col = b * mask_stride_b + h * mask_stride_h + tl.maximum(tl.load(item + ITEM_BLOCK), 0)
                full_lo, full_hi, part_lo, part_hi, full_first, part_first, slot = list_ranges(
                    ColFullOff, ColFullIdx, ColPartOff, ColPartIdx, col, item, valid)
            dk, dv = _dkdv_list(dk, dv, k, v, Qh, DOh, b, h, Lseh, Deltah, ColFullIdx, full_lo, full_hi, full_first,
                                offs_n, offs_d, stride_qm, stride_dm, Nq, qk_scale, HEAD_DIM, EVEN_D, BLOCK_M, False,
                                CAUSAL, DOT_PRECISION, MASK_BLOCK_Q, TMA)
            dk, dv = _dkdv_list(dk, dv, k, v, Qh, DOh, b, h, Lseh, Deltah, ColPartIdx, part_lo, part_hi, part_first,
                                offs_n, offs_d, stride_qm, stride_dm, Nq, qk_scale, HEAD_DIM, EVEN_D, BLOCK_M, True,
                                CAUSAL, DOT_PRECISION, MASK_BLOCK_Q, TMA)

    dk = dk * sm_scale
    DK += b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh
    DV += b.to(tl.int64) * stride_dvb + hk.to(tl.int64) * stride_dvh
    if slot >= 0:
        # One chunk of a split column: store it; the column's last chunk sums them all and writes the tile.
        copy = b * copy_stride_b + hk * copy_stride_h
        rows = chunk_rows(slot, copies, copy, tile, MASK_BLOCK_K, BLOCK_N)  # (BLOCK_N,)
        tl.store(DKPart + rows[:, None] * BLOCK_D + offs_d[None, :], dk)
        tl.store(DVPart + rows[:, None] * BLOCK_D + offs_d[None, :], dv)
        last, first, num_chunks = last_chunk(Counters, item, slot, copies, copy, tile, MASK_BLOCK_K, BLOCK_N)
        if last:
            store_chunk_sum(DK, stride_dkn, start_n, Nk, DKPart, first, num_chunks, copies, copy, tile, MASK_BLOCK_K,
                            BLOCK_N, BLOCK_D, HEAD_DIM)
            store_chunk_sum(DV, stride_dvn, start_n, Nk, DVPart, first, num_chunks, copies, copy, tile, MASK_BLOCK_K,
                            BLOCK_N, BLOCK_D, HEAD_DIM)
    else:
        store_rows(DK, offs_n, stride_dkn, offs_d, dk, kv_ok)
        store_rows(DV, offs_n, stride_dvn, offs_d, dv, kv_ok)


@triton.jit
def _dq_tile(
    dq, q, do, lse, delta, K, V, kv_b, kv_h, start_n, offs_m, offs_n, offs_d, stride_kn, stride_vn, Nk, qk_scale,
    HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    """Add one key tile's contribution to the dQ of a query tile.

    TMA: K and V are tensor descriptors of the whole (B, Hkv, Nk, D) tensors, read at (kv_b, kv_h,
    start_n); otherwise pointers already offset to this (batch, head).
    """
    cols = start_n + offs_n  # (BLOCK_N,)
    if TMA:  # rows past Nk and columns past HEAD_DIM arrive as zeros
        BLOCK_N: tl.constexpr = offs_n.shape[0]
        BLOCK_D: tl.constexpr = offs_d.shape[0]
        kt = tl.trans(K.load([kv_b, kv_h, start_n, 0]).reshape(BLOCK_N, BLOCK_D))  # (BLOCK_D, BLOCK_N): K^T
        vt = tl.trans(V.load([kv_b, kv_h, start_n, 0]).reshape(BLOCK_N, BLOCK_D))  # (BLOCK_D, BLOCK_N): V^T
    else:
        d_ok = offs_d < HEAD_DIM
        kt_ptrs = K + cols[None, :] * stride_kn + offs_d[:, None]  # (BLOCK_D, BLOCK_N): K^T
        vt_ptrs = V + cols[None, :] * stride_vn + offs_d[:, None]  # (BLOCK_D, BLOCK_N): V^T
        if MASKED:
            ok = d_ok[:, None] & (cols[None, :] < Nk)
            kt = tl.load(kt_ptrs, mask=ok, other=0.0)
            vt = tl.load(vt_ptrs, mask=ok, other=0.0)
        else:
            kt = load_unmasked_rows(kt_ptrs, d_ok[:, None], EVEN_D)
            vt = load_unmasked_rows(vt_ptrs, d_ok[:, None], EVEN_D)
    s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
    p = tl.math.exp2(s - lse[:, None])  # (BLOCK_M, BLOCK_N)
    if MASKED:
        valid = cols[None, :] < Nk
        if CAUSAL:
            valid = valid & (cols[None, :] <= offs_m[:, None])
        p = tl.where(valid, p, 0.0)
    dp = tl.dot(do, vt, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
    ds = p * (dp - delta[:, None])  # (BLOCK_M, BLOCK_N)
    if MASKED:  # a pair left out stays 0 even where dP or delta is not finite (never 0 x NaN)
        ds = tl.where(valid, ds, 0.0)
    dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_D)
    return dq


@triton.jit
def _dq_list(
    dq, q, do, lse, delta, K, V, kv_b, kv_h, Idx, lo, hi, first, offs_m, offs_n, offs_d, stride_kn, stride_vn, Nk,
    qk_scale, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, MASK_BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
):
    """Add the key blocks of list entries [lo, hi) to a query tile's dQ; each mask block is SUB tiles.
    `first` is entry lo's block (from the work item, so the first tile needs no index load)."""
    SUB: tl.constexpr = MASK_BLOCK_K // BLOCK_N
    start_n = first * MASK_BLOCK_K
    for t in range(lo * SUB, hi * SUB):
        next_n = list_tile_start(Idx, t + 1, hi * SUB, SUB, MASK_BLOCK_K, BLOCK_N)
        dq = _dq_tile(dq, q, do, lse, delta, K, V, kv_b, kv_h, start_n, offs_m, offs_n, offs_d, stride_kn, stride_vn,
                      Nk, qk_scale, HEAD_DIM, EVEN_D, MASKED, CAUSAL, DOT_PRECISION, TMA)
        start_n = next_n
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, Out, DO, Lse, Delta, DLse, DQ, DQPart, Counters,
    RowFullIdx, RowPartIdx, RowItems, RowLead,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_db, stride_dh, stride_dm,
    stride_dqb, stride_dqh, stride_dqm,
    Hq, BH, groups, Nq, Nk, item_stride_b, item_stride_h,
    copy_stride_b, copy_stride_h, copies, qk_scale, sm_scale, head_group,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_BLOCK_Q: tl.constexpr, MASK_BLOCK_K: tl.constexpr,
    CAUSAL: tl.constexpr, DENSE: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    b, h, tile, item, valid = schedule(tl.program_id(0), tl.num_programs(0), Hq, BH, RowItems, RowLead,
                                       item_stride_b, item_stride_h, 1, tl.cdiv(Nq, BLOCK_M), head_group, MASK_BLOCK_Q,
                                       BLOCK_M, DENSE, CAUSAL)
    pid_bh = b * Hq + h
    start_m = tile * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    rows_ok = offs_m < tl.where(valid, Nq, 0)  # (BLOCK_M,); a padding program loads and stores nothing
    ok = rows_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qm
                + offs_d[None, :], mask=ok, other=0.0)  # (BLOCK_M, BLOCK_D)
    do = tl.load(DO + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh + offs_m[:, None] * stride_dm
                 + offs_d[None, :], mask=ok, other=0.0)  # (BLOCK_M, BLOCK_D)
    o = tl.load(Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_om
                + offs_d[None, :], mask=ok, other=0.0)  # (BLOCK_M, BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # (BLOCK_M,) rowsum(dO * O)
    if HAS_DLSE:  # d lse_i / d s_ij = P_ij, so the lse's gradient enters dS = P (dP - delta) as -dlse in delta
        delta -= tl.load(DLse + pid_bh.to(tl.int64) * Nq + offs_m, mask=rows_ok, other=0.0)
    tl.store(Delta + pid_bh.to(tl.int64) * Nq + offs_m, delta, mask=rows_ok)  # for the dK/dV launch
    lse = _load_lse_log2(Lse + pid_bh.to(tl.int64) * Nq, offs_m, Nq)  # (BLOCK_M,)
    hk = h // groups
    if not TMA:
        K += b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
        V += b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if DENSE:
        slot = -1
        n_full, n_end = dense_key_tiles(start_m, Nk, CAUSAL, BLOCK_M, BLOCK_N)
        for n in range(0, n_full):
            dq = _dq_tile(dq, q, do, lse, delta, K, V, b, hk, n * BLOCK_N, offs_m, offs_n, offs_d, stride_kn,
                          stride_vn, Nk, qk_scale, HEAD_DIM, EVEN_D, False, CAUSAL, DOT_PRECISION, TMA)
        for n in range(n_full, n_end):
            dq = _dq_tile(dq, q, do, lse, delta, K, V, b, hk, n * BLOCK_N, offs_m, offs_n, offs_d, stride_kn,
                          stride_vn, Nk, qk_scale, HEAD_DIM, EVEN_D, True, CAUSAL, DOT_PRECISION, TMA)
    else:
        full_lo, full_hi, part_lo, part_hi, full_first, part_first, slot = item_ranges(item)
        dq = _dq_list(dq, q, do, lse, delta, K, V, b, hk, RowFullIdx, full_lo, full_hi, full_first, offs_m, offs_n,
                      offs_d, stride_kn, stride_vn, Nk, qk_scale, HEAD_DIM, EVEN_D, False, CAUSAL, DOT_PRECISION,
                      MASK_BLOCK_K, BLOCK_N, TMA)
        dq = _dq_list(dq, q, do, lse, delta, K, V, b, hk, RowPartIdx, part_lo, part_hi, part_first, offs_m, offs_n,
                      offs_d, stride_kn, stride_vn, Nk, qk_scale, HEAD_DIM, EVEN_D, True, CAUSAL, DOT_PRECISION,
                      MASK_BLOCK_K, BLOCK_N, TMA)

    dq = dq * sm_scale
    DQ += b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
    if slot >= 0:
        # One chunk of a split row: store it; the row's last chunk sums them all and writes the tile.
        copy = b * copy_stride_b + h * copy_stride_h
        rows = chunk_rows(slot, copies, copy, tile, MASK_BLOCK_Q, BLOCK_M)  # (BLOCK_M,)
        tl.store(DQPart + rows[:, None] * BLOCK_D + offs_d[None, :], dq)
        last, first, num_chunks = last_chunk(Counters, item, slot, copies, copy, tile, MASK_BLOCK_Q, BLOCK_M)
        if last:
            store_chunk_sum(DQ, stride_dqm, start_m, Nq, DQPart, first, num_chunks, copies, copy, tile, MASK_BLOCK_Q,
                            BLOCK_M, BLOCK_D, HEAD_DIM)
    else:
        store_rows(DQ, offs_m, stride_dqm, offs_d, dq, ok)


def _config(q, k, index, geometry, causal: bool):
    """The backward's tiles for this call (both passes' tiles come from one config)."""
    D, Nq, Nk = q.shape[-1], q.shape[2], k.shape[2]
    dense = index is None
    cfg = bwd_config(D, q.dtype, None if dense else geometry.block_q, None if dense else geometry.block_k, causal,
                     False if dense else geometry.long_lists)
    if min(Nq, Nk) == 1:
        # Triton makes a length of 1 a constant, which bounds the loops by one tile: nothing to pipeline, and
        # Triton 3.6's ptxas (CUDA 12.8) crashes on such two-stage loops (dense causal, D 72-128; tuning log,
        # step 32)
        cfg = cfg._replace(num_stages=1, dq_stages=1)
    return cfg


class DqPlan:
    """The dQ pass of one call signature: tiles, grid, the launch and its non-tensor arguments. A call then
    only allocates dQ (and scratch), builds descriptors and launches; it also stores delta = rowsum(dO * O),
    which the dK/dV pass reads."""

    def __init__(self, do, q, k, v, out, index: KernelIndex | None, geometry: MaskGeometry | None, causal: bool,
                 scale: float, dlse: bool = False):
        B, Hq, Nq, D = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        dense = index is None
        cfg = _config(q, k, index, geometry, causal)
        BLOCK_D = block_d(D)
        self.dlse = dlse  # the calls pass the log-sum-exp's gradient (float32 `(B, Hq, Nq)`, contiguous)
        if dense:
            self.rows = SplitPlan(q.device)
            lists = [self.rows.dummy] * 4
            block_q, block_k = cfg.q_block_m, cfg.q_block_n
            items = cdiv(Nq, cfg.q_block_m)
        else:
            self.rows = SplitPlan(q.device, index.row_plan, B, Hq, geometry, D, parts=1)
            lists = [index.row_full.indices, index.row_partial.indices, index.row_plan.items, index.row_plan.lead]
            block_q, block_k = geometry.block_q, geometry.block_k
            items = index.row_plan.items.shape[2] * (block_q // cfg.q_block_m)
        self.q_shape, self.dtype, self.device = q.shape, q.dtype, q.device
        q_strides = (Hq * Nq * D, Nq * D, D)  # of the new dq
        self.k_layout, self.v_layout = (descriptor_layout(t, cfg.q_block_n, BLOCK_D) if cfg.tma else None
                                        for t in (k, v))
        self.tma = self.k_layout is not None and self.v_layout is not None
        self.launch = BoundLaunch(
            _attn_bwd_dq_kernel, items * B * Hq,
            (
                *lists,
                *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *do.stride()[:3], *q_strides,
                Hq, B * Hq, Hq // Hkv, Nq, Nk, *self.rows.item_strides,
                *self.rows.copy_strides, self.rows.copies,
                scale * LOG2E, scale, schedule_heads(2 * Nk * D * k.element_size() // (Hq // Hkv), B * Hq),
            ),
            dict(
                HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_M=cfg.q_block_m, BLOCK_N=cfg.q_block_n,
                MASK_BLOCK_Q=block_q, MASK_BLOCK_K=block_k,
                CAUSAL=causal, DENSE=dense, DOT_PRECISION=dot_precision(q.dtype), TMA=self.tma, HAS_DLSE=dlse,
            ),
            cfg.dq_warps or cfg.num_warps, cfg.dq_stages or cfg.num_stages, cfg.dq_maxnreg,
        )

    def __call__(self, q, k, v, out, do, lse, delta, dlse=None):
        """dQ; also writes `delta` (float32 `(B, Hq, Nq)`): rowsum(dO * O), less `dlse` (the log-sum-exp's
        gradient, like lse) where the plan takes one."""
        dq = new_output(self.q_shape, self.dtype, self.device)
        part, _, _ = self.rows.scratch()
        if self.tma:
            k, v = make_descriptor(k, self.k_layout), make_descriptor(v, self.v_layout)
        self.launch(q, k, v, out, do, lse, delta, dlse if self.dlse else delta, dq, part, self.rows.counters())
        return dq


class DkdvPlan:
    """The dK/dV pass of one call signature, like `DqPlan`; it reads the delta that the dQ pass stored."""

    def __init__(self, do, q, k, v, index: KernelIndex | None, geometry: MaskGeometry | None, causal: bool,
                 scale: float):
        B, Hq, Nq, D = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        dense = index is None
        cfg = _config(q, k, index, geometry, causal)
        BLOCK_D = block_d(D)
        if dense:
            self.cols = SplitPlan(q.device)
            lists = [self.cols.dummy] * 6
            block_q, block_k = cfg.kv_block_m, cfg.kv_block_n
            items = cdiv(Nk, cfg.kv_block_n)
            mask_strides = (0, 0)
        else:
            self.cols = SplitPlan(q.device, index.col_plan, B, Hkv, geometry, D, along="cols", parts=2)
            # offsets too: the lists of grouped heads are found by their offsets
            lists = [*index.col_full[1:], *index.col_partial[1:], index.col_plan.items, index.col_plan.lead]
            block_q, block_k = geometry.block_q, geometry.block_k
            items = index.col_plan.items.shape[2] * (block_k // cfg.kv_block_n)
            g = geometry
            mask_strides = (g.heads * g.blocks_k if g.batch > 1 else 0, g.blocks_k if g.heads > 1 else 0)
        self.k_shape, self.dtype, self.device = k.shape, q.dtype, q.device
        k_strides = (Hkv * Nk * D, Nk * D, D)  # of the new dk, dv
        self.q_layout, self.do_layout = (descriptor_layout(t, cfg.kv_block_m, BLOCK_D) if cfg.tma else None
                                         for t in (q, do))
        self.tma = self.q_layout is not None and self.do_layout is not None
        self.launch = BoundLaunch(
            _attn_bwd_dkdv_kernel, items * B * Hkv,
            (
                *lists,
                *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *k_strides, *k_strides,
                Hq, Hkv, B * Hkv, Hq // Hkv, Nq, Nk,
                *mask_strides, *self.cols.item_strides,
                *self.cols.copy_strides, self.cols.copies,
                scale * LOG2E, scale, schedule_heads(2 * Nq * D * q.element_size() * (Hq // Hkv), B * Hkv),
            ),
            dict(
                HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_M=cfg.kv_block_m, BLOCK_N=cfg.kv_block_n,
                MASK_BLOCK_Q=block_q, MASK_BLOCK_K=block_k,
                CAUSAL=causal, DENSE=dense, DOT_PRECISION=dot_precision(q.dtype), TMA=self.tma,
            ),
            cfg.num_warps, cfg.num_stages, cfg.maxnreg,
        )

    def __call__(self, q, k, v, do, lse, delta):
        """`(dk, dv)`."""
        dk = new_output(self.k_shape, self.dtype, self.device)
        dv = new_output(self.k_shape, self.dtype, self.device)
        part_k, part_v, _ = self.cols.scratch()
        if self.tma:
            q, do = make_descriptor(q, self.q_layout), make_descriptor(do, self.do_layout)
        self.launch(q, k, v, do, lse, delta, dk, dv, part_k, part_v, self.cols.counters())
        return dk, dv

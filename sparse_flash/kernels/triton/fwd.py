"""Forward kernel: FlashAttention over the nonzero blocks of a block mask.

One program per (query tile, batch x head), or per chunk of a row that the mask's work plan splits. It
walks the key blocks of its row list, full blocks first in a loop with no element mask, then partial
blocks (causal diagonal, sequence tails) with one. Online softmax runs in fp32 in the log2 domain (exp2,
with the scale folded into `qk_scale`); O is accumulated on chip and written once with the log-sum-exp,
or, for a chunk of a split row, to scratch, and the row's last chunk combines them (`split.py`). Scores
never leave the chip.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...mask_index import KernelIndex, MaskGeometry
from ..launch import BoundLaunch, cached_plan, cdiv, plan_key
from ..memory import new_output
from .common import (LOG2E, dense_key_tiles, dot_precision, item_ranges, list_tile_start, load_unmasked_rows, schedule,
                     store_rows)
from .configs import block_d, fwd_config, schedule_heads
from .split import SplitPlan, chunk_rows, last_chunk, store_chunk_merge
from .tma import descriptor_layout, make_descriptor


@triton.jit
def _fwd_tile(
    acc, l_i, m_i, q, K, V, kv_b, kv_h, start_n, offs_m, offs_n, offs_d, stride_kn, stride_vn, Nk, qk_scale,
    HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FUSED: tl.constexpr, TMA: tl.constexpr,
):
    """Fold one key tile into the running softmax state (acc, l_i, m_i) of a query tile.

    TMA: K and V are tensor descriptors of the whole (B, Hkv, Nk, D) tensors, read at (kv_b, kv_h,
    start_n); otherwise pointers already offset to this (batch, head). FUSED: each score is scaled and
    shifted in one multiply-add and P V accumulates into the rescaled output (2-5% faster on sparse rows);
    otherwise scores are scaled first and P V is added after, which keeps the dense causal kernel at
    D = 128 free of register spills (3% faster there).
    """
    cols = start_n + offs_n  # (BLOCK_N,)
    if TMA:  # rows past Nk and columns past HEAD_DIM arrive as zeros
        BLOCK_N: tl.constexpr = offs_n.shape[0]
        BLOCK_D: tl.constexpr = offs_d.shape[0]
        kt = tl.trans(K.load([kv_b, kv_h, start_n, 0]).reshape(BLOCK_N, BLOCK_D))  # (BLOCK_D, BLOCK_N): K^T
        v = V.load([kv_b, kv_h, start_n, 0]).reshape(BLOCK_N, BLOCK_D)  # (BLOCK_N, BLOCK_D)
    else:
        kt_ptrs = K + cols[None, :] * stride_kn + offs_d[:, None]  # (BLOCK_D, BLOCK_N): K^T
        v_ptrs = V + cols[:, None] * stride_vn + offs_d[None, :]  # (BLOCK_N, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        if MASKED:
            kt = tl.load(kt_ptrs, mask=d_ok[:, None] & (cols[None, :] < Nk), other=0.0)
            v = tl.load(v_ptrs, mask=(cols[:, None] < Nk) & d_ok[None, :], other=0.0)
        else:
            kt = load_unmasked_rows(kt_ptrs, d_ok[:, None], EVEN_D)
            v = load_unmasked_rows(v_ptrs, d_ok[None, :], EVEN_D)
    qk = tl.dot(q, kt, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) unscaled scores
    if not FUSED:
        qk = qk * qk_scale  # log2 units from here on
        qk_scale = 1.0
    if MASKED:
        valid = cols[None, :] < Nk
        if CAUSAL:
            valid = valid & (cols[None, :] <= offs_m[:, None])
        qk = tl.where(valid, qk, float("-inf"))
    if MASKED and CAUSAL:
        # A non-finite value at key j reaches exactly the rows that attend j: the product P V would carry it
        # (0 x NaN) into the earlier rows of the diagonal tile, so those keys' values enter the product as 0
        # and the rows that do attend them are marked below.
        v_ok = (v == v) & (tl.abs(v) < float("inf"))  # (BLOCK_N, BLOCK_D)
        v_bad = tl.max(tl.where(v_ok, 0, 1), 1) > 0  # (BLOCK_N,) keys with a non-finite value
        hit = tl.max(tl.where(valid & v_bad[None, :], 1, 0), 1) > 0  # (BLOCK_M,) rows attending such a key
        v = tl.where(v_ok, v, tl.zeros_like(v))  # keeps v's dtype for the dot
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # (BLOCK_M,) running max, log2 units (qk_scale > 0)
    if MASKED:
        # A row with no allowed key so far keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.math.exp2(qk * qk_scale - m_use[:, None])  # (BLOCK_M, BLOCK_N); scale and shift in one FMA
    alpha = tl.math.exp2(m_i - m_use)  # rescales what was accumulated under the old maximum
    l_i = l_i * alpha + tl.sum(p, 1)
    if FUSED:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)  # P V into acc
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    if MASKED and CAUSAL:
        acc = tl.where(hit[:, None], float("nan"), acc)
    return acc, l_i, m_new


@triton.jit
def _fwd_list(
    acc, l_i, m_i, q, K, V, kv_b, kv_h, Idx, lo, hi, first, offs_m, offs_n, offs_d, stride_kn, stride_vn, Nk, qk_scale,
    HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, MASK_BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, FUSED: tl.constexpr,
    TMA: tl.constexpr,
):
    """Fold the key blocks of list entries [lo, hi) into the softmax state; each mask block is SUB tiles.
    `first` is entry lo's block (from the work item, so the first tile needs no index load)."""
    SUB: tl.constexpr = MASK_BLOCK_K // BLOCK_N
    start_n = first * MASK_BLOCK_K
    for t in range(lo * SUB, hi * SUB):
        next_n = list_tile_start(Idx, t + 1, hi * SUB, SUB, MASK_BLOCK_K, BLOCK_N)
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, K, V, kv_b, kv_h, start_n, offs_m, offs_n, offs_d, stride_kn,
                                  stride_vn, Nk, qk_scale, HEAD_DIM, EVEN_D, MASKED, CAUSAL, DOT_PRECISION, FUSED, TMA)
        start_n = next_n
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, OutPart, LsePart, Counters,
    RowFullIdx, RowPartIdx, RowItems, RowLead,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    Hq, BH, groups, Nq, Nk, item_stride_b, item_stride_h,
    copy_stride_b, copy_stride_h, copies, qk_scale, head_group,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_BLOCK_Q: tl.constexpr, MASK_BLOCK_K: tl.constexpr,
    CAUSAL: tl.constexpr, DENSE: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    """One program per query tile of one (batch, head), or per chunk of a split row."""
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    b, h, tile, item, valid = schedule(tl.program_id(0), tl.num_programs(0), Hq, BH, RowItems, RowLead, item_stride_b,
                                       item_stride_h, 1, tl.cdiv(Nq, BLOCK_M), head_group, MASK_BLOCK_Q, BLOCK_M, DENSE,
                                       CAUSAL)
    start_m = tile * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    m_ok = offs_m < tl.where(valid, Nq, 0)  # a padding program loads and stores nothing
    d_ok = offs_d < HEAD_DIM

    Q += b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    hk = h // groups
    if not TMA:
        K += b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
        V += b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    q = tl.load(Q + offs_m[:, None] * stride_qm + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if DENSE:
        slot = -1
        # Every key tile, no index loads: tiles wholly before the diagonal (and the tail) run unmasked.
        n_full, n_end = dense_key_tiles(start_m, Nk, CAUSAL, BLOCK_M, BLOCK_N)
        for n in range(0, n_full):
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, K, V, b, hk, n * BLOCK_N, offs_m, offs_n, offs_d, stride_kn,
                                      stride_vn, Nk, qk_scale, HEAD_DIM, EVEN_D, False, CAUSAL, DOT_PRECISION,
                                      not CAUSAL, TMA)
        for n in range(n_full, n_end):
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, K, V, b, hk, n * BLOCK_N, offs_m, offs_n, offs_d, stride_kn,
                                      stride_vn, Nk, qk_scale, HEAD_DIM, EVEN_D, True, CAUSAL, DOT_PRECISION,
                                      not CAUSAL, TMA)
    else:
        # Walk this program's chunk of the query block's row list; each mask block is SUB key tiles.
        full_lo, full_hi, part_lo, part_hi, full_first, part_first, slot = item_ranges(item)
        acc, l_i, m_i = _fwd_list(acc, l_i, m_i, q, K, V, b, hk, RowFullIdx, full_lo, full_hi, full_first, offs_m,
                                  offs_n, offs_d, stride_kn, stride_vn, Nk, qk_scale, HEAD_DIM, EVEN_D, False, CAUSAL,
                                  DOT_PRECISION, MASK_BLOCK_K, BLOCK_N, True, TMA)
        acc, l_i, m_i = _fwd_list(acc, l_i, m_i, q, K, V, b, hk, RowPartIdx, part_lo, part_hi, part_first, offs_m,
                                  offs_n, offs_d, stride_kn, stride_vn, Nk, qk_scale, HEAD_DIM, EVEN_D, True, CAUSAL,
                                  DOT_PRECISION, MASK_BLOCK_K, BLOCK_N, True, TMA)

    # Empty rows (no allowed key): output 0 and lse -inf, never 0/0.
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    Out += b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    Lse += (b * Hq + h).to(tl.int64) * Nq
    out_ok = m_ok[:, None] & d_ok[None, :]
    if slot >= 0:
        # One chunk of a split row: store it; the row's last chunk combines them all and writes the tile.
        copy = b * copy_stride_b + h * copy_stride_h
        rows = chunk_rows(slot, copies, copy, tile, MASK_BLOCK_Q, BLOCK_M)  # (BLOCK_M,)
        tl.store(OutPart + rows[:, None] * BLOCK_D + offs_d[None, :], out)
        tl.store(LsePart + rows, lse)
        last, first, num_chunks = last_chunk(Counters, item, slot, copies, copy, tile, MASK_BLOCK_Q, BLOCK_M)
        if last:
            store_chunk_merge(Out, stride_om, Lse, start_m, Nq, OutPart, LsePart, first, num_chunks, copies, copy, tile,
                              MASK_BLOCK_Q, BLOCK_M, BLOCK_D, HEAD_DIM)
    else:
        store_rows(Out, offs_m, stride_om, offs_d, out, out_ok)
        tl.store(Lse + offs_m, lse, mask=m_ok)


class FwdPlan:
    """What one call signature of `attn_fwd` fixes: tiles, grid, the launches and their non-tensor
    arguments. A call then only allocates the outputs (and scratch), builds descriptors and launches."""

    def __init__(self, q, k, v, index: KernelIndex | None, geometry: MaskGeometry | None, causal: bool, scale: float):
        B, Hq, Nq, D = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        dense = index is None
        if dense:
            cfg = fwd_config(D, q.dtype, None, None, causal, Nq, False)
            block_q, block_k = cfg.block_m, cfg.block_n
            self.split = SplitPlan(q.device)
            full_idx, part_idx, items, lead = [self.split.dummy] * 4
            grid = cdiv(Nq, cfg.block_m) * B * Hq
        else:
            block_q, block_k = geometry.block_q, geometry.block_k
            cfg = fwd_config(D, q.dtype, block_q, block_k, causal, Nq, geometry.long_lists)
            full_idx, part_idx = index.row_full.indices, index.row_partial.indices
            items, lead = index.row_plan.items, index.row_plan.lead
            self.split = SplitPlan(q.device, index.row_plan, B, Hq, geometry, D, with_lse=True)
            grid = items.shape[2] * (block_q // cfg.block_m) * B * Hq
        self.k_layout, self.v_layout = (descriptor_layout(t, cfg.block_n, block_d(D)) if cfg.tma else None
                                        for t in (k, v))
        self.tma = self.k_layout is not None and self.v_layout is not None
        self.out_shape, self.lse_shape, self.dtype, self.device = q.shape, (B, Hq, Nq), q.dtype, q.device
        # Outputs are allocated contiguous, so their strides follow from the shape.
        out_strides = (Hq * Nq * D, Nq * D, D)
        self.kernel = BoundLaunch(
            _attn_fwd_kernel, grid,
            (
                full_idx, part_idx, items, lead,
                *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out_strides,
                Hq, B * Hq, Hq // Hkv, Nq, Nk,
                *self.split.item_strides,
                *self.split.copy_strides, self.split.copies,
                scale * LOG2E, schedule_heads(2 * Nk * D * k.element_size() // (Hq // Hkv), B * Hq),
            ),
            dict(
                HEAD_DIM=D, BLOCK_D=block_d(D), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                MASK_BLOCK_Q=block_q, MASK_BLOCK_K=block_k,
                CAUSAL=causal, DENSE=dense, DOT_PRECISION=dot_precision(q.dtype), TMA=self.tma,
            ),
            cfg.num_warps, cfg.num_stages, cfg.maxnreg,
        )

    def __call__(self, q, k, v):
        out = new_output(self.out_shape, self.dtype, self.device)
        lse = new_output(self.lse_shape, torch.float32, self.device)
        part, _, lse_part = self.split.scratch()
        if self.tma:
            k, v = make_descriptor(k, self.k_layout), make_descriptor(v, self.v_layout)
        self.kernel(q, k, v, out, lse, part, lse_part, self.split.counters())
        return out, lse


def attn_fwd(q, k, v, index: KernelIndex | None, geometry: MaskGeometry | None, causal: bool, scale: float,
             plans: dict | None = None):
    """Launch the forward kernel (split rows included: their last chunks combine them).

    Args:
        q: `(B, Hq, Nq, D)`; k, v: `(B, Hkv, Nk, D)`; last dimension contiguous.
        index: the mask's `KernelIndex` for this call's causal flag, or None for the dense path.
        geometry: the mask's `MaskGeometry` (None for the dense path).
        plans: where to keep this call's launch plan for the next call with the same signature; one dict
            per mask (`launch.mask_plans`), or None to build one for this call only.

    Returns:
        `(out, lse)`: out like q, lse float32 `(B, Hq, Nq)` natural log.
    """
    key = plan_key((q, k, v), "fwd-triton", causal, scale)
    plan = cached_plan(plans, key, lambda: FwdPlan(q, k, v, index, geometry, causal, scale))
    return plan(q, k, v)

"""Long lists split across programs: scratch for the chunks and the merge pass that combines them.

A mask's work plan (`layout.WorkPlan`) cuts lists much longer than average (the global rows and columns
of BigBird or Longformer) into chunks, each walked by its own program, so one list no longer sets the
running time. Each chunk writes a partial result to a scratch slot; the merge pass (`merge_launch`) then
combines the slots of every split list: forward chunks by their log-sum-exp, gradient chunks by summing.

Scratch slots exist per split list and per *copy*: a mask shared by several batch entries or heads is
walked once per (batch, head) that uses it. The scratch is allocated per call, the rest once per launch
plan.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import block_d, fit_tile
from .launch import BoundLaunch
from .memory import new_output


class SplitPlan:
    """Launch parameters of the split lists of one kernel launch, and their scratch buffers.

    Args:
        device: where the scratch lives.
        plan: `(items, split, slot_list)` from the mask's `WorkPlan`, or None for the dense path (nothing
            split, no items).
        batch, heads: of the tensor the launch writes (query heads for rows, KV heads for columns).
        mask_batch, mask_heads: the mask's `B|1, H|1`.
        mask_block: the mask's block size along the split lists' dimension.
        head_dim: D.
        parts: number of partial tensors per slot (1 for out or dQ, 2 for dK and dV).
        with_lse: also keep a log-sum-exp per row (the forward).
    """

    def __init__(self, device, plan=None, batch=1, heads=1, mask_batch=1, mask_heads=1, mask_block=1, head_dim=1,
                 parts=1, with_lse=False):
        items, split, slot_list = plan if plan is not None else (None, None, None)
        self.device = device
        self.dummy = placeholder(device, torch.int32)
        self.split = split
        self.num_split = 0 if split is None else split.shape[0]
        self.item_strides = (0, 0) if items is None else (
            items.stride(0) if mask_batch > 1 else 0, items.stride(1) if mask_heads > 1 else 0)
        # copy index of (b, h) = b * copy_stride_b + h * copy_stride_h: one copy per (batch, head) sharing
        # the mask's layout
        self.head_copies = heads if mask_heads == 1 else 1
        self.copies = (batch if mask_batch == 1 else 1) * self.head_copies
        self.copy_strides = (self.head_copies if mask_batch == 1 else 0, 1 if mask_heads == 1 else 0)
        self.mask_batch, self.mask_heads, self.mask_block = mask_batch, mask_heads, mask_block
        self.num_parts, self.with_lse = parts, with_lse
        self.rows = 0 if not self.num_split else slot_list.shape[0] * self.copies * mask_block
        self.width = block_d(head_dim)

    def scratch(self) -> tuple:
        """`(part_0, part_1, lse_part)` for one launch: new buffers where lists are split (part_1 is part_0
        when the launch keeps one part, lse_part is part_0 when it keeps no lse), placeholders otherwise,
        which keep the kernels' signatures and are never touched."""
        if not self.num_split:
            empty = placeholder(self.device, torch.float32)
            return empty, empty, empty
        parts = [new_output((self.rows, self.width), torch.float32, self.device) for _ in range(self.num_parts)]
        lse_part = new_output((self.rows,), torch.float32, self.device) if self.with_lse else parts[0]
        return parts[0], parts[-1], lse_part


_PLACEHOLDERS: dict = {}


def placeholder(device, dtype: torch.dtype) -> torch.Tensor:
    """A tiny tensor, allocated once per device and dtype, for pointer arguments a launch never touches."""
    key = (device, dtype)
    t = _PLACEHOLDERS.get(key)
    if t is None:
        t = _PLACEHOLDERS[key] = torch.zeros(2, dtype=dtype, device=device)
    return t


@triton.jit
def _merge_kernel(
    Part, LsePart, Dst, DstLse, Split, Chunks, Slots,
    stride_b, stride_h, stride_m,
    heads, groups, num_blocks, N, copies, head_copies, mask_batch, mask_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    WITH_LSE: tl.constexpr,
):
    """One program per (split list, copy, row tile): combine the list's chunks into the destination."""
    SUB: tl.constexpr = MASK_BLOCK // BLOCK_M
    pid = tl.program_id(0)
    sub = pid % SUB
    copy = (pid // SUB) % copies
    row = tl.load(Split + pid // (SUB * copies))  # (bm * mask_heads + hm) * num_blocks + i
    i = row % num_blocks
    hm = (row // num_blocks) % mask_heads
    bm = row // (num_blocks * mask_heads)
    b = tl.where(mask_batch > 1, bm, copy // head_copies)
    h = tl.where(mask_heads > 1, hm // groups, copy % head_copies)
    valid = (mask_heads == 1) | (hm % groups == 0)  # GQA: only the group's first query head has programs
    num_chunks = tl.load(Chunks + row)
    first = tl.load(Slots + row)
    offs_r = sub * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) rows within the mask block
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if WITH_LSE:
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        for c in range(0, num_chunks):
            rows = ((first + c) * copies + copy).to(tl.int64) * MASK_BLOCK + offs_r
            m = tl.maximum(m, tl.load(LsePart + rows))
        m_use = tl.where(m == float("-inf"), 0.0, m)  # a row empty in every chunk stays at weight 0
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c in range(0, num_chunks):
            rows = ((first + c) * copies + copy).to(tl.int64) * MASK_BLOCK + offs_r
            w = tl.exp(tl.load(LsePart + rows) - m_use)  # (BLOCK_M,)
            acc += w[:, None] * tl.load(Part + rows[:, None] * BLOCK_D + offs_d[None, :])
            total += w
        empty = total == 0.0
        acc = acc / tl.where(empty, 1.0, total)[:, None]
        lse = tl.where(empty, float("-inf"), m_use + tl.log(tl.where(empty, 1.0, total)))
    else:
        for c in range(0, num_chunks):
            rows = ((first + c) * copies + copy).to(tl.int64) * MASK_BLOCK + offs_r
            acc += tl.load(Part + rows[:, None] * BLOCK_D + offs_d[None, :])

    tok = i * MASK_BLOCK + offs_r  # (BLOCK_M,) token rows of the destination
    ok = tok < tl.where(valid, N, 0)
    Dst += b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    tl.store(Dst + tok[:, None] * stride_m + offs_d[None, :], acc.to(Dst.dtype.element_ty),
             mask=ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    if WITH_LSE:
        tl.store(DstLse + (b * heads + h).to(tl.int64) * N + tok, lse, mask=ok)


def merge_launch(plan: SplitPlan, chunks, slots, dst_shape, num_blocks: int, *, heads: int, groups: int,
                 with_lse: bool) -> BoundLaunch:
    """The merge of every split list of `plan` into a contiguous `dst_shape` (B, heads, N, D) output.

    Called as `merge(part, lse_part, dst, dst_lse)`: with `with_lse` the chunks hold (out, lse) pairs and
    merge by log-sum-exp into dst and dst_lse; without, they are summed into dst (pass a placeholder as
    dst_lse).
    """
    _, H, N, D = dst_shape
    block_m = fit_tile(64, plan.mask_block)
    return BoundLaunch(
        _merge_kernel, plan.num_split * plan.copies * (plan.mask_block // block_m),
        (
            plan.split, chunks, slots,
            H * N * D, N * D, D,  # strides of the contiguous destination
            heads, groups, num_blocks, N, plan.copies, plan.head_copies, plan.mask_batch, plan.mask_heads,
        ),
        dict(HEAD_DIM=D, BLOCK_D=block_d(D), MASK_BLOCK=plan.mask_block, BLOCK_M=block_m, WITH_LSE=with_lse),
        4, 3,
    )

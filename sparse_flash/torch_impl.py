"""Block-sparse attention in plain PyTorch: gathers only the nonzero key blocks of each query block.

Works on any device and differentiates through PyTorch's autograd. Rows (batch, head, query block) are
sorted by their number of key blocks and processed in chunks padded to the longest row of the chunk, so
memory stays proportional to the nonzero blocks and no `Nq x Nk` tensor is ever built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .layout import BlockMask
from .reference import _softmax_rows

_CHUNK_ELEMENTS = 1 << 23  # score elements per chunk: bounds the working memory (32 MB in fp32)


def attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, *, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention over the nonzero blocks of `mask`; returns `(out, lse)` like the reference."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    groups = Hq // Hkv
    bq, bk = mask.block_size
    Mq, Mk = mask.num_blocks
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    index = mask.to(q.device).row_index(causal)

    # One work row per (b, hq, query block), numbered (b * Hq + hq) * Mq + i.
    counts = index.counts.expand(B, Hq, Mq).reshape(-1)
    starts = index.offsets[:-1].reshape(index.counts.shape).expand(B, Hq, Mq).reshape(-1)
    order = torch.argsort(counts, descending=True, stable=True)
    sorted_counts = counts[order].tolist()

    q_blocks = F.pad(q, (0, 0, 0, Mq * bq - Nq)).reshape(B * Hq * Mq, bq, D).to(compute)
    k_blocks = F.pad(k, (0, 0, 0, Mk * bk - Nk)).reshape(B * Hkv * Mk, bk, D).to(compute)
    v_blocks = F.pad(v, (0, 0, 0, Mk * bk - Nk)).reshape(B * Hkv * Mk, bk, D).to(compute)
    offs_q = torch.arange(bq, device=q.device)
    offs_k = torch.arange(bk, device=q.device)

    outs, lses = [], []
    lo = 0
    while lo < len(sorted_counts):
        width = max(sorted_counts[lo], 1)  # key blocks in the chunk's longest row
        n = max(1, _CHUNK_ELEMENTS // (width * bk * max(bq, D)))
        rows = order[lo : lo + n]
        lo += n
        row_counts, row_starts = counts[rows], starts[rows]
        slot = torch.arange(width, device=q.device)
        valid = slot[None, :] < row_counts[:, None]  # (n, width)
        pos = (row_starts[:, None] + slot[None, :]).clamp(max=max(index.indices.numel() - 1, 0))
        kb = index.indices[pos].long() if index.indices.numel() else torch.zeros_like(pos)  # key block ids
        b, hq, i = rows // (Hq * Mq), (rows // Mq) % Hq, rows % Mq
        kv_rows = ((b * Hkv + hq // groups) * Mk)[:, None] + kb  # (n, width)

        kc = k_blocks[kv_rows].reshape(len(rows), width * bk, D)
        vc = v_blocks[kv_rows].reshape(len(rows), width * bk, D)
        s = torch.matmul(q_blocks[rows], kc.transpose(-1, -2)) * scale  # (n, bq, width * bk)

        k_pos = (kb[:, :, None] * bk + offs_k).reshape(len(rows), 1, width * bk)
        allowed = valid.repeat_interleave(bk, dim=1)[:, None, :] & (k_pos < Nk)
        if causal:
            q_pos = (i[:, None] * bq + offs_q)[:, :, None]
            allowed = allowed & (k_pos <= q_pos)
        p, lse = _softmax_rows(s.masked_fill(~allowed, float("-inf")))
        outs.append(torch.matmul(p, vc))
        lses.append(lse)

    inverse = torch.argsort(order)
    out = torch.cat(outs)[inverse].reshape(B, Hq, Mq * bq, D)[:, :, :Nq]
    lse = torch.cat(lses)[inverse].reshape(B, Hq, Mq * bq)[:, :, :Nq]
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out.to(q.dtype), lse.to(lse_dtype)

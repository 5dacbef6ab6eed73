"""Block-sparse attention in plain PyTorch: gathers only the nonzero key blocks of each query block.

Works on any device, differentiates (twice, too) through PyTorch's autograd and compiles with
`torch.compile(fullgraph=True)`. Rows (batch, head, query block) are processed in chunks padded to the
longest row of the chunk, so memory stays proportional to the nonzero blocks and no `Nq x Nk` tensor is ever
built. Eagerly, rows are sorted by their number of key blocks first, so that a chunk pads little; inside
`torch.compile` shapes must not depend on the mask's data, so every row pads to the mask's longest row (the
graph guards on the power of two at or above it: `_row_chunks`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .mask import BlockMask
from .reference import _softmax_rows, any_non_finite, exact_scores, poison_scores, split_non_finite

_CHUNK_ELEMENTS = 1 << 23  # score elements per chunk: bounds the working memory (32 MB in fp32)


def _row_chunks(counts: torch.Tensor, longest: int, block_elements: int):
    """The work rows in chunks: `(chunks, order)`, each chunk `(rows, width)` with its rows padded to `width`
    key blocks of `block_elements` score elements each; `order` is the row order of the chunks (None: as is).

    Inside torch.compile every row pads to the mask's longest row, and the rows per chunk follow the power of
    two at or above it: the graph guards on that power, not on the longest row itself, so masks whose longest
    rows fall between the same powers of two share a graph (once Dynamo has made the width symbolic)."""
    total = counts.numel()
    if torch.compiler.is_compiling():
        width = max(longest, 1)
        bound = 1
        while bound < width:  # guards on `width > bound` only
            bound *= 2
        n = max(1, _CHUNK_ELEMENTS // (bound * block_elements))
        device = counts.device
        return [(torch.arange(lo, min(lo + n, total), device=device), width) for lo in range(0, total, n)], None
    order = torch.argsort(counts, descending=True, stable=True)
    sorted_counts = counts[order].tolist()
    chunks, lo = [], 0
    while lo < total:
        width = max(sorted_counts[lo], 1)  # key blocks in the chunk's longest row
        n = max(1, _CHUNK_ELEMENTS // (width * block_elements))
        chunks.append((order[lo:lo + n], width))
        lo += n
    return chunks, order


def _blocks(t: torch.Tensor, num_blocks: int, block: int) -> torch.Tensor:
    """`t` `(B, H, N, D)` zero-padded to `num_blocks * block` rows and split into blocks: `(B * H * num_blocks,
    block, D)`. Made contiguous before the pad: a pad of zero rows keeps the input's strides (a transposed q, for
    one) where the traced graph takes its result for contiguous and splits it with a view."""
    B, H, N, D = t.shape
    return F.pad(t.contiguous(), (0, 0, 0, num_blocks * block - N)).reshape(B * H * num_blocks, block, D)


def _gather(blocks: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`blocks[ids]`: `(*ids.shape, *blocks.shape[1:])` for `blocks` `(num_blocks, ...)`, with a deterministic
    backward. A key block that many rows gather gets their gradients summed: `F.embedding`'s backward sums them
    in a fixed order (on CPU one thread per block, in index order), where that of `blocks[ids]` on CPU adds them
    from several threads in any order (PyTorch lists it as nondeterministic: dK and dV 1 ulp apart from run to
    run). Inside torch.compile it is plain indexing: inductor's CPU code for the backward of `F.embedding` with
    these ids aborted the process (torch 2.13, a heap corruption); compiled, dK and dV sum in inductor's order."""
    if torch.compiler.is_compiling():
        return blocks[ids]
    return F.embedding(ids, blocks.flatten(1)).unflatten(-1, blocks.shape[1:])


def _dense_attention(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The all-ones mask: every key for each query, in chunks of query rows that bound the score memory (no
    index lists, so no mask to build, also inside torch.compile)."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    (qc, q_bad), (kc, k_bad), (vc, v_bad) = (split_non_finite(t.to(compute)) for t in (q, k, v))
    kc, vc = kc.repeat_interleave(Hq // Hkv, dim=1), vc.repeat_interleave(Hq // Hkv, dim=1)
    k_bad, v_bad = (b.repeat_interleave(Hq // Hkv, dim=1)[:, :, None, :] for b in (k_bad, v_bad))  # (B, Hq, 1, Nk)
    k_raw = k.detach().repeat_interleave(Hq // Hkv, dim=1) if any_non_finite(q_bad, k_bad) else None
    rows = max(1, _CHUNK_ELEMENTS // (B * Hq * Nk))
    keys = torch.arange(Nk, device=q.device)
    outs, lses = [], []
    for lo in range(0, Nq, rows):
        hi = min(lo + rows, Nq)
        s = torch.matmul(qc[:, :, lo:hi], kc.transpose(-1, -2)) * scale  # (B, Hq, rows, Nk)
        allowed = (keys[None, :] <= torch.arange(lo, hi, device=q.device)[:, None]) if causal else \
            torch.ones(hi - lo, Nk, dtype=torch.bool, device=q.device)
        exact = exact_scores(q[:, :, lo:hi], k_raw, scale, compute) if k_raw is not None else None
        p, lse = _softmax_rows(poison_scores(s, allowed, q_bad[:, :, lo:hi, None], k_bad, v_bad, exact))
        outs.append(torch.matmul(p, vc))
        lses.append(lse)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2).to(lse_dtype)


def attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask | None, *, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention over the nonzero blocks of `mask` (None: the all-ones mask); returns `(out, lse)`
    like the reference.

    Non-finite inputs follow the reference's rule (see `reference.poison_scores`): they reach only the rows
    that hold or attend them, as exact arithmetic has it, never a row through a padded slot or a masked pair.
    """
    if mask is None:
        return _dense_attention(q, k, v, causal, scale)
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    groups = Hq // Hkv
    bq, bk = mask.block_size
    Mq, Mk = mask.num_blocks
    # One block past its sequence's end covers the whole sequence: cut to it, so that the padding (and the score
    # tiles) grow with the tokens, not with the block (a block of 65,536 over 10 tokens asked for 16 GiB)
    bq, bk = (Nq if Mq == 1 else bq), (Nk if Mk == 1 else bk)  # the mask's lengths are the inputs' (`_validate`)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    mask = mask.to(q.device)
    index = mask._rows(causal)
    longest = mask.longest_row(causal)

    # One work row per (b, hq, query block), numbered (b * Hq + hq) * Mq + i.
    counts = index.counts.expand(B, Hq, Mq).reshape(-1)
    starts = index.offsets[:-1].reshape(index.counts.shape).expand(B, Hq, Mq).reshape(-1)

    (qc, q_bad), (kc, k_bad), (vc, v_bad) = (split_non_finite(t.to(compute)) for t in (q, k, v))
    q_blocks = _blocks(qc, Mq, bq)  # (B * Hq * Mq, bq, D)
    k_blocks, v_blocks = _blocks(kc, Mk, bk), _blocks(vc, Mk, bk)  # (B * Hkv * Mk, bk, D)
    q_bad_blocks = _blocks(q_bad[..., None], Mq, bq)[..., 0]  # (B * Hq * Mq, bq)
    k_bad_blocks, v_bad_blocks = (_blocks(b[..., None], Mk, bk)[..., 0] for b in (k_bad, v_bad))
    if any_non_finite(q_bad, k_bad):  # the raw blocks, for the exact scores of the pairs that touch them
        q_raw_blocks, k_raw_blocks = _blocks(q.detach(), Mq, bq), _blocks(k.detach(), Mk, bk)
    else:
        q_raw_blocks = k_raw_blocks = None
    offs_q = torch.arange(bq, device=q.device)
    offs_k = torch.arange(bk, device=q.device)

    chunks, order = _row_chunks(counts, longest, bk * max(bq, D))
    outs, lses = [], []
    for rows, width in chunks:
        row_counts, row_starts = counts[rows], starts[rows]
        slot = torch.arange(width, device=q.device)
        valid = slot[None, :] < row_counts[:, None]  # (n, width)
        if longest:
            pos = torch.clamp(row_starts[:, None] + slot[None, :], max=index.indices.numel() - 1)
            kb = torch.where(valid, index.indices[pos].long(), 0)  # key block ids; padded slots read block 0
        else:
            kb = torch.zeros_like(valid, dtype=torch.long)
        b, hq, i = rows // (Hq * Mq), (rows // Mq) % Hq, rows % Mq
        kv_rows = ((b * Hkv + hq // groups) * Mk)[:, None] + kb  # (n, width)

        n = len(rows)
        k_rows, v_rows = (_gather(t, kv_rows).reshape(n, width * bk, D) for t in (k_blocks, v_blocks))
        s = torch.matmul(_gather(q_blocks, rows), k_rows.transpose(-1, -2)) * scale
        # key positions built flat, never as a (n, width, bk) view reshaped and then broadcast over the query
        # axis: inductor's CPU code indexed such a view by the query offset when `width` was symbolic
        k_pos = (kb.repeat_interleave(bk, dim=1) * bk + offs_k.repeat(width))[:, None, :]  # (n, 1, width * bk)
        allowed = valid.repeat_interleave(bk, dim=1)[:, None, :] & (k_pos < Nk)  # (n, 1 or bq, width * bk)
        q_pos = (i[:, None] * bq + offs_q)[:, :, None]  # (n, bq, 1)
        if Mq * bq > Nq:  # the padded rows of a query tail attend nothing: no NaN reaches a gradient through them
            allowed = allowed & (q_pos < Nq)
        if causal:
            allowed = allowed & (k_pos <= q_pos)
        exact = None if q_raw_blocks is None else exact_scores(
            q_raw_blocks[rows], k_raw_blocks[kv_rows].reshape(n, width * bk, D), scale, compute)
        s = poison_scores(s, allowed, q_bad_blocks[rows][:, :, None], k_bad_blocks[kv_rows].reshape(n, 1, -1),
                          v_bad_blocks[kv_rows].reshape(n, 1, -1), exact)
        p, lse = _softmax_rows(s)
        outs.append(torch.matmul(p, v_rows))
        lses.append(lse)

    out, lse = torch.cat(outs), torch.cat(lses)
    if order is not None:
        inverse = torch.argsort(order)
        out, lse = out[inverse], lse[inverse]
    out = out.reshape(B, Hq, Mq * bq, D)[:, :, :Nq]
    lse = lse.reshape(B, Hq, Mq * bq)[:, :, :Nq]
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out.to(q.dtype), lse.to(lse_dtype)

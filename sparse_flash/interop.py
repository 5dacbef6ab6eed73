"""Conversions between BlockMask and other mask formats: FlexAttention, element masks, DeepSpeed layouts."""

from __future__ import annotations

import torch

from .layout import BlockIndex, BlockMask, _as_pair


def _flex_module():
    try:
        from torch.nn.attention import flex_attention
    except ImportError as e:  # pragma: no cover - torch < 2.5
        raise ImportError("FlexAttention interop needs torch >= 2.5 (torch.nn.attention.flex_attention)") from e
    return flex_attention


def _padded(index: BlockIndex, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR index lists as FlexAttention's `(B, H, M)` counts and `(B, H, M, width)` zero-padded indices."""
    counts = index.counts
    rows = counts.numel()
    dev = counts.device
    row_of = torch.repeat_interleave(torch.arange(rows, device=dev), counts.flatten().long())
    pos = torch.arange(index.indices.numel(), device=dev) - index.offsets[:-1].long()[row_of]
    out = torch.zeros(rows, width, dtype=torch.int32, device=dev)
    out[row_of, pos] = index.indices
    return counts.contiguous(), out.reshape(*counts.shape, width)


def _layout_mask_mod(mask: BlockMask, causal: bool):
    """FlexAttention's semantics come from the mask_mod (the block mask only lets it skip work), so the
    mask_mod looks the block up in the layout; full blocks never call it."""
    layout = mask.layout
    B, H = layout.shape[:2]
    bq, bk = mask.block_size

    def mask_mod(b, h, q_idx, kv_idx):
        keep = layout[b if B > 1 else 0, h if H > 1 else 0, q_idx // bq, kv_idx // bk]
        return keep & (q_idx >= kv_idx) if causal else keep

    return mask_mod


def _causal_mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def to_flex(mask: BlockMask, causal: bool = False, *, eager_exact: bool = True):
    """The FlexAttention BlockMask of the same attention pattern (full and partial blocks split as ours).

    Its mask_mod looks each element's block up in the layout (and applies `q_idx >= kv_idx` with
    `causal`), so the result is also right in eager mode, where FlexAttention ignores block sparsity.
    Use it with `flex_attention(q, k, v, block_mask=...)`; its block size is the mask's.

    With `eager_exact=False` the mask_mod is only the causal rule (or none), which is exact for
    `torch.compile(flex_attention)` (it skips the zero blocks itself) and avoids a recompilation per mask.
    """
    flex = _flex_module()
    Mk = mask.num_blocks[1]
    idx = mask.kernel_index(causal)
    kv_num, kv_idx = _padded(idx.row_partial, Mk)
    full_num, full_idx = _padded(idx.row_full, Mk)
    return flex.BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx,
        BLOCK_SIZE=mask.block_size,
        mask_mod=_layout_mask_mod(mask, causal) if eager_exact else (_causal_mask_mod if causal else None),
        seq_lengths=(mask.seq_len_q, mask.seq_len_k),
    )


def _scatter_layout(num: torch.Tensor, indices: torch.Tensor, Mk: int) -> torch.Tensor:
    valid = torch.arange(indices.shape[-1], device=indices.device) < num[..., None]
    cols = torch.where(valid, indices.long(), Mk)  # invalid slots land in a spare column
    layout = torch.zeros(*num.shape, Mk + 1, dtype=torch.bool, device=num.device)
    layout.scatter_(-1, cols, True)
    return layout[..., :Mk]


def from_flex(flex_mask, name: str = "from flex") -> BlockMask:
    """The block layout of a FlexAttention BlockMask (its partial and full blocks).

    Only the block structure carries over: element-level masking inside partial blocks (a mask_mod) does
    not; for a causal mask_mod pass `causal=True` to the attention call.
    """
    seq_q, seq_k = flex_mask.seq_lengths
    bq, bk = _as_pair(tuple(flex_mask.BLOCK_SIZE))
    Mq, Mk = -(-seq_q // bq), -(-seq_k // bk)
    layout = _scatter_layout(flex_mask.kv_num_blocks[..., :Mq], flex_mask.kv_indices[..., :Mq, :], Mk)
    if flex_mask.full_kv_num_blocks is not None:
        layout |= _scatter_layout(flex_mask.full_kv_num_blocks[..., :Mq], flex_mask.full_kv_indices[..., :Mq, :], Mk)
    return BlockMask.from_layout(layout, (bq, bk), seq_len_q=seq_q, seq_len_k=seq_k, name=name)

"""Conversions between BlockMask and other mask formats: FlexAttention, element masks, DeepSpeed layouts."""

from __future__ import annotations

import torch

from .checks import as_bool, as_pair, block_pair, positive_int
from .mask import BlockMask
from .mask_index import BlockIndex


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
    # a copy: the FlexAttention mask owns its tensors, and a user who edits them leaves this mask's lists alone
    return counts.clone(memory_format=torch.contiguous_format), out.reshape(*counts.shape, width)


def _layout_mask_mod(mask: BlockMask, causal: bool):
    """FlexAttention's semantics come from the mask_mod (the block mask only lets it skip work), so the
    mask_mod looks the block up in the layout; full blocks never call it."""
    layout = mask.layout.as_subclass(torch.Tensor)  # plain: torch.compile cannot trace the read-only view's checks
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
    `causal` and `eager_exact` are bools (Python or NumPy).
    """
    if not isinstance(mask, BlockMask):
        raise TypeError(f"mask must be a sparse_flash.BlockMask, got {type(mask).__name__}")
    causal = as_bool(causal, "causal")
    eager_exact = as_bool(eager_exact, "eager_exact")
    flex = _flex_module()
    Mk = mask.num_blocks[1]
    idx = mask._lists(causal)
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
    flex = _flex_module()
    if not isinstance(flex_mask, flex.BlockMask):
        raise TypeError(
            f"flex_mask must be a torch.nn.attention.flex_attention.BlockMask, got {type(flex_mask).__name__}"
        )
    seq_q, seq_k = flex_mask.seq_lengths
    bq, bk = as_pair(tuple(flex_mask.BLOCK_SIZE))
    Mq, Mk = -(-seq_q // bq), -(-seq_k // bk)
    layout = _scatter_layout(flex_mask.kv_num_blocks[..., :Mq], flex_mask.kv_indices[..., :Mq, :], Mk)
    if flex_mask.full_kv_num_blocks is not None:
        layout |= _scatter_layout(flex_mask.full_kv_num_blocks[..., :Mq], flex_mask.full_kv_indices[..., :Mq, :], Mk)
    return BlockMask.from_layout(layout, (bq, bk), seq_len_q=seq_q, seq_len_k=seq_k, name=name)


def from_dense(element_mask: torch.Tensor, block_size, *, name: str = "from dense") -> BlockMask:
    """The block mask that keeps every block holding at least one allowed element.

    The result computes a superset of the allowed pairs: blocks are all-or-nothing, so apply the element
    mask's finer structure (e.g. `causal=True`) in the attention call when it matters.

    Args:
        element_mask: bool `(Nq, Nk)`, `(H, Nq, Nk)` or `(B, H, Nq, Nk)`, True where attention is allowed.
            The lengths need not be multiples of the block size.
        block_size: int or `(block_q, block_k)`, in tokens, from 1 (larger than the lengths: one block).
        name: a short description shown by `repr` and `plot`.

    Returns:
        BlockMask with `seq_len_q == Nq`, `seq_len_k == Nk` and layout `(B|1, H|1, ceil(Nq/bq), ceil(Nk/bk))`.

    Example:
        >>> allowed = torch.ones(300, 300, dtype=torch.bool).tril()
        >>> from_dense(allowed, 128).layout[0, 0].int()
        tensor([[1, 0, 0],
                [1, 1, 0],
                [1, 1, 1]], dtype=torch.int32)
    """
    if not isinstance(element_mask, torch.Tensor):
        raise TypeError(f"element_mask must be a torch.Tensor, got {type(element_mask).__name__}")
    if element_mask.dtype != torch.bool:
        raise TypeError(
            f"element_mask must be a bool tensor (True = attend), got dtype {element_mask.dtype}; "
            "convert an additive float mask with `mask == 0`"
        )
    if element_mask.dim() not in (2, 3, 4) or min(element_mask.shape[-2:]) < 1:
        raise ValueError(
            "element_mask must have shape (Nq, Nk), (H, Nq, Nk) or (B, H, Nq, Nk) with Nq, Nk >= 1, got shape "
            f"{tuple(element_mask.shape)}"
        )
    if min(element_mask.shape[:-2], default=1) < 1:
        raise ValueError(
            f"element_mask must have at least one batch and one head, got shape {tuple(element_mask.shape)}"
        )
    bq, bk = block_pair(block_size)
    while element_mask.dim() < 4:
        element_mask = element_mask.unsqueeze(0)
    B, H, Nq, Nk = element_mask.shape
    Mq, Mk = -(-Nq // bq), -(-Nk // bk)
    tq, tk = min(bq, Nq), min(bk, Nk)  # a block longer than its side is one block: pad to the side only
    padded = torch.nn.functional.pad(element_mask, (0, Mk * tk - Nk, 0, Mq * tq - Nq), value=False)
    layout = padded.reshape(B, H, Mq, tq, Mk, tk).any(dim=5).any(dim=3)
    return BlockMask.from_layout(layout, (bq, bk), seq_len_q=Nq, seq_len_k=Nk, name=name)


def from_deepspeed(layout, block_size: int, *, seq_len: int | None = None, name: str = "from deepspeed") -> BlockMask:
    """A BlockMask from a DeepSpeed sparse-attention layout (`SparsityConfig.make_layout`).

    Args:
        layout: integer (0/1) or bool `(H, nb, nb)` (or `(nb, nb)`): block (i, j) of head h is computed
            when `layout[h, i, j] == 1`.
        block_size: DeepSpeed's `block`, one int from 1 for both sides.
        seq_len: sequence length in tokens (self-attention), from `(nb - 1) * block_size + 1` to
            `nb * block_size` (the default); a shorter length than the default makes the last block partial.
        name: a short description shown by `repr` and `plot`.

    Returns:
        BlockMask `(1, H, nb, nb)`.

    Example:
        >>> ds_layout = torch.eye(4, dtype=torch.int64).expand(2, 4, 4)
        >>> from_deepspeed(ds_layout, 64).shape
        (1, 2, 4, 4)
    """
    if not isinstance(layout, torch.Tensor):
        try:
            layout = torch.as_tensor(layout)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(f"layout must be a 0/1 (H, nb, nb) tensor, array or nested list, got "
                            f"{type(layout).__name__} {str(layout)[:40]!r} ({error})") from None
    if layout.dim() not in (2, 3) or layout.shape[-1] != layout.shape[-2]:
        raise ValueError(f"layout must have DeepSpeed's shape (H, nb, nb) or (nb, nb), got shape {tuple(layout.shape)}")
    if layout.dim() == 3 and layout.shape[0] < 1:
        raise ValueError(f"layout must have at least one head, got shape {tuple(layout.shape)}")
    if isinstance(block_size, (tuple, list)):
        raise TypeError(f"block_size must be an int (DeepSpeed uses square blocks), got {block_size!r}")
    block_size = positive_int(block_size, "block_size")
    nb = layout.shape[-1]
    if seq_len is not None:
        lo, hi = (nb - 1) * block_size + 1, nb * block_size
        seq_len = positive_int(seq_len, "seq_len")
        if not lo <= seq_len <= hi:
            raise ValueError(f"seq_len must be an int from {lo} to {hi} (ceil(seq_len / {block_size}) == {nb}, the "
                             f"layout's blocks), got {seq_len}")
    return BlockMask.from_layout(layout, block_size, seq_len_q=seq_len, seq_len_k=seq_len, name=name)


def to_deepspeed(mask: BlockMask, *, num_heads: int | None = None) -> torch.Tensor:
    """The DeepSpeed layout of a self-attention mask: int64 `(H, nb, nb)` of 0/1.

    Args:
        mask: a BlockMask with batch size 1, square blocks and `seq_len_q == seq_len_k`.
        num_heads: expand a mask shared by all heads (`H == 1`) to this many heads (an int from 1); DeepSpeed
            expects one layout per head.

    Returns:
        int64 tensor `(H, nb, nb)` on the mask's device.

    Example:
        >>> from sparse_flash import masks
        >>> to_deepspeed(masks.local(512, 128), num_heads=8).shape
        torch.Size([8, 4, 4])
    """
    if not isinstance(mask, BlockMask):
        raise TypeError(f"mask must be a sparse_flash.BlockMask, got {type(mask).__name__}")
    B, H = mask.shape[:2]
    if B != 1:
        raise ValueError(f"DeepSpeed layouts have no batch dimension: mask batch size must be 1, got {B}")
    bq, bk = mask.block_size
    if bq != bk:
        raise ValueError(f"DeepSpeed layouts need square blocks, got block_size {mask.block_size}")
    if mask.seq_len_q != mask.seq_len_k:
        raise ValueError(
            f"DeepSpeed layouts are for self-attention: seq_len_q and seq_len_k must be equal, got "
            f"{mask.seq_len_q} and {mask.seq_len_k}"
        )
    layout = mask.layout[0].to(torch.int64)
    if num_heads is not None:
        num_heads = positive_int(num_heads, "num_heads")
        if H not in (1, num_heads):
            raise ValueError(f"num_heads={num_heads} does not match the mask's {H} heads")
        layout = layout.expand(num_heads, -1, -1)
    return layout.contiguous()

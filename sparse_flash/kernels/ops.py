"""The launchers registered as torch custom ops, so that `torch.compile(fullgraph=True)` keeps them whole.

Each op has a fake (meta) implementation that only describes its outputs' shapes and dtypes.
"""

from __future__ import annotations

import torch

from .bwd import attn_bwd
from .fwd import attn_fwd


@torch.library.custom_op("sparse_flash::attn_fwd", mutates_args=())
def attn_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: list[torch.Tensor], mask_geometry: list[int],
    causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return attn_fwd(q, k, v, index, mask_geometry, causal, scale)


@attn_fwd_op.register_fake
def _(q, k, v, index, mask_geometry, causal, scale):
    B, Hq, Nq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq, Nq), dtype=torch.float32)  # contiguous, like the launcher


@torch.library.custom_op("sparse_flash::attn_bwd", mutates_args=())
def attn_bwd_op(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    index: list[torch.Tensor], mask_geometry: list[int], causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attn_bwd(do, q, k, v, out, lse, index, mask_geometry, causal, scale)


@attn_bwd_op.register_fake
def _(do, q, k, v, out, lse, index, mask_geometry, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

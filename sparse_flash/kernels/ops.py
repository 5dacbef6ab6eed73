"""The launchers registered as torch custom ops, so that `torch.compile(fullgraph=True)` keeps them whole.

A custom op takes tensors, lists of tensors and numbers only: this is the one place where the mask's records
(`KernelIndex`, `MaskGeometry`) become flat lists (`flatten`) and back (`unflatten`). Each op has a fake (meta)
implementation that only describes its outputs' shapes and dtypes.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..mask_index import BlockIndex, KernelIndex, MaskGeometry, WorkPlan
from . import dispatch
from .launch import dense_plans

_PART_RECORDS = (BlockIndex, BlockIndex, BlockIndex, BlockIndex, WorkPlan, WorkPlan)  # KernelIndex's fields


def flatten(index: KernelIndex | None, geometry: MaskGeometry | None) -> tuple[list[torch.Tensor], list[int]]:
    """The records as a custom op's arguments: every tensor of `index` in field order, and the geometry's ints
    (empty lists for the dense path)."""
    if index is None:
        return [], []
    return [t for part in index for t in part], [int(x) for x in geometry]


def unflatten(flat: list[torch.Tensor], geometry: list[int]) -> tuple[KernelIndex | None, MaskGeometry | None]:
    """The inverse of `flatten`."""
    if not flat:
        return None, None
    tensors, parts = iter(flat), []
    for record in _PART_RECORDS:
        parts.append(record(*(next(tensors) for _ in record._fields)))
    *sizes, long_lists = geometry
    return KernelIndex(*parts), MaskGeometry(*sizes, bool(long_lists))


def _plans(index: list[torch.Tensor]) -> dict | None:
    """Where a call through the ops keeps its launch plan: the dense path's plans (no index: they depend on the
    call's signature only, so torch.compile's calls reuse them, where rebuilding them cost the one-pass
    backward's turns on every call); a mask's calls build theirs per call (the op sees its lists, not the
    mask that owns their plans)."""
    return None if index else dense_plans()


# Inductor's CUDA graphs (torch.compile modes "reduce-overhead" and "max-autotune") run these ops outside the
# graphs they capture around them: the launch plans allocate persistent buffers on first use, which a graph's
# memory pool refuses, and the index lists' sizes differ between masks. (torch.cuda.graph captures them whole.)
_OP_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("sparse_flash::attn_fwd", mutates_args=(), tags=_OP_TAGS)
def attn_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: list[torch.Tensor], geometry: list[int],
    causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return dispatch.attn_fwd(q, k, v, *unflatten(index, geometry), causal, scale, _plans(index))


@attn_fwd_op.register_fake
def _(q, k, v, index, geometry, causal, scale):
    B, Hq, Nq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq, Nq), dtype=torch.float32)  # contiguous, like the launcher


@torch.library.custom_op("sparse_flash::attn_bwd", mutates_args=(), tags=_OP_TAGS)
def attn_bwd_op(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    index: list[torch.Tensor], geometry: list[int], causal: bool, scale: float,
    dlse: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return dispatch.attn_bwd(do, q, k, v, out, lse, *unflatten(index, geometry), causal, scale, _plans(index),
                             dlse)


@attn_bwd_op.register_fake
def _(do, q, k, v, out, lse, index, geometry, causal, scale, dlse=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def attn_fwd(q, k, v, index: KernelIndex | None, geometry: MaskGeometry | None, causal: bool, scale: float):
    """`dispatch.attn_fwd` through the custom op (torch.compile, fake tensors, tensor subclasses)."""
    return attn_fwd_op(q, k, v, *flatten(index, geometry), causal, scale)


def attn_bwd(do, q, k, v, out, lse, index: KernelIndex | None, geometry: MaskGeometry | None, causal: bool,
             scale: float, dlse: torch.Tensor | None = None):
    """`dispatch.attn_bwd` through the custom op."""
    return attn_bwd_op(do, q, k, v, out, lse, *flatten(index, geometry), causal, scale, dlse)

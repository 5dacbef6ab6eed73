"""Autograd for the kernels, and the entry point the public API calls.

Eager calls on plain tensors go straight to the launchers (`dispatch.py`); the registered custom ops (`ops.py`) serve
torch.compile, fake tensors and tensor subclasses. The custom-op dispatcher costs more host time per call
than a kernel launch, which dominates small problems.
"""

from __future__ import annotations

import torch

from ..checks import triton_blocks
from ..mask import BlockMask
from . import ops, settings
from .dispatch import attn_bwd, attn_fwd
from .launch import dense_plans, mask_plans


def _plain(t: torch.Tensor) -> bool:
    """A real tensor in eager mode: the launchers can take it without the custom-op dispatcher."""
    return type(t) is torch.Tensor and not t.is_meta and not torch.compiler.is_compiling()


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Kernels take any batch/head/sequence strides but need unit stride along the head dimension."""
    return t if t.stride(-1) == 1 else t.contiguous()


class BlockSparseAttentionFunction(torch.autograd.Function):
    """out, lse = attention(q, k, v); both differentiable (lse is saved for the backward too: its gradient enters
    the dQ pass's delta, `dispatch.attn_bwd`).

    `index` (a `KernelIndex`) and `geometry` (a `MaskGeometry`) carry the mask, both None for the dense path.
    """

    @staticmethod
    def forward(ctx, q, k, v, index, geometry, causal, scale, plans):
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        if _plain(q):
            out, lse = attn_fwd(q, k, v, index, geometry, causal, scale, plans)
            ctx.settings = settings.current()  # the backward's too, whichever thread autograd runs it in
        else:
            out, lse = ops.attn_fwd(q, k, v, index, geometry, causal, scale)
            ctx.settings = None
        ctx.save_for_backward(q, k, v, out, lse)
        # The mask's index lists are constant, never differentiated: kept as plain references, which costs
        # less host time than 24 saved tensors and their version checks.
        ctx.index, ctx.geometry, ctx.causal, ctx.scale, ctx.plans = index, geometry, causal, scale, plans
        ctx.set_materialize_grads(False)  # a gradient nobody passes stays None: no zero tensor on every backward
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None and dlse is None:
            return (None,) * 8
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else _last_dim_contiguous(dout)
        if dlse is not None:  # the kernels read it as lse: float32, contiguous (a broadcast one is expanded)
            dlse = dlse.to(torch.float32).contiguous()
        args = (dout, q, k, v, out, lse, ctx.index, ctx.geometry, ctx.causal, ctx.scale)
        if _plain(dout) and ctx.settings is not None:
            if settings.current() is ctx.settings:  # the forward's thread, or no override block: nothing to apply
                dq, dk, dv = attn_bwd(*args, ctx.plans, dlse)
            else:
                with settings.applied(ctx.settings):
                    dq, dk, dv = attn_bwd(*args, ctx.plans, dlse)
        else:
            dq, dk, dv = ops.attn_bwd(*args, dlse)
        if torch.is_grad_enabled():  # backward(create_graph=True): these gradients must not pass for differentiable
            extra = () if dlse is None else (dlse,)  # lse's gradient too: every path through dq, dk, dv raises
            dq, dk, dv = _RefuseDoubleBackward.apply(dq, dk, dv, dout, q, k, v, *extra)
        return dq, dk, dv, None, None, None, None, None


_DOUBLE_BACKWARD = (
    "double backward (differentiating the gradients of block_sparse_attention, e.g. a gradient penalty) is not "
    "supported by the triton backend; backend='torch' and backend='reference' support it"
)


class _RefuseDoubleBackward(torch.autograd.Function):
    """`(dq, dk, dv)` as they are, in a graph node whose backward raises a RuntimeError naming the backends that
    can differentiate them. Its inputs are also the backward's own (dO, q, k, v), so the node lies on every path
    from the gradients to what they depend on: `torch.autograd.grad` of a gradient penalty with respect to q or
    to weights upstream reaches it. (Marking the gradients as new leaves, as `once_differentiable` does, cut
    those paths: autograd then returned wrong second derivatives without an error.)"""

    @staticmethod
    def forward(ctx, dq, dk, dv, *inputs):
        return dq.clone(), dk.clone(), dv.clone()  # new tensors: only with create_graph=True

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_DOUBLE_BACKWARD)


def attention_triton(q, k, v, mask: BlockMask | None, *, causal: bool, scale: float):
    """Block-sparse attention through the Triton kernels; `mask=None` runs the dense path.

    fp32 inputs use IEEE fp32 dot products (`input_precision="ieee"`), not TF32.
    Returns `(out, lse)`.
    """
    index = geometry = None  # the dense path
    if mask is not None:
        triton_blocks(mask.block_size)
        index, geometry = mask._records(causal)
    if 0 < scale * 1.4426950408889634 <= 2.0**-150:  # float32 rounds these to 0 (2^-149 is its smallest value)
        scale = 0.0  # below float32's smallest value: the kernels' arithmetic holds it as 0 (x -inf would be NaN)
    if scale <= 0:
        # The kernels keep scores in log2 units times a positive factor (their running maximum relies on it):
        # s * (q . k) == |s| * ((-q) . k), and a zero scale is a zero query. Autograd carries the sign to dq.
        q, scale = (-q, -scale) if scale < 0 else (q * 0.0, 1.0)
    plain = _plain(q)
    if plain and q.is_cuda and q.get_device() != torch.cuda.current_device():
        # Triton launches on the current device: make it q's for this call. The backward runs on the
        # autograd engine's thread for q's device, whose current device already is q's.
        with torch.cuda.device(q.device):
            return attention_triton(q, k, v, mask, causal=causal, scale=scale)
    # Launch plans are kept per mask (the dense path's for all masks); calls inside torch.compile go through
    # `ops.py`, which keeps the dense path's too.
    plans = None if not plain else dense_plans() if index is None else mask_plans(mask)
    if plain and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        # Inference: no graph to record, so no autograd.Function either.
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        return attn_fwd(q, k, v, index, geometry, causal, scale, plans)
    # Self-attention may pass one tensor as q, k and v; torch.compile wants distinct autograd inputs.
    if k is q:
        k = k[...]
    if v is q or v is k:
        v = v[...]
    return BlockSparseAttentionFunction.apply(q, k, v, index, geometry, causal, scale, plans)

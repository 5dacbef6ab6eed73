"""The public entry points: validate the inputs, then dispatch to a backend.

Backends load lazily: `reference` (dense oracle), `torch` (block-sparse in plain PyTorch) and `triton`
(the fused kernels in `sparse_flash.kernels`). An explicitly requested backend never falls back.
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad

from .kernels import settings
from .mask import BlockMask
from .checks import finite_float, is_bool, triton_blocks, triton_problem

BACKENDS = ("auto", "reference", "torch", "triton")
HEAD_DIM_RANGE = (8, 256)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DENSE = object()  # stands for the all-ones mask in flash_attention
FLOAT32_SCALE_LIMIT = torch.finfo(torch.float32).max / 1.4426950408889634  # |scale| x log2(e) within float32


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the triton backend cannot run on `device`, or None when it can."""
    problem = triton_problem()
    if problem is not None:
        return problem
    if not (device.type == "cuda" or (device.type == "cpu" and settings.interpreting())):
        return f"triton kernels need a CUDA device (or TRITON_INTERPRET=1 for CPU tensors), got {device.type}"
    return None if torch.compiler.is_compiling() else settings.interpreter_mismatch()


def _resolve_backend(backend: str, q: torch.Tensor) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        usable = q.dtype in _TRITON_DTYPES and q.is_cuda and triton_unavailable_reason(q.device) is None
        return "triton" if usable else "torch"
    if backend == "triton":
        reason = triton_unavailable_reason(q.device)
        if reason is not None:
            raise RuntimeError(f"backend='triton' was requested but cannot run: {reason}")
        if q.dtype not in _TRITON_DTYPES:
            raise TypeError(f"backend='triton' supports float16, bfloat16 and float32 inputs, got {q.dtype}")
        if q.dtype == torch.bfloat16 and q.device.type == "cpu":
            raise TypeError("backend='triton' cannot take bfloat16 inputs under the Triton interpreter "
                            "(TRITON_INTERPRET=1): its bfloat16 dot products are wrong. Use float16 or float32 there, "
                            "or bfloat16 on a GPU")
    return backend


def _validate(q, k, v, mask, causal, scale, return_lse) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested or t.layout != torch.strided:
            layout = "nested" if t.is_nested else str(t.layout)
            raise TypeError(f"{name} must be a dense (torch.strided) tensor, got a {layout} one")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}")
    B, Hq, Nq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    Bk, Hkv, Nk, Dk = k.shape
    if Bk != B:
        raise ValueError(f"k and v must have q's batch size {B}, got {Bk}")
    if Dk != D:
        raise ValueError(f"k and v must have q's head_dim {D}, got {Dk}")
    if (Hq % Hkv != 0) if Hkv else Hq:
        raise ValueError(f"q's heads ({Hq}) must be a multiple of k's and v's heads ({Hkv}) for GQA/MQA")
    lo, hi = HEAD_DIM_RANGE
    if not lo <= D <= hi:
        raise ValueError(f"head_dim must be between {lo} and {hi}, got {D}")
    if mask is _DENSE:
        pass
    elif not isinstance(mask, BlockMask):
        raise TypeError(f"mask must be a sparse_flash.BlockMask, got {type(mask).__name__}")
    elif (mask.seq_len_q, mask.seq_len_k) != (Nq, Nk):
        raise ValueError(
            f"mask covers (seq_len_q, seq_len_k) = ({mask.seq_len_q}, {mask.seq_len_k}) but q and k have "
            f"lengths ({Nq}, {Nk})"
        )
    elif mask.shape[0] not in (1, B):
        raise ValueError(f"mask batch size must be 1 or q's batch size {B}, got {mask.shape[0]}")
    elif mask.shape[1] not in (1, Hq):
        raise ValueError(f"mask head count must be 1 or q's head count {Hq}, got {mask.shape[1]}")
    if q.is_meta or k.is_meta or v.is_meta:
        raise ValueError("q, k and v must hold real values: meta tensors are not supported (torch.compile's fake "
                         "tensors are)")
    for name, flag in (("causal", causal), ("return_lse", return_lse)):
        if not is_bool(flag):  # Python or NumPy bools
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if scale is not None:
        scale = finite_float(scale, "scale", "a float or None")
        if q.dtype != torch.float64 and abs(scale) > FLOAT32_SCALE_LIMIT:
            raise ValueError(f"scale must be at most {FLOAT32_SCALE_LIMIT:.4g} in magnitude for {q.dtype} inputs (scores "
                             f"are computed in float32, in log2 units: scale x log2(e) must fit), got {scale!r}; "
                             "float64 inputs take any finite scale on the torch and reference backends")


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: BlockMask,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
):
    """Exact softmax attention of each query over the keys its block row allows.

    Args:
        q: `(B, Hq, Nq, D)`, float16, bfloat16 or float32 (float64 for the reference and torch backends).
        k, v: `(B, Hkv, Nk, D)`, same dtype and device; `Hq` a multiple of `Hkv` (GQA, MQA).
            `D` from 8 to 256, any value. Inputs may be non-contiguous, not sparse or nested; a zero batch or head
            count gives empty results.
        mask: a `BlockMask` with `seq_len_q == Nq`, `seq_len_k == Nk`, batch 1 or B and heads 1 or Hq.
            A CPU mask used with CUDA tensors is copied to the GPU once and the copy is cached. The triton
            backend takes mask blocks that are multiples of 16 tokens.
        causal: also require `k_idx <= q_idx`, top-left aligned like
            `F.scaled_dot_product_attention(is_causal=True)`.
        scale: softmax scale, any finite float (0 and negative included); default `1 / sqrt(D)`. Scores are
            kept in float32 (float64 for float64 inputs), so for 16- and 32-bit inputs |scale| may be at most
            2.36e38 (scale x log2(e) must fit; a ValueError past it) and one below float32's smallest value acts
            as 0. Scores that overflow (|q . k| x scale past 3.4e38) give NaN rows, as in
            `F.scaled_dot_product_attention`. The kernels recompute the probabilities in the backward from
            the saved log-sum-exp in float32, whose rounding (one unit in the last place of the row's largest
            score) scales every probability of the row: the float32 gradients' error grows with |q . k| x
            scale. Measured against float64 under the interpreter (dense, one head), where scores reach 10-60:
            dV's error 4-9x PyTorch's own float32 error (about 1e-5 of dV's largest value), dQ's and dK's 1-4x,
            the output's up to 1.5x. There the forward's and the backward's float32 scores also round apart
            (NumPy's products of different shapes); the same arithmetic with equal scores gives dV 0.8-2.3x.
            Where scores reach about 1e6 that rounding is no longer small against 1 and the gradients lose
            accuracy or become NaN. The torch and reference backends differentiate
            their float32 softmax and stay at PyTorch's error. (fp16 gradients stayed within 2x PyTorch's fp16 error in the same tests.)
        return_lse: also return the log-sum-exp of each query's scores.
        backend: `"auto"` (triton on CUDA when usable, else torch), `"triton"`, `"torch"` (block-sparse in
            plain PyTorch, any device) or `"reference"` (dense and materialised: the oracle). A requested
            backend that cannot run raises instead of falling back. Under torch.compile the torch backend's
            graph depends on the mask's longest row (`mask.longest_row(causal)`) rounded up to a power of two:
            a mask whose longest row rounds to another power compiles anew (about log2 of the key blocks graphs
            in all; masks of other constructors may take graphs of their own), where the triton backend
            reuses one graph for every mask of a geometry. Past `torch._dynamo.config.recompile_limit` (8)
            graphs a fullgraph call fails: raise it, or use the triton backend.

    Returns:
        `out` with q's shape and dtype, or `(out, lse)` with lse float32 `(B, Hq, Nq)` (float64 for float64
        inputs) in natural log, differentiable on every backend (d lse_i / d s_ij is the attention weight
        P_ij: merging partial attentions by their lse, or a softmax sink `out * sigmoid(lse - sink)`, trains
        through it; every kernel of the triton backend's backward takes lse's gradient). If a query row of the
        mask is all zero, its output is 0, its lse is -inf and its gradients are 0 (also through lse). The triton backend saves `out` (with q, k, v and lse) for its backward, so an
        in-place edit of `out` before the backward (`out.mul_(2)`, `out += x`) makes the backward raise
        PyTorch's "modified by an inplace operation" RuntimeError, never a wrong gradient: edit a copy
        (`out = out * 2`). The torch and reference backends differentiate through the edit.

    Non-finite inputs: a NaN or infinity in q at row i, or in k or v at key j, reaches only the rows it
    belongs to or that attend it (row i; the rows whose allowed keys include j), as exact arithmetic has it: a
    pair whose score q_i . k_j is NaN or +inf makes its row NaN, one whose score is -inf gives the key weight 0
    in that row (a row whose every score is -inf is empty: output 0), a non-finite v_j makes every row that
    attends j non-finite (the triton kernels: in the columns where v_j is, as exact arithmetic has it; the
    torch and reference backends: the whole row NaN); and the gradients that flow through them. Every other row
    and gradient stays exact, on every backend. A gradient that does flow through a non-finite row is
    non-finite or exact, never a stand-in zero: a non-finite query or key row that reaches an output gets a
    NaN gradient on every backend (one that reaches none, a query of an empty row or a key that no row
    attends, gets the exact 0 from the triton kernels and NaN from the others); the triton kernels keep dV
    exact where only values are non-finite (the probabilities do not depend on them), the torch and reference
    backends make it NaN; likewise the log-sum-exp of a row that attends a non-finite value: exact from the
    kernels, NaN from the others. Open on the triton backend (strict xfail tests): in a causal diagonal tile, a
    non-finite key reaches the dQ of the rows before it (the Triton dQ kernel; the Hopper one is exact), and a
    non-finite query the dK of the keys after it; the Triton backward kernels may also give a non-finite key
    that no row attends a NaN gradient where exact arithmetic has 0 (dK for a non-finite value, dV for a
    non-finite key).

    Example:
        >>> q = k = v = torch.randn(2, 4, 1000, 64)
        >>> mask = sparse_flash.masks.butterfly(1000, 128) | sparse_flash.masks.local(1000, 128, window=1)
        >>> out = sparse_flash.block_sparse_attention(q, k, v, mask)
    """
    _validate(q, k, v, mask, causal, scale, return_lse)
    return _dispatch(q, k, v, mask, causal, scale, return_lse, backend)


def _batched_by_vmap(t: torch.Tensor) -> bool:
    """Whether `t` is batched by torch.func.vmap at any level of its transforms (`vmap(grad(f))` wraps a
    batched tensor in a gradient-tracking one)."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t):
            return True
        t = functorch.get_unwrapped(t)
    return False


def _check_transforms(impl: str, q, k, v) -> None:
    """Refuse what a backend cannot differentiate or batch, rather than give a wrong tangent or a deep error:
    `torch.func.vmap` on every backend (at any level: `vmap(grad(f))` too), any `torch.func` transform on
    triton, and forward-mode AD on triton, whose kernels have no jvp (a tangent was dropped: the inference path
    skips autograd). The torch and reference backends support the other transforms (grad, vjp, jvp, jacrev,
    jacfwd, hessian)."""
    if torch.compiler.is_compiling():
        return
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not torch._C._functorch.is_functorch_wrapped_tensor(t):
            continue
        if _batched_by_vmap(t):
            raise RuntimeError(f"{name} is batched by torch.func.vmap, which block_sparse_attention does not "
                               "support (its masks and kernels take whole batches): call it on the batch instead")
        if impl == "triton":
            raise RuntimeError(f"{name} is a torch.func transform's tensor (grad, vjp, jvp, jacrev, ...): the triton "
                               "backend does not support torch.func; backend='torch' and backend='reference' "
                               "support torch.func.grad, vjp, jvp, jacrev, jacfwd and hessian, and "
                               "torch.autograd gives gradients on every backend")
    if impl == "triton" and forward_ad._current_level >= 0:  # a dual level is open: is any input a dual tensor?
        for name, t in (("q", q), ("k", k), ("v", v)):
            if forward_ad.unpack_dual(t).tangent is not None:
                raise RuntimeError(f"{name} carries a forward-mode AD tangent (torch.autograd.forward_ad), which the "
                                   "triton backend does not support (its kernels have no jvp); backend='torch' and "
                                   "backend='reference' support it")


def _dispatch(q, k, v, mask, causal, scale, return_lse, backend):
    impl = _resolve_backend(backend, q)
    _check_transforms(impl, q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    causal, return_lse = bool(causal), bool(return_lse)
    if impl == "triton" and mask is not _DENSE:  # refused alike for empty inputs
        triton_blocks(mask.block_size)
    if q.numel() == 0 or k.numel() == 0:  # no batch, heads, queries or keys: nothing to compute
        empty_attention = _EmptyAttention if torch.compiler.is_compiling() else _EmptyAttentionWithJvp
        out, lse = empty_attention.apply(q, k, v)
        return (out, lse) if return_lse else out
    # Every backend takes mask=None as the all-ones mask (no mask is built: inside torch.compile it could not be)
    mask = None if mask is _DENSE else mask.to(q.device)
    if impl == "triton":
        from .kernels.function import attention_triton  # loads Triton on first use

        out, lse = attention_triton(q, k, v, mask, causal=causal, scale=scale)
    else:
        # Autocast would run these backends' products in 16 bits while they return q's dtype: they compute in
        # their own precision, as the kernels do (the output keeps q's dtype under autocast on every backend).
        with torch.autocast(q.device.type, enabled=False):
            if impl == "torch":
                from .torch_impl import attention_torch

                out, lse = attention_torch(q, k, v, mask, causal=causal, scale=scale)
            else:
                from .reference import attention_reference

                out, lse = attention_reference(q, k, v, mask, causal=causal, scale=scale)
    return (out, lse) if return_lse else out


class _EmptyAttention(torch.autograd.Function):
    """Attention where q or k has no element: out zeros `(B, Hq, Nq, D)` (a query with no key is an empty row),
    lse -inf `(B, Hq, Nq)` (float32, float64 for float64 inputs); zero gradients. Written for torch.func
    (forward apart from setup_context, a generated vmap rule)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v):
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        return q.new_zeros(q.shape), torch.full(q.shape[:3], float("-inf"), dtype=lse_dtype, device=q.device)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.shapes = tuple(t.shape for t in inputs)

    @staticmethod
    def backward(ctx, dout, dlse):
        return tuple(dout.new_zeros(shape) for shape in ctx.shapes)


class _EmptyAttentionWithJvp(_EmptyAttention):
    """`_EmptyAttention` with forward-mode AD too (zero tangents). Eager only: Dynamo traces no autograd.Function
    with a custom jvp, and torch.compile has no forward-mode AD to serve."""

    @staticmethod
    def jvp(ctx, dq, dk, dv):
        tangent = next(t for t in (dq, dk, dv) if t is not None)
        lse_dtype = torch.float64 if tangent.dtype == torch.float64 else torch.float32
        return tangent.new_zeros(ctx.shapes[0]), tangent.new_zeros(ctx.shapes[0][:3], dtype=lse_dtype)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
):
    """Dense FlashAttention: `block_sparse_attention` with the all-ones mask.

    The triton backend runs the dense path of the same kernels, which walks every key block without
    loading indices. Arguments and returns as in `block_sparse_attention`.

    Example:
        >>> q = k = v = torch.randn(1, 8, 1024, 64)
        >>> sparse_flash.flash_attention(q, k, v, causal=True).shape
        torch.Size([1, 8, 1024, 64])
    """
    _validate(q, k, v, _DENSE, causal, scale, return_lse)
    return _dispatch(q, k, v, _DENSE, causal, scale, return_lse, backend)


def merge_attention(outs, lses) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of disjoint key sets, from the attention over each: `(out, lse)`.

    With `out_r, lse_r = block_sparse_attention(q, k, v, mask_r, return_lse=True)` for masks that share no
    allowed pair, the attention under their union is `sum_r exp(lse_r - lse) out_r` with `lse = logsumexp_r
    lse_r` (keys split across calls, devices or kernels; a block-sparse branch beside another attention).
    Exact, differentiable (through each `lse_r` too), and without NaN where a row is empty in some or all
    parts: a row empty everywhere gives out 0, lse -inf and zero gradients, as one call would. A NaN or
    infinity in a part reaches only the rows that hold it.

    Args:
        outs: a non-empty sequence of `(B, H, N, D)` tensors of one shape and floating dtype.
        lses: their log-sum-exps, `(B, H, N)` each, float32 or float64 (natural log, -inf for an empty row).

    Returns:
        `(out, lse)`: out like `outs[0]` (computed in lse's precision), lse `(B, H, N)` in lse's dtype.

    Example:
        >>> import torch, sparse_flash
        >>> q = k = v = torch.randn(1, 2, 256, 16)
        >>> first, second = (sparse_flash.BlockMask.from_layout(torch.tensor(t, dtype=torch.bool), 128)
        ...                  for t in ([[1, 0], [0, 1]], [[0, 1], [1, 0]]))
        >>> parts = [sparse_flash.block_sparse_attention(q, k, v, m, return_lse=True) for m in (first, second)]
        >>> out, lse = sparse_flash.merge_attention(*zip(*parts))
        >>> torch.allclose(out, sparse_flash.flash_attention(q, k, v), atol=1e-5)
        True
    """
    outs, lses = _merge_inputs(outs, lses)
    lse_all = torch.stack(lses)  # (R, B, H, N)
    top = lse_all.amax(0).detach()  # a stabiliser only: the result does not depend on it
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lse_all - top)  # an empty part's row weighs 0
    total = weights.sum(0)
    empty = total == 0
    total_safe = torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, torch.full_like(total, float("-inf")), top + torch.log(total_safe))
    weights = weights / total_safe
    out = sum(w[..., None] * o.to(w.dtype) for w, o in zip(weights, outs))
    return out.to(outs[0].dtype), lse


def _merge_inputs(outs, lses) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`merge_attention`'s arguments as lists, checked: clear errors naming the argument."""
    for name, seq in (("outs", outs), ("lses", lses)):
        if isinstance(seq, torch.Tensor) or not hasattr(seq, "__len__"):
            raise TypeError(f"{name} must be a sequence of tensors (a list or tuple), got {type(seq).__name__}")
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):
        raise ValueError(f"outs and lses must be non-empty and of one length, got {len(outs)} and {len(lses)}")
    for i, (out, lse) in enumerate(zip(outs, lses)):
        if not isinstance(out, torch.Tensor) or not isinstance(lse, torch.Tensor):
            raise TypeError(f"outs[{i}] and lses[{i}] must be tensors, got {type(out).__name__} and "
                            f"{type(lse).__name__}")
        for what, t in ((f"outs[{i}]", out), (f"lses[{i}]", lse)):
            if t.layout != torch.strided or t.is_nested:
                raise TypeError(f"{what} must be a dense (strided) tensor, got a {'nested' if t.is_nested else t.layout} "
                                "tensor")
        if out.dim() != 4 or tuple(out.shape) != tuple(outs[0].shape) or not out.is_floating_point():
            raise ValueError(f"outs[{i}] must be a floating (B, H, N, D) tensor of outs[0]'s shape "
                             f"{tuple(outs[0].shape)}, got {out.dtype} of shape {tuple(out.shape)}")
        if tuple(lse.shape) != tuple(out.shape[:3]) or lse.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"lses[{i}] must be float32 or float64 of shape {tuple(out.shape[:3])} (its out's "
                             f"(B, H, N)), got {lse.dtype} of shape {tuple(lse.shape)}")
        if lse.dtype != lses[0].dtype or out.dtype != outs[0].dtype or out.device != outs[0].device or \
                lse.device != out.device:
            raise ValueError(f"outs and lses must share one dtype each and one device; part {i} has {out.dtype} / "
                             f"{lse.dtype} on {out.device} / {lse.device}, part 0 {outs[0].dtype} / "
                             f"{lses[0].dtype} on {outs[0].device}")
    return outs, lses

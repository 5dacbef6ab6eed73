"""Helpers for checking attention backends against the dense oracle (used by the test-suite).

The tolerance rule: a backend's error against a float64 reference may be at most twice the error of the
same math done by PyTorch in the same dtype (the dense reference without upcasting), plus a floor for
results that PyTorch happens to get exactly right: half an ulp of the largest reference value in half
precision, 1e-5 of it in float32. The gradients' baseline is the larger of autograd's error and the error of
the FlashAttention backward done by PyTorch in the same dtype (`delta_form_gradients`, rounding where the
kernels must): autograd's softmax backward gives exactly zero dK for a softmax over a single key (P = 1),
while the delta = rowsum(dO * O) form that the kernels use leaves rounding noise that grows with the number
of query rows summed; in 16 bits dS rounded before dQ and a delta read from the stored O can cost a few
half-ulps where autograd happens to be exact (a causal softmax over two keys, found by the CPU suite).
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from .checks import positive_int
from .mask import BlockMask
from .reference import allowed_pairs, attention_reference

_FP32_NOISE = 1e-5

# Max error seen per (backend, dtype, quantity), and how many cases ran: the record of a test session.
ERROR_LOG: dict = defaultdict(lambda: {"cases": 0, "max_error": defaultdict(float), "max_ratio": defaultdict(float)})


@contextlib.contextmanager
def poison_outputs():
    """Fill every kernel output with NaN before launch, so that unwritten tiles fail the comparison."""
    from .kernels import settings

    with settings.override(poison=True):
        yield


def make_qkv(B, Hq, Hkv, Nq, Nk, D, *, dtype, device, seed=0, requires_grad=True, layout="contiguous"):
    """Random q `(B, Hq, Nq, D)` and k, v `(B, Hkv, Nk, D)`, drawn from an explicit generator.

    `layout="transposed"` returns views of `(B, N, H, D)` tensors (non-contiguous, like a fused QKV
    projection); `"strided-d"` returns views whose head dimension has stride 2.
    """
    if layout not in ("contiguous", "transposed", "strided-d"):
        raise ValueError(f"layout must be 'contiguous', 'transposed' or 'strided-d', got {layout!r}")
    for name, value in (("B", B), ("Hq", Hq), ("Hkv", Hkv), ("Nq", Nq), ("Nk", Nk), ("D", D)):
        positive_int(value, name, minimum=0)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    gen = torch.Generator(device="cpu").manual_seed(positive_int(seed, "seed", minimum=0))

    def draw(H, N):
        if layout == "transposed":
            t = torch.randn(B, N, H, D, generator=gen, dtype=torch.float64).transpose(1, 2)
        elif layout == "strided-d":
            t = torch.randn(B, H, N, 2 * D, generator=gen, dtype=torch.float64)[..., ::2]
        else:
            t = torch.randn(B, H, N, D, generator=gen, dtype=torch.float64)
        t = t.to(device=device, dtype=dtype)
        return t.requires_grad_(requires_grad) if requires_grad else t

    return draw(Hq, Nq), draw(Hkv, Nk), draw(Hkv, Nk)


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference, treating equal infinities as equal and any NaN (on either side) as infinite
    error; the two tensors must have one shape."""
    if actual.shape != expected.shape:
        raise ValueError(f"max_error compares tensors of one shape, got {tuple(actual.shape)} and "
                         f"{tuple(expected.shape)}")
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if torch.isnan(a).any() or torch.isnan(e).any():
        return math.inf
    same_inf = torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))
    diff = (a - e).abs().masked_fill(same_inf, 0.0)
    return float(diff.max()) if diff.numel() else 0.0


@dataclass
class Comparison:
    """Errors of a backend and of PyTorch-in-the-same-dtype against the float64 reference."""

    errors: dict = field(default_factory=dict)
    baseline: dict = field(default_factory=dict)
    floors: dict = field(default_factory=dict)

    def failures(self) -> list[str]:
        bad = []
        for name, err in self.errors.items():
            limit = 2.0 * self.baseline[name] + self.floors[name]
            if not err <= limit:
                bad.append(f"{name}: error {err:.3g} > 2 x {self.baseline[name]:.3g} + {self.floors[name]:.2g}")
        return bad


def _run(fn, q, k, v, grad_out, grad_lse=None):
    """Forward and backward of `fn` (from out, and from lse too where `grad_lse` is given); returns out, lse,
    dq, dk, dv."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v)
    if grad_lse is None:
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
    else:
        dq, dk, dv = torch.autograd.grad((out, lse), (q, k, v), (grad_out.to(out.dtype), grad_lse.to(lse.dtype)))
    return out, lse, dq, dk, dv


@torch.no_grad()
def delta_form_gradients(q, k, v, grad_out, mask: BlockMask | None, *, causal=False, scale=None, grad_lse=None):
    """`(dq, dk, dv)` of dense masked attention by the FlashAttention backward, in q's dtype:
    `dS = P * (dO V^T - rowsum(dO * O) + dlse)`, `dQ = dS K scale`, `dK = dS^T Q scale`, `dV = P^T dO` (summed
    over the query heads of a key head). Finite inputs only.

    In 16-bit dtypes the arithmetic is float32 and rounds to q's dtype where a FlashAttention kernel must: P
    before the products that take it (O = P V and dV = P^T dO), the output O (delta reads the stored one), dS
    before dQ and dK, and the results; products accumulate in float32. So this is PyTorch doing the kernels'
    math in their dtype, the error any correct kernel of that form shares (a softmax over two keys whose dS
    cancel, or a delta read from a rounded O, can cost a few half-ulps that autograd's softmax backward, which
    never forms delta, does not).

    Args:
        q: `(B, Hq, Nq, D)`; k, v: `(B, Hkv, Nk, D)`; grad_out: like q; mask, causal, scale: as in
            `attention_reference`; grad_lse: the log-sum-exp's gradient `(B, Hq, Nq)`, or None (zero).
    """
    dtype, (B, Hq, Nq, D), Hkv = q.dtype, q.shape, k.shape[1]
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

    def rounded(t):  # to the kernels' storage dtype and back
        return t.to(dtype).to(compute)

    groups, scale = Hq // Hkv, D**-0.5 if scale is None else scale
    kk, vv = (t.to(dtype).to(compute).repeat_interleave(groups, dim=1) for t in (k, v))
    qq, dout = q.to(compute), grad_out.to(dtype).to(compute)
    s = (qq @ kk.transpose(-1, -2) * scale).masked_fill(~allowed_pairs(mask, causal, Nq, k.shape[2], q.device),
                                                        float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - lse.masked_fill(~torch.isfinite(lse), 0.0)).masked_fill(s == float("-inf"), 0.0)
    out = rounded(rounded(p) @ vv)
    delta = (dout * out).sum(-1, keepdim=True)
    if grad_lse is not None:
        delta = delta - grad_lse.to(compute)[..., None]
    ds = rounded(p * (dout @ vv.transpose(-1, -2) - delta))
    by_kv_head = (B, Hkv, groups) + k.shape[2:]
    dq = ds @ kk * scale
    dk = (ds.transpose(-1, -2) @ qq * scale).view(by_kv_head).sum(2)
    dv = (rounded(p).transpose(-1, -2) @ dout).view(by_kv_head).sum(2)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


def compare_to_reference(q, k, v, mask: BlockMask, *, causal=False, scale=None, backend="torch", grad=True,
                         lse_grad: bool = False) -> Comparison:
    """Run `backend` and check out, lse, dq, dk and dv against the float64 reference (2x rule). `lse_grad`: the
    gradients also flow from the log-sum-exp (a random gradient for it, as for out)."""
    from .api import block_sparse_attention

    dtype = q.dtype
    gen = torch.Generator(device="cpu").manual_seed(1234)
    grad_out = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(q.device)
    grad_lse = torch.randn(q.shape[:3], generator=gen, dtype=torch.float64).to(q.device) if lse_grad else None

    def backend_fn(a, b, c):
        return block_sparse_attention(a, b, c, mask, causal=causal, scale=scale, return_lse=True, backend=backend)

    def torch_fn(upcast):
        return lambda a, b, c: attention_reference(a, b, c, mask, causal=causal, scale=scale, upcast=upcast)

    names = ("out", "lse", "dq", "dk", "dv")
    if grad:
        ours = _run(backend_fn, q, k, v, grad_out, grad_lse)
        ref = _run(torch_fn(True), q.double(), k.double(), v.double(), grad_out, grad_lse)
        low = _run(torch_fn(False), q, k, v, grad_out, grad_lse)
    else:
        names = names[:2]
        with torch.no_grad():
            ours, ref, low = backend_fn(q, k, v), torch_fn(True)(q.double(), k.double(), v.double()), torch_fn(False)(q, k, v)
    eps = torch.finfo(dtype).eps
    result = Comparison()
    delta_form = {}
    if grad and all(bool(torch.isfinite(t).all()) for t in (q, k, v)):
        delta_form = dict(zip(("dq", "dk", "dv"), delta_form_gradients(q, k, v, grad_out, mask, causal=causal,
                                                                         scale=scale, grad_lse=grad_lse)))
    for name, a, r, p in zip(names, ours, ref, low):
        result.errors[name] = max_error(a, r)
        result.baseline[name] = max(max_error(p, r), max_error(delta_form[name], r) if name in delta_form else 0.0)
        finite = r.detach()[torch.isfinite(r.detach())]
        scale_ = float(finite.abs().max()) if finite.numel() else 1.0
        result.floors[name] = max(_FP32_NOISE, eps / 2) * max(scale_, 1.0)
    _log(backend, dtype, result)
    return result


def _log(backend, dtype, result: Comparison) -> None:
    entry = ERROR_LOG[(backend, str(dtype).replace("torch.", ""))]
    entry["cases"] += 1
    for name, err in result.errors.items():
        entry["max_error"][name] = max(entry["max_error"][name], err)
        ratio = err / max(result.baseline[name], 1e-30)
        entry["max_ratio"][name] = max(entry["max_ratio"][name], min(ratio, 1e6))

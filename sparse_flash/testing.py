"""Helpers for checking attention backends against the dense oracle (used by the test-suite).

The tolerance rule: a backend's error against a float64 reference may be at most twice the error of the
same math done by PyTorch in the same dtype (the dense reference without upcasting), plus a floor for
results that PyTorch happens to get exactly right (a softmax over a single key gives P = 1 and zero dK
exactly, while the delta = rowsum(dO * O) form of the backward leaves fp32 rounding noise): half an ulp of
the largest reference value in half precision, 1e-5 of it in float32.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from .mask import BlockMask
from .reference import attention_reference

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
    gen = torch.Generator(device="cpu").manual_seed(seed)

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
    """Largest absolute difference, treating equal infinities as equal and any NaN as infinite error."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if torch.isnan(a).any():
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


def _run(fn, q, k, v, grad_out):
    """Forward and backward of `fn`; returns out, lse, dq, dk, dv."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
    return out, lse, dq, dk, dv


def compare_to_reference(q, k, v, mask: BlockMask, *, causal=False, scale=None, backend="torch", grad=True) -> Comparison:
    """Run `backend` and check out, lse, dq, dk and dv against the float64 reference (2x rule)."""
    from .api import block_sparse_attention

    dtype = q.dtype
    gen = torch.Generator(device="cpu").manual_seed(1234)
    grad_out = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(q.device)

    def backend_fn(a, b, c):
        return block_sparse_attention(a, b, c, mask, causal=causal, scale=scale, return_lse=True, backend=backend)

    def torch_fn(upcast):
        return lambda a, b, c: attention_reference(a, b, c, mask, causal=causal, scale=scale, upcast=upcast)

    names = ("out", "lse", "dq", "dk", "dv")
    if grad:
        ours = _run(backend_fn, q, k, v, grad_out)
        ref = _run(torch_fn(True), q.double(), k.double(), v.double(), grad_out)
        low = _run(torch_fn(False), q, k, v, grad_out)
    else:
        names = names[:2]
        with torch.no_grad():
            ours, ref, low = backend_fn(q, k, v), torch_fn(True)(q.double(), k.double(), v.double()), torch_fn(False)(q, k, v)
    eps = torch.finfo(dtype).eps
    result = Comparison()
    for name, a, r, p in zip(names, ours, ref, low):
        result.errors[name] = max_error(a, r)
        result.baseline[name] = max_error(p, r)
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

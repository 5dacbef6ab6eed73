"""The dense oracle: attention with the block mask materialised as an element mask.

It builds the full `(B, H, Nq, Nk)` score matrix, so it is for tests and small problems only. Every
other backend is checked against it.
"""

from __future__ import annotations

import torch

from .layout import BlockMask


def _softmax_rows(s: torch.Tensor):
    """Masked softmax over the last axis with the empty-row rule: rows with no allowed key give p = 0 and
    lse = -inf, and no NaN reaches values or gradients."""
    m = s.amax(dim=-1, keepdim=True).detach()  # a stabiliser only: the result does not depend on it
    m = m.masked_fill(~torch.isfinite(m), 0.0)
    e = torch.exp(s - m)
    l = e.sum(dim=-1, keepdim=True)
    empty = l == 0
    l_safe = torch.where(empty, torch.ones_like(l), l)
    p = e / l_safe
    lse = (m + torch.log(l_safe)).masked_fill(empty, float("-inf")).squeeze(-1)
    return p, lse


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: BlockMask,
    *,
    causal: bool = False,
    scale: float | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense masked attention.

    Args:
        q: `(B, Hq, Nq, D)`; k, v: `(B, Hkv, Nk, D)` with `Hq % Hkv == 0`.
        mask: BlockMask of matching lengths; `causal` adds `k_idx <= q_idx` (top-left aligned).
        scale: softmax scale, default `1 / sqrt(D)`.
        upcast: compute in float32 (float64 inputs stay float64); False computes in the input dtype, which
            gives the error of "the same math done by PyTorch in that dtype".

    Returns:
        `(out, lse)`: out in q's dtype, lse float32 `(B, Hq, Nq)` (float64 for float64 inputs).
    """
    dtype = q.dtype
    compute = torch.float64 if dtype == torch.float64 else (torch.float32 if upcast else dtype)
    B, Hq, Nq, D = q.shape
    groups = Hq // k.shape[1]
    scale = D**-0.5 if scale is None else scale
    qc, kc, vc = (t.to(compute) for t in (q, k, v))
    kc = kc.repeat_interleave(groups, dim=1)
    vc = vc.repeat_interleave(groups, dim=1)
    allowed = mask.to(q.device).to_dense()
    if causal:
        Nk = k.shape[2]
        allowed = allowed & torch.ones(Nq, Nk, dtype=torch.bool, device=q.device).tril()
    s = torch.matmul(qc, kc.transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    p, lse = _softmax_rows(s)
    out = torch.matmul(p, vc)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return out.to(dtype), lse.to(lse_dtype)

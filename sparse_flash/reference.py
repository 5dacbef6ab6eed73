"""The dense oracle: attention with the block mask materialised as an element mask.

It builds the full `(B, H, Nq, Nk)` score matrix, so it is for tests and small problems only. Every
other backend is checked against it.
"""

from __future__ import annotations

import torch

from .mask import BlockMask


def _softmax_rows(s: torch.Tensor):
    """Masked softmax over the last axis with the empty-row rule: rows with no allowed key give p = 0 and
    lse = -inf, and no NaN reaches values or gradients."""
    m = s.amax(dim=-1, keepdim=True).detach()  # a stabiliser only: the result does not depend on it
    m = m.masked_fill(~torch.isfinite(m), 0.0)
    e = torch.exp(s - m)
    l = e.sum(dim=-1, keepdim=True)
    empty = l == 0
    l_safe = torch.where(empty, torch.ones_like(l), l)
    p = (e / l_safe).masked_fill(s == float("-inf"), 0.0)  # masked pairs stay 0 even in a row that is NaN
    lse = (m + torch.log(l_safe)).masked_fill(empty, float("-inf")).squeeze(-1)
    return p, lse


class _CleanRows(torch.autograd.Function):
    """`t` with the rows `bad` marks set to 0; their gradient is NaN, never 0 (the rows are not in the result,
    but the result is no function of them either: a zero gradient would pass for a real one). Written for
    torch.func (forward apart from setup_context, a generated vmap rule): grad, vjp and jacrev run through it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(t, bad):
        return t.masked_fill(bad[..., None], 0.0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, grad):
        (bad, ) = ctx.saved_tensors
        return grad.masked_fill(bad[..., None], float("nan")), None


class _CleanRowsWithJvp(_CleanRows):
    """`_CleanRows` with forward-mode AD too (`torch.func.jacfwd` and `hessian` of a differentiable input,
    `torch.autograd.forward_ad`): the tangent of a bad row is NaN, as its gradient. Eager only: Dynamo traces
    no autograd.Function with a custom jvp, and torch.compile has no forward-mode AD to serve."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])
        ctx.save_for_forward(inputs[1])

    @staticmethod
    def jvp(ctx, tangent, _):
        (bad, ) = ctx.saved_tensors
        return tangent.masked_fill(bad[..., None], float("nan"))


def split_non_finite(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(clean, bad)`: `t` `(..., N, D)` with every row holding a NaN or an infinity set to 0 (their gradient
    NaN), and bool `(..., N)` marking those rows."""
    bad = ~torch.isfinite(t).all(dim=-1)
    if not t.requires_grad:
        return t.masked_fill(bad[..., None], 0.0), bad
    clean_rows = _CleanRows if torch.compiler.is_compiling() else _CleanRowsWithJvp
    return clean_rows.apply(t, bad), bad


def exact_scores(q: torch.Tensor, k: torch.Tensor, scale: float, compute: torch.dtype) -> torch.Tensor:
    """The scores `scale * q k^T` `(..., Nq, Nk)` as exact arithmetic gives them on the raw inputs, non-finite
    values included (no gradient): where a pair touches a NaN or infinity, `poison_scores` reads whether its
    score is -inf."""
    with torch.no_grad():
        return torch.matmul(q.to(compute), k.to(compute).transpose(-1, -2)) * scale


def poison_scores(s: torch.Tensor, allowed: torch.Tensor, q_bad: torch.Tensor, k_bad: torch.Tensor,
                  v_bad: torch.Tensor, exact: torch.Tensor | None) -> torch.Tensor:
    """Masked scores under the rule for non-finite inputs.

    A NaN or infinity in q at row i, or in k or v at key j, reaches only the rows it belongs to or that attend
    it, and those as exact arithmetic has it: an allowed pair (i, j) that touches a non-finite q row or k row
    takes the score that q_i . k_j gives (`exact_scores`): -inf gives key j weight 0 in row i (exp(-inf) is
    0), NaN or +inf makes the row NaN; a non-finite v_j makes NaN every row that attends j (0 x NaN is NaN). A
    row whose every allowed score is -inf is an empty row (output 0). Every other row stays exact: the caller
    computes with clean inputs (`split_non_finite`), this sets the poisoned pairs to NaN and the pairs that are
    not allowed, or weigh 0, to -inf. Products 0 * NaN of a masked pair never happen, so nothing reaches a row
    (or, in the backward, a gradient) through a pair it does not attend.

    Args:
        s: scores `(..., Nq, Nk)` of the clean inputs; allowed: bool, broadcastable to s; q_bad: bool
            `(..., Nq, 1)`; k_bad, v_bad: bool `(..., 1, Nk)`; exact: `exact_scores` of the raw inputs,
            broadcastable to s, or None where no q or k row is non-finite.
    """
    touched = q_bad | k_bad
    weightless = allowed & touched & ~v_bad & (exact == float("-inf")) if exact is not None else \
        torch.zeros_like(allowed)
    s = s.masked_fill(~allowed | weightless, float("-inf"))
    poisoned = allowed & (touched | v_bad) & ~weightless
    # added rather than filled in, so that the gradient still flows through a poisoned pair (as NaN), never a 0
    return s + torch.where(poisoned, float("nan"), 0.0).to(s.dtype)


def any_non_finite(*bad: torch.Tensor) -> bool:
    """Whether any of the bool tensors is true; inside torch.compile always True (no data-dependent branch),
    so that `exact_scores` is computed there whatever the data."""
    if torch.compiler.is_compiling():
        return True
    return any(bool(b.any()) for b in bad)


def allowed_pairs(mask: BlockMask | None, causal: bool, Nq: int, Nk: int, device) -> torch.Tensor:
    """bool `(B|1, H|1, Nq, Nk)`: the (query, key) pairs that `mask` (None: all) and `causal` (top-left
    aligned: `k_idx <= q_idx`) allow."""
    allowed = torch.ones(1, 1, Nq, Nk, dtype=torch.bool, device=device) if mask is None else \
        mask.to(device).to_dense()
    if causal:
        allowed = allowed & torch.ones(Nq, Nk, dtype=torch.bool, device=device).tril()
    return allowed


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: BlockMask | None,
    *,
    causal: bool = False,
    scale: float | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense masked attention.

    Args:
        q: `(B, Hq, Nq, D)`; k, v: `(B, Hkv, Nk, D)` with `Hq % Hkv == 0`.
        mask: BlockMask of matching lengths, or None for the all-ones mask; `causal` adds `k_idx <= q_idx`
            (top-left aligned).
        scale: softmax scale, default `1 / sqrt(D)`.
        upcast: compute in float32 (float64 inputs stay float64); False computes in the input dtype, which
            gives the error of "the same math done by PyTorch in that dtype".

    A NaN or infinity in q, k or v reaches only the rows that hold or attend it (`poison_scores`).

    Returns:
        `(out, lse)`: out in q's dtype, lse float32 `(B, Hq, Nq)` (float64 for float64 inputs).
    """
    dtype = q.dtype
    compute = torch.float64 if dtype == torch.float64 else (torch.float32 if upcast else dtype)
    B, Hq, Nq, D = q.shape
    groups = Hq // k.shape[1]
    scale = D**-0.5 if scale is None else scale
    (qc, q_bad), (kc, k_bad), (vc, v_bad) = (split_non_finite(t.to(compute)) for t in (q, k, v))
    kc = kc.repeat_interleave(groups, dim=1)
    vc = vc.repeat_interleave(groups, dim=1)
    k_bad, v_bad = (b.repeat_interleave(groups, dim=1)[..., None, :] for b in (k_bad, v_bad))
    allowed = allowed_pairs(mask, causal, Nq, k.shape[2], q.device)
    s = torch.matmul(qc, kc.transpose(-1, -2)) * scale
    exact = exact_scores(q, k.repeat_interleave(groups, dim=1), scale, compute) \
        if any_non_finite(q_bad, k_bad) else None
    s = poison_scores(s, allowed, q_bad[..., :, None], k_bad, v_bad, exact)
    p, lse = _softmax_rows(s)
    out = torch.matmul(p, vc)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return out.to(dtype), lse.to(lse_dtype)

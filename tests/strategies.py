"""Hypothesis strategies for attention problems: shapes, odd lengths, block sizes, masks and seeds."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from sparse_flash import BlockMask, masks

MASK_KINDS = ("random", "butterfly", "local", "causal", "dense", "bigbird", "empty_rows", "per_batch")


@dataclass(frozen=True)
class Problem:
    B: int
    Hq: int
    Hkv: int
    Nq: int
    Nk: int
    D: int
    block_q: int
    block_k: int
    kind: str
    density: float
    causal: bool
    seed: int

    def mask(self, device="cpu") -> BlockMask:
        return build_mask(self, device)

    def __repr__(self) -> str:  # short enough to read in a failure report
        return (
            f"Problem(B={self.B}, Hq={self.Hq}, Hkv={self.Hkv}, Nq={self.Nq}, Nk={self.Nk}, D={self.D}, "
            f"block=({self.block_q}, {self.block_k}), kind={self.kind!r}, density={self.density}, "
            f"causal={self.causal}, seed={self.seed})"
        )


def build_mask(p: Problem, device="cpu") -> BlockMask:
    bs = (p.block_q, p.block_k)
    Mq, Mk = math.ceil(p.Nq / p.block_q), math.ceil(p.Nk / p.block_k)
    gen = torch.Generator().manual_seed(p.seed)
    if p.kind == "random":
        return masks.random(p.Nq, bs, density=p.density, seed=p.seed, num_heads=p.Hq, seq_len_k=p.Nk, device=device)
    if p.kind == "butterfly":
        return masks.butterfly(p.Nq, bs, seq_len_k=p.Nk, device=device)
    if p.kind == "local":
        return masks.local(p.Nq, bs, window=p.seed % 3, seq_len_k=p.Nk, device=device)
    if p.kind == "causal":
        return masks.causal(p.Nq, bs, seq_len_k=p.Nk, device=device)
    if p.kind == "dense":
        return masks.dense(p.Nq, bs, seq_len_k=p.Nk, device=device)
    if p.kind == "bigbird":
        return masks.bigbird(p.Nq, bs, seq_len_k=p.Nk, num_heads=p.Hq, seed=p.seed, device=device)
    if p.kind == "empty_rows":  # per-head layouts in which some query blocks see nothing
        layout = torch.rand(p.Hq, Mq, Mk, generator=gen) < p.density
        layout[:, torch.rand(Mq, generator=gen) < 0.5] = False
        return BlockMask.from_layout(layout.to(device), bs, seq_len_q=p.Nq, seq_len_k=p.Nk, name="empty rows")
    if p.kind == "per_batch":  # one layout per (batch, head)
        layout = torch.rand(p.B, p.Hq, Mq, Mk, generator=gen) < p.density
        return BlockMask.from_layout(layout.to(device), bs, seq_len_q=p.Nq, seq_len_k=p.Nk, name="per batch")
    raise ValueError(p.kind)


@st.composite
def problems(draw, *, block_sizes=(16, 32, 48, 64, 128), head_dims=(8, 16, 24, 40, 64, 72), max_len=300):
    """Attention problems small enough for the CPU, covering the awkward cases."""
    Hkv = draw(st.integers(1, 2))
    groups = draw(st.sampled_from([1, 2]))
    block_q = draw(st.sampled_from(block_sizes))
    block_k = draw(st.sampled_from(block_sizes))
    return Problem(
        B=draw(st.integers(1, 2)),
        Hq=Hkv * groups,
        Hkv=Hkv,
        Nq=draw(st.integers(1, max_len)),
        Nk=draw(st.integers(1, max_len)),
        D=draw(st.sampled_from(head_dims)),
        block_q=block_q,
        block_k=block_k,
        kind=draw(st.sampled_from(MASK_KINDS)),
        density=draw(st.sampled_from([0.0, 0.2, 0.5, 1.0])),
        causal=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )

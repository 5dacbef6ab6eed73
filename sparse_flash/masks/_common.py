"""Helpers shared by the mask constructors: geometry, block coordinates, and the argument checks of
`sparse_flash.checks` (imported here for them)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..checks import (  # noqa: F401  (the constructors take their checks from here)
    MAX_INT, MAX_SEED, as_bool, as_pair, block_indices, block_pair, is_bool, odd_int, optional_heads, positive_int,
    probability, seed_value,
)
from ..mask import BlockMask

MAX_LAYOUT_BLOCKS = 2**31 - 1  # heads x Mq x Mk: the int32 offsets of the index lists address every block


class GridError(ValueError):
    """A pattern parameter that does not fit the mask's grid of blocks (a global block past the last block):
    valid for longer sequences, so the `nn` layer checks it per length instead of at construction."""


def generator(seed) -> torch.Generator:
    """A generator seeded explicitly (no global RNG state). An int seed draws on the CPU, whatever device the mask
    is built on, so that one seed gives one mask on every device; a user's generator is used as given."""
    seed = seed_value(seed)
    if isinstance(seed, torch.Generator):
        return seed
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return gen


class Geometry(NamedTuple):
    block_q: int
    block_k: int
    seq_len_q: int
    seq_len_k: int
    num_blocks_q: int
    num_blocks_k: int


def geometry(seq_len, block_size, seq_len_k=None, heads: int = 1) -> Geometry:
    """Block counts for a query length, a key length (default: the same) and a block size.

    Refuses grids whose `heads x Mq x Mk` layout the int32 index lists cannot address, before any tensor
    is allocated."""
    seq_len = positive_int(seq_len, "seq_len")
    seq_len_k = seq_len if seq_len_k is None else positive_int(seq_len_k, "seq_len_k")
    bq, bk = block_pair(block_size)
    Mq, Mk = -(-seq_len // bq), -(-seq_len_k // bk)
    if heads * Mq * Mk > MAX_LAYOUT_BLOCKS:
        raise ValueError(
            f"seq_len={seq_len}, seq_len_k={seq_len_k} and block_size {(bq, bk)} give {heads} x {Mq} x {Mk} = "
            f"{heads * Mq * Mk} blocks, more than the {MAX_LAYOUT_BLOCKS} that the mask's int32 index lists "
            "address; use a larger block_size or shorter sequences"
        )
    for name, n, b, m in (("seq_len", seq_len, bq, Mq), ("seq_len_k", seq_len_k, bk, Mk)):
        if m * b > MAX_INT:
            raise ValueError(f"{name}={n} rounded up to whole blocks of {b} is {m * b} tokens, more than {MAX_INT}")
    return Geometry(bq, bk, seq_len, seq_len_k, Mq, Mk)


def square_geometry(pattern: str, seq_len, block_size, heads: int = 1) -> Geometry:
    """The geometry of a self-attention pattern defined on one grid of blocks for queries and keys."""
    geo = geometry(seq_len, block_size, heads=heads)
    if geo.block_q != geo.block_k:
        raise ValueError(f"{pattern} needs square blocks (one grid for queries and keys), got block_size "
                         f"{(geo.block_q, geo.block_k)}")
    return geo


def check_on_grid(values: list[int], geo: Geometry, name: str, *, ends: bool = False) -> None:
    """Block indices (or exclusive `ends` of block ranges) must lie on the grid: a GridError otherwise."""
    limit = max(geo.num_blocks_q, geo.num_blocks_k)
    bad = [v for v in values if v > limit or (v == limit and not ends)]
    if bad:
        bound = f"be at most {limit}" if ends else f"name blocks below {limit}"
        raise GridError(f"{name} must {bound} (the mask has {geo.num_blocks_q} x {geo.num_blocks_k} blocks), got "
                        f"{bad[0]} in {values}")


def block_coords(geo: Geometry, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Query block indices `(Mq, 1)` and key block indices `(1, Mk)`, for broadcasting."""
    i = torch.arange(geo.num_blocks_q, device=device)[:, None]
    j = torch.arange(geo.num_blocks_k, device=device)[None, :]
    return i, j


def causal_blocks(geo: Geometry, device) -> torch.Tensor:
    """`(Mq, Mk)`: blocks holding at least one pair with key index <= query index (top-left aligned)."""
    i, j = block_coords(geo, device)
    last_query = torch.clamp((i + 1) * geo.block_q, max=geo.seq_len_q) - 1
    return j * geo.block_k <= last_query


def make(layout: torch.Tensor, geo: Geometry, name: str) -> BlockMask:
    return BlockMask.from_layout(
        layout, (geo.block_q, geo.block_k), seq_len_q=geo.seq_len_q, seq_len_k=geo.seq_len_k, name=name
    )

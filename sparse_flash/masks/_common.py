"""Helpers shared by the mask constructors: geometry, argument checks and block coordinates."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..layout import BlockMask, _as_pair


class Geometry(NamedTuple):
    block_q: int
    block_k: int
    seq_len_q: int
    seq_len_k: int
    num_blocks_q: int
    num_blocks_k: int


def geometry(seq_len, block_size, seq_len_k=None) -> Geometry:
    """Block counts for a query length, a key length (default: the same) and a block size."""
    seq_len = positive_int(seq_len, "seq_len")
    seq_len_k = seq_len if seq_len_k is None else positive_int(seq_len_k, "seq_len_k")
    bq, bk = _as_pair(block_size)
    return Geometry(bq, bk, seq_len, seq_len_k, math.ceil(seq_len / bq), math.ceil(seq_len_k / bk))


def positive_int(value, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def optional_heads(num_heads) -> int:
    return 1 if num_heads is None else positive_int(num_heads, "num_heads")


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


def generator(seed, device) -> torch.Generator:
    """A generator seeded explicitly, on the device the mask is built on (no global RNG state)."""
    if isinstance(seed, torch.Generator):
        return seed
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int or a torch.Generator, got {type(seed).__name__}")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def make(layout: torch.Tensor, geo: Geometry, name: str) -> BlockMask:
    return BlockMask.from_layout(
        layout, (geo.block_q, geo.block_k), seq_len_q=geo.seq_len_q, seq_len_k=geo.seq_len_k, name=name
    )

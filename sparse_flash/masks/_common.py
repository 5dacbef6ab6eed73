"""Helpers shared by the mask constructors: argument checks, geometry and block coordinates.

Every constructor (and `nn`, `cli` and `interop`) checks its arguments with the validators here, so that one
kind of value is refused in one way everywhere: ints may be Python or NumPy ints but never bools, bools may
be Python or NumPy bools, and the message names the argument, what was expected and what came.
"""

from __future__ import annotations

import numbers
import sys
from typing import NamedTuple

import torch

from ..mask import BlockMask, _as_pair

MAX_INT = 2**63 - 1  # every int argument: it must fit the int64 arithmetic the layouts are built with
MAX_LAYOUT_BLOCKS = 2**31 - 1  # heads x Mq x Mk: the int32 offsets of the index lists address every block
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range


class GridError(ValueError):
    """A pattern parameter that does not fit the mask's grid of blocks (a global block past the last block):
    valid for longer sequences, so the `nn` layer checks it per length instead of at construction."""


def is_bool(value) -> bool:
    """True for Python and NumPy bools (NumPy is not imported for it)."""
    numpy = sys.modules.get("numpy")
    return isinstance(value, bool) or (numpy is not None and isinstance(value, numpy.bool_))


def as_bool(value, name: str) -> bool:
    if not is_bool(value):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def positive_int(value, name: str, minimum: int = 1, maximum: int = MAX_INT) -> int:
    """`value` as an int in `[minimum, maximum]`: Python or NumPy ints, never bools or floats."""
    if is_bool(value) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    if value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value}")
    return value


def optional_heads(num_heads) -> int:
    return 1 if num_heads is None else positive_int(num_heads, "num_heads")


def probability(value, name: str) -> float:
    """A float in [0, 1] (NaN and infinities refused)."""
    if is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1], got {type(value).__name__} {value!r}")
    value = float(value)
    if not 0.0 <= value <= 1.0:  # also false for NaN
        raise ValueError(f"{name} must be a float in [0, 1], got {value}")
    return value


def odd_int(value, name: str) -> int:
    value = positive_int(value, name)
    if value % 2 == 0:
        raise ValueError(f"{name} must be odd (a window centred on the diagonal: 3 means +-1), got {value}")
    return value


def block_indices(values, name: str, *, distinct: bool = True) -> list[int]:
    """A sequence of block indices (ints >= 0, `distinct` ones unless told): lists, tuples, NumPy arrays and
    int tensors."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence of block indices such as (0, 16), got {type(values).__name__} "
                        f"{values!r}")
    if hasattr(values, "tolist"):  # NumPy arrays and tensors hold their ints as 0-d objects
        values = values.tolist()
    indices = [positive_int(v, f"{name}[{k}]", minimum=0) for k, v in enumerate(values)]
    if distinct and len(set(indices)) != len(indices):
        raise ValueError(f"{name} must not repeat a block, got {indices}")
    return indices


def seed_value(seed) -> int | torch.Generator:
    if isinstance(seed, torch.Generator):
        return seed
    expected = "seed must be an int in [0, 2**64 - 1] or a torch.Generator, got"
    if is_bool(seed) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"{expected} {type(seed).__name__} {seed!r}")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{expected} {seed}")
    return int(seed)


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


def block_pair(block_size) -> tuple[int, int]:
    """`block_size` as `(block_q, block_k)`; NumPy ints are accepted like Python ints."""
    bq, bk = _as_pair(block_size)
    return positive_int(bq, "block_size"), positive_int(bk, "block_size")


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

"""Helpers shared by the mask constructors: geometry, block coordinates, and the argument checks of
`sparse_flash.checks` (imported here for them)."""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch

from ..checks import (  # noqa: F401  (the constructors take their checks from here)
    MAX_INT, MAX_SEED, as_bool, as_pair, block_indices, block_pair, check_device, is_bool, odd_int, optional_heads,
    positive_int, probability, seed_value,
)
from ..mask import BlockMask, check_eager
from ..mask_index import BlockRuns, LayoutSizes, candidates, gpu_builders, one_host_thread

# runs a pattern lists on the host (`pattern_runs`); past it the layout is made on the device and its lists' sizes
# are counted from the pattern (`pattern_sizes`). Counting lists from runs costs ~45 ns a run (`run_sizes`: 3 ms
# for the 67,584 runs of a 4-head fixed pattern at 65,536 tokens).
MAX_LISTED_RUNS = 1 << 17
MAX_LAYOUT_BLOCKS = 2**31 - 1  # heads x Mq x Mk: the int32 offsets of the index lists address every block


class GridError(ValueError):
    """A pattern parameter that does not fit the mask's grid of blocks (a global block past the last block):
    valid for longer sequences, so the `nn` layer checks it per length instead of at construction."""


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """`x * c mod 2**32` for int64 `x` in [0, 2**32) and a 32-bit constant, without int64 overflow (reuses `x`'s
    products in place: these run over every block of the layout)."""
    high = x.mul(c >> 16).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return x.mul(c & 0xFFFF).add_(high).bitwise_and_(_MASK32)


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser, in place on a fresh int64 tensor of values in [0, 2**32): every input bit
    flips each output bit with probability about 1/2."""
    x.bitwise_xor_(x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x.bitwise_xor_(x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x.bitwise_xor_(x >> 16)


def _seed_words(seed: int) -> tuple[int, int]:
    """Two 32-bit constants from a 64-bit seed, mixed on the host (Python ints: no device work)."""
    words = []
    for salt in (0x243F6A88, 0x85A308D3):
        x = ((seed & _MASK32) ^ salt) + (seed >> 32) * 0x9E3779B1
        for _ in range(2):
            x &= _MASK32
            x ^= x >> 16
            x = (x * 0x85EBCA6B) & _MASK32
            x ^= x >> 13
            x = (x * 0xC2B2AE35) & _MASK32
            x ^= x >> 16
        words.append(x)
    return words[0], words[1]


def hash_draws(seed: int, shape: tuple[int, ...], device=None) -> torch.Tensor:
    """int64 `shape` of 32-bit pseudo-random values, a hash of (seed, position): integer arithmetic only, so the
    same numbers on every device, with no generator state (a Weyl sequence offset by the seed, then two rounds of
    MurmurHash3's finaliser, the second keyed by the seed again, so that no two seeds give shifted copies).

    Example:
        >>> hash_draws(0, (2, 3)).shape
        torch.Size([2, 3])
    """
    return _draws(seed, shape, device, torch.int64)


def _draws(seed: int, shape: tuple[int, ...], device, dtype: torch.dtype) -> torch.Tensor:
    """`hash_draws` (int64) or `uniform_draws` (float32) of an int seed: one Triton launch where the GPU
    builders run (`mask_index.gpu_builders`), else the torch operators."""
    words = _seed_words(seed)
    out = torch.empty(shape, dtype=dtype, device=device)
    index_gpu = gpu_builders(out)
    if index_gpu is not None:
        return index_gpu.hash_into(out, words)
    first, second = words
    x = torch.arange(math.prod(shape), dtype=torch.int64, device=device)
    x = _fmix32(x.mul_(0x9E3779B1).add_(first).bitwise_and_(_MASK32))  # positions < 2**31: no overflow
    x = _fmix32(x.add_(second).bitwise_and_(_MASK32)).reshape(shape)
    return x if dtype == torch.int64 else (x >> 8).to(torch.float32) * 2.0**-24


def uniform_draws(seed, shape: tuple[int, ...], device=None) -> torch.Tensor:
    """float32 `shape` in [0, 1): from `hash_draws` for an int seed (24 bits each; one mask on every device), or
    `torch.rand` with a user's `torch.Generator` (on its device), moved to `device`."""
    if isinstance(seed, torch.Generator):
        return torch.rand(shape, generator=seed, device=seed.device).to(device)
    return _draws(seed, shape, device, torch.float32)


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
    is allocated. Inside torch.compile a RuntimeError: patterns are built eagerly (`mask.check_eager`)."""
    check_eager(None)
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


def make(layout: torch.Tensor, geo: Geometry, name: str, sizes: LayoutSizes | None = None) -> BlockMask:
    """A mask owning a layout that a constructor made (not copied: the constructor never writes it again);
    `sizes`: its lists' sizes where the constructor counted them from its pattern (`pattern_sizes`), so that its
    build on a GPU does not wait for the device."""
    return BlockMask._from_made_layout(layout, sizes, (geo.block_q, geo.block_k), geo.seq_len_q, geo.seq_len_k, name)


def make_from_runs(runs: BlockRuns, geo: Geometry, name: str, device, heads: int = 1, tiling=None) -> BlockMask:
    """A `(1, heads, Mq, Mk)` mask of the blocks of `runs` (`mask_index.BlockRuns`, on the grid, the runs of a row
    disjoint): the sizes of its lists are counted on the host, so its build on a GPU does not wait for the
    device (`BlockMask._from_runs`)."""
    return BlockMask._from_runs(runs, heads, (geo.block_q, geo.block_k), geo.seq_len_q, geo.seq_len_k, name, device,
                                tiling)


def _merged(ranges, limit: int) -> list[tuple[int, int]]:
    """Half-open ranges clipped to `[0, limit)`, sorted and merged where they touch or overlap."""
    out = []
    for start, end in sorted((max(0, s), min(e, limit)) for s, e in ranges):
        if start >= end:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _covered(ranges, limit: int) -> torch.Tensor | None:
    """bool `(limit,)`: the positions inside any of the half-open `ranges` of ints (clipped to `[0, limit)`; empty
    or overlapping ones allowed), or None where there are no ranges: a start and an end mark per range, summed
    (a few operators however many ranges, where merging them in Python took a microsecond each)."""
    if not len(ranges):
        return None
    start, end = torch.tensor(ranges, dtype=torch.int64).view(-1, 2).clamp_(0, limit).unbind(1)
    at = torch.cat([start, torch.maximum(start, end)])  # an empty range: its two marks cancel
    marks = torch.zeros(limit + 1, dtype=torch.int64).index_add_(0, at, _SIGNS.repeat_interleave(len(start)))
    return marks.cumsum_(0)[:limit] > 0


@one_host_thread()
def pattern_runs(geo: Geometry, *, band: tuple[torch.Tensor, torch.Tensor] | None = None, columns=(), rows=(),
                 causal: bool = False) -> BlockRuns:
    """The runs (`mask_index.BlockRuns`) of one head's pattern made of up to three parts, listed on the host in
    O(Mq x (1 + 2 x len(columns))) whatever the number of blocks: per query block i the key blocks
    `band[0][i] .. band[1][i] - 1` (int64 `(Mq,)` CPU tensors, clipped to the grid), every row's key blocks in
    the half-open ranges `columns`, and every key block of the query blocks in the ranges `rows`; with `causal`
    only the blocks holding a causal pair (`causal_blocks`).

    Example:
        >>> geo = geometry(512, 128)
        >>> i = torch.arange(4)
        >>> runs = pattern_runs(geo, band=(i - 1, i + 2), columns=[(0, 1)], rows=[(0, 1)])
        >>> runs.size()  # the tridiagonal band (10 blocks), row 0 and column 0 (7), 3 shared
        14
    """
    Mq, Mk = geo.num_blocks_q, geo.num_blocks_k
    columns = _merged(columns, Mk)
    gaps = _merged([(0, Mk)] if not columns else
                   [(0, columns[0][0]), *((a[1], b[0]) for a, b in zip(columns, columns[1:])), (columns[-1][1], Mk)], Mk)
    starts = [torch.full((Mq,), s, dtype=torch.int64) for s, _ in columns]
    ends = [torch.full((Mq,), e, dtype=torch.int64) for _, e in columns]
    if band is not None:  # the band's pieces between the columns
        low, high = band[0].clamp(0, Mk), band[1].clamp(0, Mk)
        starts += [low.clamp(min=s) for s, _ in gaps]
        ends += [high.clamp(max=e) for _, e in gaps]
    if not starts:
        starts, ends = [torch.zeros(Mq, dtype=torch.int64)], [torch.zeros(Mq, dtype=torch.int64)]
    start, end = torch.stack(starts, 1), torch.stack(ends, 1)  # (Mq, parts)
    full = _merged(rows, Mq)
    if full:  # a full row: one run of every key block, its other runs empty
        is_full = torch.zeros(Mq, 1, dtype=torch.bool)
        for s, e in full:
            is_full[s:e] = True
        first = torch.zeros(1, start.shape[1], dtype=torch.bool)
        first[0, 0] = True
        start = torch.where(is_full, torch.where(first, 0, Mk), start)
        end = torch.where(is_full, Mk, end)
    if causal:
        end = torch.minimum(end, candidates(True, (Mq, Mk, *geo[:4]), "cpu")[:, None])
    row = torch.arange(Mq)[:, None].expand_as(start)
    return BlockRuns(row.flatten(), start.flatten(), end.flatten())


@one_host_thread()
def pattern_sizes(geo: Geometry, patterns: list[dict], head_pattern: list[int]) -> LayoutSizes:
    """The `LayoutSizes` of a `(1, H, Mq, Mk)` layout whose head h holds pattern `patterns[head_pattern[h]]`
    (the keyword arguments of `pattern_runs`: band, columns, rows, causal), counted from the pattern itself in
    O(Mq + Mk) per pattern, however many blocks or runs it has: what `mask_index.run_sizes` counts from its runs
    (tests/test_layout.py compares them), for patterns with too many runs to list (`MAX_LISTED_RUNS`).

    Example:
        >>> geo = geometry(512, 128)
        >>> i = torch.arange(4)
        >>> sizes = pattern_sizes(geo, [dict(band=(i - 1, i + 2), columns=[(0, 1)], rows=[(0, 1)])], [0])
        >>> sizes.totals[0], sizes.longest[False]  # 14 blocks; row 0 and column 0 hold 4 each
        (14, (4, 4))
    """
    Mq, Mk = geo.num_blocks_q, geo.num_blocks_k
    cand = candidates(True, (Mq, Mk, *geo[:4]), "cpu")  # (Mq,) the key blocks holding a causal pair
    lowest = torch.clamp((torch.arange(Mq) * geo.block_q + 1) // geo.block_k, max=Mk)  # first on the diagonal
    key_tail, query_tail = Mk * geo.block_k > geo.seq_len_k, Mq * geo.block_q > geo.seq_len_q
    counted = [_pattern_counts(geo, cand, lowest, key_tail, query_tail, **pattern) for pattern in patterns]
    rows = torch.stack([counted[p][0] for p in head_pattern], 1).unsqueeze(1)  # (2, 1, H, Mq): per flag
    cols = torch.stack([counted[p][1] for p in head_pattern], 1).unsqueeze(1)  # (2, 1, H, Mk)
    partial = sum(counted[p][2] for p in head_pattern)  # (2,)
    n = rows.sum((1, 2, 3))
    # every number the host needs, read at once: per flag the blocks, the partial ones and the longest lists
    n, partial, most_rows, most_cols = torch.stack([n, partial, rows.amax((1, 2, 3)), cols.amax((1, 2, 3))]).tolist()
    lists = {flag: (rows[int(flag)], cols[int(flag)]) for flag in (False, True)}  # (1, H, Mq), (1, H, Mk)
    totals = tuple(x for flag in (0, 1) for x in (n[flag], n[flag] - partial[flag], partial[flag]))
    longest = {flag: (most_rows[flag], most_cols[flag]) for flag in (False, True)}
    return LayoutSizes(totals, longest, lists)


def _pattern_counts(geo: Geometry, cand: torch.Tensor, lowest: torch.Tensor, key_tail: bool, query_tail: bool, *,
                    band=None, columns=(), rows=(), causal: bool = False) -> tuple:
    """`(row counts (2, Mq), column counts (2, Mk), partial blocks (2,))` of one head's pattern
    (`pattern_sizes`) for attention calls without and with the causal flag (first dimension): a block is live
    where the call's flag allows it (key block below `cand` with the flag), partial where it needs an element
    mask (a key or query tail; with the flag, from the row's `lowest` key block on). Both flags side by side,
    in a few dozen operators."""
    Mq, Mk = geo.num_blocks_q, geo.num_blocks_k
    is_column = _covered(columns, Mk)  # (Mk,)
    if is_column is None:
        is_column = torch.zeros(Mk, dtype=torch.bool)
    in_columns = torch.nn.functional.pad(is_column.cumsum(0), (1, 0))  # (Mk + 1,): [0, x) holds in_columns[x]
    full = _covered(rows, Mq)  # rows that hold every key block (bool (Mq,)), or None where there are none
    if band is None:
        low = high = torch.zeros(Mq, dtype=torch.int64)
    else:
        low, high = band[0].clamp(0, Mk), band[1].clamp(0, Mk)
        high = torch.maximum(high, low)

    def count(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Each row's blocks among key blocks [a, b) (int64 (..., Mq), a <= b)."""
        lo = torch.minimum(torch.maximum(low, a), b)
        hi = torch.maximum(torch.minimum(high, b), lo)
        band_only = (hi - lo) - (in_columns[hi] - in_columns[lo])
        some = in_columns[b] - in_columns[a] + band_only
        return some if full is None else torch.where(full, b - a, some)

    # each row's live key blocks [0, end), per flag
    end = torch.stack([cand if causal else torch.full((Mq,), Mk, dtype=torch.int64), cand])
    # from 0, from the diagonal on (with the flag) and the last key block, in one count
    starts = torch.stack([torch.zeros_like(end), torch.minimum(lowest, end), torch.clamp(end - 1, min=0)])
    row_counts, partial, last = count(starts, end).unbind(0)
    partial = partial * _FLAGS
    if key_tail:  # the last key block, where the row reaches it (with the flag: if the row's diagonal is not before it)
        partial += torch.where(_FLAGS.bool() & (lowest < Mk), 0, last * (end == Mk))
    if query_tail:  # every block of the last row
        partial[:, -1] = row_counts[:, -1]
    # columns: a column block counts every row that reaches it; otherwise the full rows and the band's rows
    offsets = _OFFSETS * (Mk + 1)
    bins = end + offsets  # both flags' bins in one count

    def beyond(ends: torch.Tensor, n: int) -> torch.Tensor:
        """(2, Mk): per flag, how many of the `n` rows of `ends` (bins as above) reach past key block j."""
        return n - torch.bincount(ends.flatten(), minlength=2 * (Mk + 1)).view(2, Mk + 1).cumsum(1)[:, :Mk]

    reach = beyond(bins, Mq)
    band_end = torch.maximum(torch.minimum(high, end), low)
    opened = torch.bincount(low, minlength=Mk + 1)
    if full is not None:  # a full row's band adds nothing: it reaches every column up to its end already
        band_end = torch.where(full, low, band_end)
    closed = torch.bincount((band_end + offsets).flatten(), minlength=2 * (Mk + 1)).view(2, Mk + 1)
    others = (opened - closed).cumsum(1)[:, :Mk]
    if full is not None:
        others = others + beyond(bins[:, full], int(full.sum()))
    col_counts = torch.where(is_column, reach, others)
    return row_counts, col_counts, partial.sum(1)


_FLAGS = torch.tensor([[0], [1]])  # (2, 1): the causal flag of each row of `_pattern_counts`' tables
_OFFSETS = _FLAGS  # (2, 1): each flag's first bin in units of Mk + 1 (both flags' bins in one count)
_SIGNS = torch.tensor([1, -1])  # a range's start and end marks


@one_host_thread()
def diagonal_runs(geo: Geometry, diagonals: list[int]) -> BlockRuns:
    """The blocks `(i, j)` with `i - j` in `diagonals` (distinct ints), one run of one block each, one diagonal
    after another: a few operators whatever their number (no selection by a bool tensor, a slow one)."""
    Mq, Mk = geo.num_blocks_q, geo.num_blocks_k
    firsts = [max(0, d) for d in diagonals]  # each diagonal's rows: firsts[n] to firsts[n] + lengths[n]
    lengths = [max(0, min(Mq, Mk + d) - first) for d, first in zip(diagonals, firsts)]
    total, starts = sum(lengths), list(itertools.accumulate(lengths, initial=0))
    lengths = torch.tensor(lengths, dtype=torch.int64)
    i = torch.arange(total) + torch.repeat_interleave(torch.tensor([f - s for f, s in zip(firsts, starts)],
                                                                   dtype=torch.int64), lengths, output_size=total)
    j = i - torch.repeat_interleave(torch.tensor(diagonals, dtype=torch.int64), lengths, output_size=total)
    return BlockRuns(i, j, j + 1)


def joined_runs(*parts: BlockRuns) -> BlockRuns:
    """Runs of several parts side by side (each part's runs disjoint from the others' in every row)."""
    return BlockRuns(*(torch.cat(column) for column in zip(*parts)))

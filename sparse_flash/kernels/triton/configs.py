"""Tile shapes and launch settings for the kernels.

Kernel tiles divide the mask's block size, so a tile never straddles two mask blocks; only the schedule
(tile split, warps, pipeline depth) is chosen here, per head dimension and dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class FwdConfig(NamedTuple):
    block_m: int  # query rows per program
    block_n: int  # key columns per inner step
    num_warps: int
    num_stages: int
    tma: bool = True  # stream K and V through tensor descriptors where the GPU and tensors allow (tma.py)
    maxnreg: int = 0  # registers per thread at most (0: the compiler's choice)


class BwdConfig(NamedTuple):
    kv_block_m: int  # dK/dV pass: query rows per inner step
    kv_block_n: int  # dK/dV pass: key rows per program
    q_block_m: int  # dQ pass: query rows per program
    q_block_n: int  # dQ pass: key columns per inner step
    num_warps: int
    num_stages: int
    dq_warps: int = 0  # the dQ pass's own warps and stages; 0: the same as the dK/dV pass
    dq_stages: int = 0
    tma: bool = True  # stream K, V (dQ pass) and Q, dO (dK/dV pass) through tensor descriptors (tma.py)
    maxnreg: int = 0  # the dK/dV pass's registers per thread at most (0: the compiler's choice)
    dq_maxnreg: int = 0  # the dQ pass's


MIN_TILE = 16  # tl.dot needs every dimension to be at least 16


def fit_tile(preferred: int, mask_block: int | None) -> int:
    """The largest power of two <= `preferred` that divides `mask_block` (any, for the dense path)."""
    tile = preferred
    while mask_block is not None and mask_block % tile:
        tile //= 2
    return tile


def block_d(head_dim: int) -> int:
    """Head dimension padded to a power of two (at least 16) for `tl.arange` and `tl.dot`."""
    return max(MIN_TILE, 1 << (head_dim - 1).bit_length())


LONG_CAUSAL = 16384  # from this length on, D <= 64: wide dense causal forward tiles, two-stage sparse ones
LONG_SPARSE = 16384  # from this length on, D = 128: sparse forward rows on the dense kernel's tiles


def fwd_config(head_dim: int, dtype: torch.dtype, block_q: int | None, block_k: int | None,
               causal: bool = False, seq_len_q: int = 0, long_lists: bool = False) -> FwdConfig:
    """Forward tiles for one problem; `block_q`/`block_k` are the mask's (None for the dense path).

    Measured on an H200 (bf16; docs/tuning-log.md): the dense non-causal path wants the largest tiles;
    sparse rows (short, uneven lists) 64 x 64 at D = 128, and at D = 64 64 x 128 with 4 warps and a
    shallow pipeline (3-8% over 128 x 64 with 8 warps: small programs, three or four of them per SM; one
    stage below 16,384 tokens, 3-7% over two at 4,096). Dense causal: 128 x 128 at D = 128 (3% over
    64 x 64 at 16,384 tokens), and at D = 64 from 16,384 tokens on, 64 x 64 below. At D = 64 the dense
    128 x 128 programs of 8 warps are held to 128 registers, so that two fit on an SM: 5-7% faster than
    128 x 64 tiles without the cap, and 6-10% when causal at 65,536 tokens (tuning log, step 33). K and V stream
    through TMA descriptors: 5-12% faster than pointer loads at D = 128, within -0.4% to +4% at D = 64.
    Sparse rows at D = 128 in 16-bit dtypes, with mask blocks of 128 or more, take the dense 128 x 128
    tiles when their lists are long (16 blocks or more on average, `BlockMask.has_long_lists`) or the
    queries number 16,384 or more: those tiles walk each block at the dense kernel's rate (14.5-14.9 ns per
    128 x 128 block against 16.3-16.9 for 64 x 64 at 16,384 tokens) for about 20 us more per call; 9-12%
    faster at 31 blocks per row, 2-10% on the benchmark's masks at 16,384 tokens (tuning log, steps 38 and 40).
    Shorter sequences with short lists keep 64 x 64 tiles (the 4,096-token rows: -6% to +7% by mask).
    """
    d = block_d(head_dim)
    dense = block_q is None
    maxnreg = 0
    if d <= 64:
        if dense and (not causal or seq_len_q >= LONG_CAUSAL):
            m, n, warps, stages, maxnreg = 128, 128, 8, (2 if causal else 3), 128
        elif not dense:  # sparse: one key tile per 128-wide mask block, shallow pipeline
            m, n, warps, stages = 64, 128, 4, (1 if seq_len_q < LONG_CAUSAL else 2)
        else:
            m, n, warps, stages = 64, 64, 4, 3
    elif d <= 128:
        wide = dense or ((long_lists or seq_len_q >= LONG_SPARSE) and dtype != torch.float32
                         and block_q % 128 == 0 and block_k % 128 == 0)
        m, n, warps, stages = (128, 128, 8, 3) if wide else (64, 64, 4, 3)
    else:
        m, n, warps, stages = 64, 32, 4, 2
    if dtype == torch.float32:  # twice the bytes per element: smaller tiles and a shallower pipeline
        m, n, stages, maxnreg = min(m, 64), min(n, 32), 2, 0
        if d > 128:
            m = 32
    return FwdConfig(fit_tile(m, block_q), fit_tile(n, block_k), warps, stages, maxnreg=maxnreg)


def bwd_config(head_dim: int, dtype: torch.dtype, block_q: int | None, block_k: int | None,
               causal: bool = False, long_lists: bool = False) -> BwdConfig:
    """Backward tiles for one problem; `block_q`/`block_k` are the mask's (None for the dense path).

    Dense problems: 64 x 64 tiles with 4 warps won at D = 64 and 128 (three stages when causal at D = 64,
    5% at 65,536 tokens; with descriptor loads also when causal at D = 128: 11% over 128-row tiles at 4,096
    tokens, 4% at 16,384). Sparse rows run 5-10% faster with 32-row inner steps and three stages at D = 64
    (128-row dK/dV and dQ tiles when the lists are long: 8% on 10% random at 65,536). At D = 128 short lists
    take the dense 64 x 64 tiles (4-7% over 128-row tiles once heads are grouped, `schedule_heads`), long
    lists 128-row dK/dV and dQ tiles, 8 warps and three stages (H200, bf16; docs/tuning-log.md). TMA
    descriptor loads serve D = 128 (3-6% faster on sparse rows); at D = 64 pointer loads are 1-5% faster.
    """
    d = block_d(head_dim)
    dense = block_q is None
    if d <= 64 and not dense:  # sparse, small heads: thinner inner tiles, deeper pipeline
        kv_m, kv_n, q_m, q_n, warps, stages = (32, 128, 128, 32, 4, 3) if long_lists else (32, 64, 64, 32, 4, 3)
    elif d <= 64:
        kv_m, kv_n, q_m, q_n, warps, stages = 64, 64, 64, 64, 4, (3 if causal else 2)
    elif d <= 128:
        if dense or not long_lists:
            kv_m, kv_n, q_m, q_n, warps, stages = 64, 64, 64, 64, 4, 2
        else:
            kv_m, kv_n, q_m, q_n, warps, stages = 64, 128, 128, 64, 8, 3
    else:
        kv_m, kv_n, q_m, q_n, warps, stages = 16, 64, 64, 16, 4, 2
    if dtype == torch.float32:
        kv_m, kv_n, q_m, q_n, stages = min(kv_m, 32), min(kv_n, 32), min(q_m, 32), min(q_n, 32), 1
    tma = d == 128
    return BwdConfig(
        fit_tile(kv_m, block_q), fit_tile(kv_n, block_k), fit_tile(q_m, block_q), fit_tile(q_n, block_k), warps, stages,
        tma=tma,
    )


SCHEDULE_L2_BYTES = 8 << 20  # operand bytes of the heads that sparse programs work on together


def schedule_heads(bytes_per_head: int, heads: int) -> int:
    """How many (batch, head) pairs the sparse kernels schedule together (see `common.schedule`).

    `bytes_per_head` is what the programs of one (batch, head) read again and again: K and V for the
    forward and dQ passes, Q and dO for the dK/dV pass. Heads are grouped until that reaches
    SCHEDULE_L2_BYTES, so the blocks that the programs in flight share stay in L2.
    """
    return max(1, min(heads, SCHEDULE_L2_BYTES // max(bytes_per_head, 1)))

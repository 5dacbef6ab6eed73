"""The merges after the Hopper kernels' chunks of long lists (Triton kernels, launched after the Gluon ones).

- Backward (`gluon/dq.py`, `gluon/dkdv.py`): the few very long lists are cut into chunks
  (`schedule.split_long_items`); each chunk writes its share of the output tile (dQ, or dK and dV) in float32
  into a scratch slot, and `ChunkSum` adds a tile's chunks in a fixed order (the same result whatever order the
  chunks ran in) and writes the tile.
- Forward (`gluon/fwd.py`): the chunks of the lists that the mask's work plan splits write their partial
  outputs and log-sum-exps to scratch; `merge_split_rows` combines them by log-sum-exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import BoundLaunch
from ..memory import new_output
from ..triton.split import MERGE_ROWS, store_chunk_merge

ROWS = 16  # rows of a tile per program: a cut list's tile spreads over TILE / ROWS programs


@triton.jit
def _sum_chunks(Out, Part, Merges, HEAD_D: tl.constexpr, TILE: tl.constexpr, ROWS: tl.constexpr):
    """Program p: rows [r, r + ROWS) of merge record p // (TILE / ROWS), r = (p % (TILE / ROWS)) * ROWS.
    A record is (first output row, first scratch slot, chunks); slot s holds rows [s * TILE, (s + 1) * TILE)
    of Part."""
    PARTS: tl.constexpr = TILE // ROWS
    rec = Merges + (tl.program_id(0) // PARTS) * 3
    rows = (tl.program_id(0) % PARTS) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    cols = tl.arange(0, HEAD_D)  # (HEAD_D,)
    out_row, first, chunks = tl.load(rec), tl.load(rec + 1), tl.load(rec + 2)
    acc = tl.zeros((ROWS, HEAD_D), tl.float32)  # (ROWS, HEAD_D)
    for c in range(chunks):
        part_rows = ((first + c) * TILE + rows).to(tl.int64)
        acc += tl.load(Part + part_rows[:, None] * HEAD_D + cols[None, :])
    out_rows = (out_row + rows).to(tl.int64)
    tl.store(Out + out_rows[:, None] * HEAD_D + cols[None, :], acc.to(Out.dtype.element_ty))


class ChunkSum:
    """The merge launch of one call signature: `merges` int32 `(records, 3)` from `split_long_items`, tiles
    of `tile` rows of `head_dim` columns."""

    def __init__(self, merges: torch.Tensor, tile: int, head_dim: int):
        self.slots = int(merges[:, 2].sum()) if merges.shape[0] else 0
        self.shape = (max(self.slots, 1), tile, head_dim)
        self.launch = BoundLaunch(_sum_chunks, merges.shape[0] * (tile // ROWS), (merges, ),
                                  dict(HEAD_D=head_dim, TILE=tile, ROWS=ROWS), 4, 1) if self.slots else None

    def scratch(self, device) -> torch.Tensor:
        """float32 `(slots, tile, head_dim)` for the chunks to write into (one row block if none)."""
        return new_output(self.shape, torch.float32, device)

    def __call__(self, out: torch.Tensor, part: torch.Tensor) -> None:
        """Add the chunks in `part` into their tiles of `out` (contiguous, rows of head_dim)."""
        if self.launch is not None:
            self.launch(out, part)


@triton.jit
def _merge_split_rows_kernel(Out, Lse, Part, LsePart, RowMerges, copies, HEAD_D: tl.constexpr, MASK_BLOCK_Q: tl.constexpr,
                      BLOCK_M: tl.constexpr):
    """Program (i, j): rows [j * MERGE_ROWS, (j + 1) * MERGE_ROWS) of merge record i's tile of a split list,
    its chunks combined by their log-sum-exp into Out and Lse (`split.store_chunk_merge`). One program per
    record took 32 us at 16,384 tokens (16 programs walking 128 rows each); this grid spreads the rows."""
    rec = RowMerges + tl.program_id(0) * 5
    part = tl.program_id(1)  # which MERGE_ROWS rows of the record's BLOCK_M
    out_row = tl.load(rec) + part * MERGE_ROWS
    first, num_chunks, copy, tile = tl.load(rec + 1), tl.load(rec + 2), tl.load(rec + 3), tl.load(rec + 4)
    rows_tile = tile * (BLOCK_M // MERGE_ROWS) + part  # the same rows, counted in MERGE_ROWS-row tiles
    store_chunk_merge(Out + out_row.to(tl.int64) * HEAD_D, HEAD_D, Lse + out_row, 0, MERGE_ROWS, Part, LsePart, first,
                      num_chunks, copies, copy, rows_tile, MASK_BLOCK_Q, MERGE_ROWS, HEAD_D, HEAD_D)


def merge_split_rows(out, lse, part, lse_part, merges, copies: int, mask_block_q: int, block: int) -> None:
    """Combine the chunks of the split lists into `out` and `lse`: `merges` int32 `(records, 5)` from
    `schedule.split_row_items`; `part`/`lse_part` the scratch the chunks wrote (`SplitPlan.scratch`)."""
    grid = (merges.shape[0], block // MERGE_ROWS.value)
    _merge_split_rows_kernel[grid](out, lse, part, lse_part, merges, copies, HEAD_D=out.shape[-1],
                                   MASK_BLOCK_Q=mask_block_q, BLOCK_M=block)

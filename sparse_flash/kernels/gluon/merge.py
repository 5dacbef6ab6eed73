"""The merges after the Hopper kernels' chunks of long lists (Triton kernels, launched after the Gluon ones).

The mask's work plan (`mask_index.WorkPlan`) cuts the few very long lists into chunks, each an item of its own
(`schedule.split_items`), as for the Triton kernels; what differs is the merge:
- Backward (`gluon/dq.py`, `gluon/dkdv.py`): each chunk writes its share of the output tile (dQ, or dK and dV)
  in float32 into a scratch tile, and `ChunkSum` adds a tile's chunks in chunk order (the same result
  whatever order the chunks ran in) and writes the tile.
- Forward (`gluon/fwd.py`): the chunks write their partial outputs and log-sum-exps to scratch;
  `merge_split_rows` combines them by log-sum-exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import BoundLaunch
from ..memory import new_output
from ..triton.split import MERGE_ROWS, SplitPlan, placeholder, store_chunk_merge

ROWS = 16  # rows of a tile per program: a cut list's tile spreads over TILE / ROWS programs


@triton.jit
def _sum_chunks(Out, Part, Merges, HEAD_D: tl.constexpr, TILE: tl.constexpr, ROWS: tl.constexpr):
    """Program p: rows [r, r + ROWS) of merge record p // (TILE / ROWS), r = (p % (TILE / ROWS)) * ROWS.
    A record is (first output row, first scratch tile, chunks, stride): chunk c's share lies in scratch tile
    `first + c * stride`, rows [t * TILE, (t + 1) * TILE) of Part."""
    PARTS: tl.constexpr = TILE // ROWS
    rec = Merges + (tl.program_id(0) // PARTS) * 4
    rows = (tl.program_id(0) % PARTS) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    cols = tl.arange(0, HEAD_D)  # (HEAD_D,)
    out_row, first, chunks, stride = tl.load(rec), tl.load(rec + 1), tl.load(rec + 2), tl.load(rec + 3)
    acc = tl.zeros((ROWS, HEAD_D), tl.float32)  # (ROWS, HEAD_D)
    for c in range(chunks):
        part_rows = ((first + c * stride) * TILE + rows).to(tl.int64)
        acc += tl.load(Part + part_rows[:, None] * HEAD_D + cols[None, :])
    out_rows = (out_row + rows).to(tl.int64)
    tl.store(Out + out_rows[:, None] * HEAD_D + cols[None, :], acc.to(Out.dtype.element_ty))


class ChunkSum:
    """The merge launch of one call signature, for items of `tile` rows of `head_dim` columns.

    Args:
        merges: int32 `(records, 5)` from `schedule.split_items` (first output row, first chunk slot, chunks,
            copy, tile within its mask block), or None where nothing is split.
        split: the `split.SplitPlan` of the launch's lists (its copies, mask block and scratch rows).

    The items' scratch field counts `tile`-row scratch tiles (`split_items(..., unit=tile)`): chunk c of a
    record's tile is scratch tile `((slot + c) * copies + copy) * sub + t`, `sub = mask block / tile`.
    """

    def __init__(self, merges: torch.Tensor | None, split: SplitPlan, tile: int, head_dim: int):
        self.slots = split.rows // tile if merges is not None else 0
        self.shape = (max(self.slots, 1), tile, head_dim)
        self.launch = None
        if self.slots:
            sub = split.mask_block // tile
            m = merges.long()
            records = torch.stack([m[:, 0], (m[:, 1] * split.copies + m[:, 3]) * sub + m[:, 4], m[:, 2],
                                   torch.full_like(m[:, 0], split.copies * sub)], 1).to(torch.int32).contiguous()
            self.launch = BoundLaunch(_sum_chunks, records.shape[0] * (tile // ROWS), (records, ),
                                      dict(HEAD_D=head_dim, TILE=tile, ROWS=ROWS), 4, 1)

    def scratch(self, device) -> torch.Tensor:
        """float32 `(slots, tile, head_dim)` for the chunks to write into; where nothing is split, a placeholder
        that no item writes (their scratch slot is -1), and no allocation."""
        if not self.slots:
            return placeholder(device, torch.float32)
        return new_output(self.shape, torch.float32, device)

    def __call__(self, out: torch.Tensor, part: torch.Tensor) -> None:
        """Add the chunks in `part` into their tiles of `out` (contiguous, rows of head_dim)."""
        if self.launch is not None:
            self.launch(out, part)


@triton.jit
def _merge_split_rows_kernel(Out, Lse, Part, LsePart, RowMerges, copies, HEAD_D: tl.constexpr,
                             MASK_BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program p: rows [j * MERGE_ROWS, (j + 1) * MERGE_ROWS) of merge record i's tile of a split list
    (i, j = divmod(p, BLOCK_M / MERGE_ROWS)), its chunks combined by their log-sum-exp into Out and Lse
    (`split.store_chunk_merge`). One program per record took 32 us at 16,384 tokens (16 programs walking 128
    rows each); this grid spreads the rows."""
    PARTS: tl.constexpr = BLOCK_M // MERGE_ROWS
    rec = RowMerges + (tl.program_id(0) // PARTS) * 5
    part = tl.program_id(0) % PARTS  # which MERGE_ROWS rows of the record's BLOCK_M
    out_row = tl.load(rec) + part * MERGE_ROWS
    first, num_chunks, copy, tile = tl.load(rec + 1), tl.load(rec + 2), tl.load(rec + 3), tl.load(rec + 4)
    rows_tile = tile * PARTS + part  # the same rows, counted in MERGE_ROWS-row tiles
    store_chunk_merge(Out + out_row.to(tl.int64) * HEAD_D, HEAD_D, Lse + out_row, 0, MERGE_ROWS, Part, LsePart, first,
                      num_chunks, copies, copy, rows_tile, MASK_BLOCK_Q, MERGE_ROWS, HEAD_D, HEAD_D)


class RowMerge:
    """The forward's merge launch of one call signature (bound once: a few microseconds of host time per call
    where `kernel[grid](...)` took tens).

    Args:
        merges: int32 `(records, 5)` from `schedule.split_items` (first output row, first chunk slot, chunks,
            copy, tile within its mask block); no records: calls do nothing.
        copies: the `SplitPlan`'s copies; mask_block_q: the mask's query block; block: rows per item tile;
        head_dim: D of the output.
    """

    def __init__(self, merges: torch.Tensor, copies: int, mask_block_q: int, block: int, head_dim: int):
        self.launch = None
        if merges.shape[0]:
            self.launch = BoundLaunch(_merge_split_rows_kernel, merges.shape[0] * (block // MERGE_ROWS.value),
                                      (merges, copies), dict(HEAD_D=head_dim, MASK_BLOCK_Q=mask_block_q,
                                                              BLOCK_M=block), 4, 3)

    def __call__(self, out, lse, part, lse_part) -> None:
        """Combine the chunks in `part`/`lse_part` (`SplitPlan.scratch`) into `out` and `lse` (contiguous)."""
        if self.launch is not None:
            self.launch(out, lse, part, lse_part)


def merge_split_rows(out, lse, part, lse_part, merges, copies: int, mask_block_q: int, block: int) -> None:
    """`RowMerge(merges, ...)(out, lse, part, lse_part)` for one call."""
    RowMerge(merges, copies, mask_block_q, block, out.shape[-1])(out, lse, part, lse_part)

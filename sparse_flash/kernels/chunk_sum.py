"""Sum of the chunks of cut lists: the Hopper backward kernels (`dq_hopper.py`, `bwd_hopper.py`) cut the few
very long lists into chunks (`hopper.split_long_items`); each chunk writes its share of the output tile
(dQ, or dK and dV) in float32 into a scratch slot, and this launch adds a tile's chunks in a fixed order
(the same result whatever order the chunks ran in) and writes the tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import BoundLaunch

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
        return torch.empty(self.shape, dtype=torch.float32, device=device)

    def __call__(self, out: torch.Tensor, part: torch.Tensor) -> None:
        """Add the chunks in `part` into their tiles of `out` (contiguous, rows of head_dim)."""
        if self.launch is not None:
            self.launch(out, part)

"""Host-side work of the Hopper (Gluon) kernels (`kernels/schedule.py`, torch only) and the Triton merges
that follow them (`kernels/gluon/merge.py`, under the interpreter): the items each kernel walks, the order
they start in, the chunks of long lists, their placement on resident programs, and the merges of chunks."""

import gc
import os
import weakref
from unittest import mock

import pytest
import torch

from sparse_flash import BlockMask, mask_index, masks
from sparse_flash.kernels import schedule, settings


def test_work_items_cover_every_tile_once_heavy_lists_first():
    """Records (first Q row, first K/V row, list start, list end) for GQA and a per-head mask of 256-token
    blocks: every (batch, head, 128-row tile) once, with its head's K/V rows and its mask row's list."""
    B, Hq, Hkv, N = 2, 4, 2, 4096
    mask = masks.random(N, 256, density=0.05, seed=1, num_heads=Hq) | masks.global_(N, 256)
    index = mask.kernel_index(False)
    offsets = index.row_full.offsets
    items = schedule.row_items(B, Hq, Hkv, N, N, False, index, mask.kernel_geometry(False), "cpu")
    assert items.dtype == torch.int32 and items.shape == (B * Hq * N // 128, 6)
    seen = set()
    for q_row, kv_row, lo, hi, plo, phi in items.tolist():
        bh, start = divmod(q_row, N)
        b, h = divmod(bh, Hq)
        assert start % 128 == 0 and kv_row == (b * Hkv + h // 2) * N
        r = h * (N // 256) + start // 256  # mask row: one batch entry, per-head layouts
        assert (lo, hi) == (int(offsets[r]), int(offsets[r + 1])) and plo == phi  # no partial blocks
        seen.add((b, h, start))
    assert len(seen) == items.shape[0]
    length = (items[:, 3] - items[:, 2]).float()
    heavy = length > mask_index.HEAVY_FACTOR * length.mean()
    assert heavy.any() and not (heavy[1:] & ~heavy[:-1]).any()  # heavy items come first


def test_dense_items_walk_every_key_tile():
    items = schedule.row_items(1, 2, 2, 512, 768, False, None, None, "cpu")
    assert items[:, 2].eq(0).all() and items[:, 3].eq(768 // 128).all() and items[:, 4].eq(items[:, 5]).all()


@pytest.mark.parametrize("Nq, Nk, balance", [(1024, 1024, True), (1024, 512, True), (1024, 1024, False),
                                              (4096 + 128, 4096 + 128, True)])
def test_dense_causal_items_end_on_the_diagonal_in_head_order_or_longest_first(Nq, Nk, balance):
    """Query tile i: key tiles [0, i) full and tile i on the diagonal (none past the keys' end). Items start
    in (batch, head) and tile order where the programs are balanced by load and the heads hold at most
    HEAD_ORDER_TOKENS tokens, else longest first (`longest_first`)."""
    with settings.override(hopper_balance=balance):
        items = schedule.row_items(1, 2, 2, Nq, Nk, True, None, None, "cpu")
    key_tiles = Nk // 128
    for q_row, kv_row, lo, hi, plo, phi in items.tolist():
        i = (q_row % Nq) // 128
        assert (lo, hi, plo, phi) == (0, min(i, key_tiles), min(i, key_tiles), min(i + 1, key_tiles))
    length = items[:, 3] - items[:, 2] + items[:, 5] - items[:, 4]
    if balance and max(Nq, Nk) <= schedule.HEAD_ORDER_TOKENS:
        assert (items[1:, 0] > items[:-1, 0]).all()  # by (batch, head), then query tile
    else:
        assert (length[:-1] >= length[1:]).all() and not (items[1:, 0] > items[:-1, 0]).all()


def test_sparse_causal_items_take_the_full_and_partial_lists():
    N = 2048
    mask = masks.butterfly(N, 256)
    index = mask.kernel_index(True)
    items = schedule.row_items(1, 2, 1, N, N, True, index, mask.kernel_geometry(True), "cpu")
    full_off, part_off = index.row_full.offsets, index.row_partial.offsets
    assert int(part_off[-1]) > 0  # diagonal blocks
    for q_row, kv_row, lo, hi, plo, phi in items.tolist():
        r = (q_row % N) // 256
        assert (lo, hi, plo, phi) == (int(full_off[r]), int(full_off[r + 1]), int(part_off[r]), int(part_off[r + 1]))


def _split_mask(monkeypatch, num_heads=None):
    """BigBird at 2,048 tokens in 256-token blocks (one layout, or one per head), with the work plans patched
    to cut every list longer than 2 blocks into at most 3 chunks."""
    monkeypatch.setattr(mask_index, "SPLIT_MIN_CHUNK", 2)
    monkeypatch.setattr(mask_index, "SPLIT_FACTOR", 0)
    monkeypatch.setattr(mask_index, "SPLIT_MAX_CHUNKS", 3)
    return masks.bigbird(2048, 256, seed=0, num_heads=num_heads)


def _split_call(along, causal, monkeypatch, B=2, Hq=4, Hkv=2, unit=1, num_heads=None):
    """`split_items` of `_split_mask` (B, Hq, Hkv, 2,048 tokens, 128-row tiles), its index, plan and
    `SplitPlan`."""
    from sparse_flash.kernels.triton.split import SplitPlan

    mask, N = _split_mask(monkeypatch, num_heads), 2048
    index, geometry = mask.kernel_index(causal), mask.kernel_geometry(causal)
    plan = index.row_plan if along == "rows" else index.col_plan
    assert plan.split.shape[0] > 0
    split = SplitPlan(torch.device("cpu"), plan, B, Hq if along == "rows" else Hkv, geometry, 128, along=along)
    items, merges = schedule.split_items(along, B, Hq, Hkv, N, N, index, geometry, split.copy_strides,
                                         split.copies, "cpu", 128, unit)
    return items, merges, index, split


@pytest.mark.parametrize("along", ["rows", "cols"])
@pytest.mark.parametrize("causal", [False, True])
def test_split_items_cover_each_list_once_in_chunks_with_their_own_scratch(along, causal, monkeypatch):
    """A mask whose work plan cuts lists into chunks (`schedule.split_items`, the one cutting policy of both
    kernel families): each chunk is an item of its own whose ranges, together, walk its tile's full and
    partial lists once; chunks of one tile write distinct scratch rows inside the split plan's scratch;
    unsplit tiles write their output rows; one merge record per split tile and copy names its first slot and
    number of chunks. Rows: 128-row query tiles of each (batch, query head) on row lists; columns: 128-key
    tiles of each (batch, KV head) on column lists, with the first query row of the head's group."""
    B, Hq, Hkv, N, block = 2, 4, 2, 2048, 256
    items, merges, index, split = _split_call(along, causal, monkeypatch, B, Hq, Hkv)
    assert items.shape[1] == 8
    full, part = (index.row_full, index.row_partial) if along == "rows" else (index.col_full, index.col_partial)
    full_off, part_off = full.offsets, part.offsets
    H = Hq if along == "rows" else Hkv
    walked = {}  # own row -> full and partial positions walked, chunks
    scratch_rows, tile_scratch = [], {}
    for own_row, other_row, lo, hi, plo, phi, scratch, _ in items.tolist():
        bh, start = divmod(own_row, N)
        b, h = divmod(bh, H)
        assert other_row == ((b * Hkv + h // 2) * N if along == "rows" else (b * Hq + h * 2) * N)
        seen = walked.setdefault(own_row, [set(), set(), 0])
        assert not seen[0] & set(range(lo, hi)) and not seen[1] & set(range(plo, phi))
        seen[0] |= set(range(lo, hi))
        seen[1] |= set(range(plo, phi))
        seen[2] += 1
        if scratch >= 0:
            scratch_rows.append(scratch)
            tile_scratch.setdefault(own_row, set()).add(scratch)
            assert 0 <= scratch and scratch + 128 <= split.rows
    assert len(walked) == B * H * N // 128  # every (batch, head, 128-row tile)
    for own_row, (f, p, chunks) in walked.items():
        r = (own_row % N) // block
        assert f == set(range(int(full_off[r]), int(full_off[r + 1])))
        assert p == set(range(int(part_off[r]), int(part_off[r + 1])))
    assert len(set(scratch_rows)) == len(scratch_rows)  # no two chunks share scratch
    split_tiles = {q for q, (_, _, n) in walked.items() if n > 1}
    assert split_tiles and sorted(merges[:, 0].tolist()) == sorted(split_tiles)
    for own_row, first, num_chunks, copy, tile in merges.tolist():
        assert num_chunks == walked[own_row][2] and first >= 0 and tile == (own_row % N) % block // 128
        # the rows `split.store_chunk_merge` reads are the ones the tile's chunks write
        reads = {((first + c) * split.copies + copy) * block + tile * 128 for c in range(num_chunks)}
        assert reads == tile_scratch[own_row]
    assert (items[:, 6] >= 0).int().diff().le(0).all()  # chunks first


@pytest.mark.parametrize("along", ["rows", "cols"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
def test_the_backward_sums_each_tiles_chunks_in_chunk_order(along, causal, per_head, monkeypatch):
    """The Hopper backward's split items (`split_items(..., unit=128)`: scratch in 128-row tiles) and
    `merge.ChunkSum` (under the interpreter): a kernel stand-in writes, for every item, a tile holding its
    walked list entries, to its output rows or, for a chunk, to its scratch tile; after the merge every
    output tile holds the sum over its whole lists, as an unsplit walk gives. A mask shared by the heads
    (GQA: copies per batch and head) or one per head (copies per batch)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton on the CPU under TRITON_INTERPRET=1")
    from sparse_flash.kernels.gluon import merge

    B, Hq, Hkv, N, D, M = 2, 4, (4 if per_head else 2), 2048, 16, 2048 // 256
    items, merges, index, split = _split_call(along, causal, monkeypatch, B, Hq, Hkv, unit=128,
                                              num_heads=Hq if per_head else None)
    full, part = (index.row_full, index.row_partial) if along == "rows" else (index.col_full, index.col_partial)
    chunk_sum = merge.ChunkSum(merges, split, 128, D)
    H = Hq if along == "rows" else Hkv
    assert chunk_sum.slots == split.rows // 128 > 0
    gen = torch.Generator().manual_seed(1)
    weights = torch.randn(full.indices.numel() + part.indices.numel(), 128, D, generator=gen)

    def walk(lo, hi, plo, phi):  # what a kernel adds up: one term per list entry
        terms = list(range(lo, hi)) + [full.indices.numel() + j for j in range(plo, phi)]
        return weights[terms].sum(0) if terms else torch.zeros(128, D)

    out = torch.full((B * H * N, D), float("nan"))
    scratch = chunk_sum.scratch("cpu")
    for own_row, _, lo, hi, plo, phi, tile, _ in items.tolist():
        if tile < 0:
            out[own_row:own_row + 128] = walk(lo, hi, plo, phi)
        else:
            scratch[tile] = walk(lo, hi, plo, phi)
    chunk_sum(out, scratch.view(-1, D))
    assert not out.isnan().any()
    for own_row in range(0, B * H * N, 128):
        h = own_row // N % H
        lst = (h if per_head else 0) * M + (own_row % N) // 256  # the mask's list of this tile
        want = walk(int(full.offsets[lst]), int(full.offsets[lst + 1]), int(part.offsets[lst]),
                    int(part.offsets[lst + 1]))
        torch.testing.assert_close(out[own_row:own_row + 128], want, rtol=1e-5, atol=1e-4)


def _tiles(items, sub=1):
    return (items[:, 3] - items[:, 2] + items[:, 5] - items[:, 4]).long() * sub


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("programs", [7, 132])
def test_programs_take_each_item_once_with_balanced_loads(causal, programs):
    """`schedule.assign_programs`: every item exactly once, each program's items in their order in the item list
    (heavy lists first), and the most loaded program within one run's cost of the mean load (a run: the
    consecutive items placed together), where item i on program i % programs can be far above it."""
    B, Hq, N = 2, 4, 4096
    mask = masks.random(N, 128, density=0.08, seed=3, num_heads=Hq) | masks.global_(N, 128)
    items = schedule.row_items(B, Hq, Hq, N, N, causal, mask.kernel_index(causal), mask.kernel_geometry(causal),
                               "cpu")
    placed, starts = schedule.assign_programs(items, programs, 1)
    assert starts.dtype == torch.int32 and starts.shape == (programs + 1, ) and starts[0] == 0
    assert starts[-1] == items.shape[0] and (starts[1:] >= starts[:-1]).all()
    position = {tuple(r): i for i, r in enumerate(items.tolist())}
    assert sorted(position[tuple(r)] for r in placed.tolist()) == list(range(items.shape[0]))
    cost = _tiles(placed) + schedule.ITEM_COST
    loads = torch.stack([cost[starts[p]:starts[p + 1]].sum() for p in range(programs)]).double()
    for p in range(programs):  # each program's items keep the list's order
        mine = [position[tuple(r)] for r in placed[starts[p]:starts[p + 1]].tolist()]
        assert mine == sorted(mine)
    run = -(-items.shape[0] // (schedule.BUNDLES_PER_PROGRAM * programs))  # items per run placed
    assert loads.max() <= loads.mean() + run * cost.max()
    if run == 1:  # single items placed: never worse than taking them in turn
        static = torch.stack([(_tiles(items) + schedule.ITEM_COST)[p::programs].sum() for p in range(programs)])
        assert loads.max() <= static.max()


def test_programs_split_lists_weighted_by_their_key_tiles():
    """Lists count mask blocks of SUB key tiles each; with balancing off, item i goes to program i % P."""
    items = torch.tensor([[0, 0, 0, n, 0, 0] for n in (8, 1, 1, 1, 1, 1)], dtype=torch.int32)
    placed, starts = schedule.assign_programs(items, 2, 2)
    assert starts.tolist() == [0, 1, 6]  # 8 blocks x 2 tiles + 1 against 5 x (2 + 1)
    with settings.override(hopper_balance=False):
        placed, starts = schedule.assign_programs(items, 2, 2)
    assert starts.tolist() == [0, 3, 6] and placed[:3, 3].tolist() == [8, 1, 1]

def test_merge_combines_the_chunks_of_each_split_tile_by_their_log_sum_exp():
    """`merge.merge_split_rows` (a Triton kernel; under the interpreter on the CPU): for each merge record, the
    chunks' normalised outputs in the scratch rows, weighted by exp(lse_chunk - lse), into Out and Lse;
    a row empty in some chunks takes the others, a row empty in all gets 0 and -inf. Outputs NaN-poisoned."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or the Triton interpreter")
    from sparse_flash.kernels.gluon.merge import merge_split_rows

    device = "cuda" if torch.cuda.is_available() else "cpu"
    D, block_q, copies, slots = 128, 256, 3, 5
    gen = torch.Generator().manual_seed(0)
    part = torch.randn(slots * copies * block_q, D, generator=gen)
    lse_part = torch.randn(slots * copies * block_q, generator=gen) * 3
    lse_part[7::11] = float("-inf")  # rows empty in some chunks
    records = [(0, 0, 3, 1, 0), (128, 0, 3, 1, 1), (512, 3, 2, 2, 1)]  # (out row, first slot, chunks, copy, tile)
    for slot in range(slots):  # row 5 of record 0's tile: empty in every chunk
        lse_part[(slot * copies + 1) * block_q + 5] = float("-inf")
    out = torch.full((1024, D), float("nan"), dtype=torch.float16)
    lse = torch.full((1024, ), float("nan"))
    merges = torch.tensor(records, dtype=torch.int32)
    args = [t.to(device) for t in (out, lse, part, lse_part, merges)]
    merge_split_rows(*args, copies, block_q, 128)
    out, lse = args[0].cpu().float(), args[1].cpu()
    for out_row, first, chunks, copy, tile in records:
        rows = [((first + c) * copies + copy) * block_q + tile * 128 + torch.arange(128) for c in range(chunks)]
        lses = torch.stack([lse_part[r] for r in rows])  # (chunks, 128)
        want_lse = torch.logsumexp(lses, 0)
        weights = torch.exp(lses - want_lse.clamp(min=-1e30)).nan_to_num(0.0)  # (chunks, 128)
        want = (weights[:, :, None] * torch.stack([part[r] for r in rows])).sum(0)
        got_rows = slice(out_row, out_row + 128)
        torch.testing.assert_close(lse[got_rows], want_lse)
        torch.testing.assert_close(out[got_rows], want, atol=2e-3, rtol=2e-3)
    assert lse[5] == float("-inf") and out[5].eq(0).all()
    written = torch.zeros(1024, dtype=torch.bool)
    for out_row, *_ in records:
        written[out_row:out_row + 128] = True
    assert out[~written].isnan().all() and not out[written].isnan().any()

def _query_tile_kinds(allowed, key_tile):
    """For each 64-row query tile: 'full' (every query sees every key of the 128-key tile), 'partial' (some)
    or None, from a dense (Nq, Nk) boolean of allowed pairs."""
    keys = allowed[:, key_tile * 128:(key_tile + 1) * 128]
    kinds = []
    for m in range(allowed.shape[0] // 64):
        tile = keys[m * 64:(m + 1) * 64]
        kinds.append("full" if tile.all() else "partial" if tile.any() else None)
    return kinds


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(512, 512), (512, 768), (768, 512)], ids=str)
def test_dense_items_walk_the_query_tiles_that_see_each_key_tile(causal, shape):
    """Dense path: one item per (batch, KV head, 128-key tile) with the right K/V and Q rows; its full list
    holds the 64-row query tiles that see every key of the tile, its partial list (the causal diagonal)
    those that see some of them (top-left aligned, key <= query, as the other kernels)."""
    Nq, Nk = shape
    B, Hq, Hkv = 2, 4, 2
    items = schedule.column_items(B, Hq, Hkv, Nq, Nk, causal, None, None, "cpu", 128, 64)
    assert items.dtype == torch.int32 and items.shape == (B * Hkv * Nk // 128, 6)
    allowed = torch.ones(Nq, Nk, dtype=torch.bool)
    if causal:
        allowed = torch.arange(Nk)[None, :] <= torch.arange(Nq)[:, None]
    seen = set()
    for kv_row, q_row0, lo, hi, plo, phi in items.tolist():
        bh, start = divmod(kv_row, Nk)
        b, hk = divmod(bh, Hkv)
        assert start % 128 == 0 and q_row0 == (b * Hq + hk * 2) * Nq
        kinds = _query_tile_kinds(allowed, start // 128)
        assert list(range(lo, hi)) == [m for m, kind in enumerate(kinds) if kind == "full"]
        assert list(range(plo, phi)) == [m for m, kind in enumerate(kinds) if kind == "partial"]
        seen.add((b, hk, start))
    assert len(seen) == items.shape[0]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sparse_items_take_each_key_blocks_column_lists(causal):
    """Sparse path: each item's ranges are its mask column's full and partial lists (per-head masks with MHA,
    256-token query blocks); walking them reaches exactly the allowed (query block, key block) pairs."""
    B, H, N = 2, 3, 1024
    mask = masks.random(N, (256, 128), density=0.3, seed=5, num_heads=H)
    index = mask.kernel_index(causal)
    items = schedule.column_items(B, H, H, N, N, causal, index, mask.kernel_geometry(causal), "cpu", 128, 64)
    layout = mask.layout.bool()[0]  # (H, Mq, Mk)
    full_idx, part_idx = index.col_full.indices.tolist(), index.col_partial.indices.tolist()
    for kv_row, q_row0, lo, hi, plo, phi in items.tolist():
        bh, start = divmod(kv_row, N)
        b, h = divmod(bh, H)
        assert q_row0 == (b * H + h) * N
        kb = start // 128
        walked = full_idx[lo:hi] + part_idx[plo:phi]
        want = [qb for qb in range(N // 256) if layout[h, qb, kb] and (not causal or qb * 256 + 255 >= kb * 128)]
        assert sorted(walked) == want
        if causal:  # partial blocks are those on the diagonal
            assert all(qb * 256 < kb * 128 + 127 for qb in part_idx[plo:phi])

def test_each_chunk_is_placed_as_a_run_of_its_own():
    """`assign_programs` places runs of consecutive items (here 8 per run); the chunks of a split list are
    consecutive, so each must be a run of its own, or they would all land on one program and cutting would
    not spread the list."""
    # 2,000 one-entry lists and the 4 chunks of two lists of 1,000 entries, on 16 programs: runs of 8 items
    one = [[128 * i, 0, i, i + 1, 0, 0, -1] for i in range(2000)]
    chunks = [[-1 - n, 0, 250 * c, 250 * (c + 1), 0, 0, 4 * n + c] for n in range(2) for c in range(4)]
    items = torch.tensor(one[:1000] + chunks[:4] + one[1000:] + chunks[4:], dtype=torch.int32)
    placed, starts = schedule.assign_programs(items, 16, 2)
    program_of_slot = {}
    for p in range(16):
        for slot in placed[starts[p]:starts[p + 1], 6].tolist():
            program_of_slot[slot] = p
    for first in (0, 4):
        assert len({program_of_slot[s] for s in range(first, first + 4)}) > 1


def test_chunk_sum_adds_the_chunks_of_each_tile_in_order():
    """`merge.ChunkSum` (under the interpreter on the CPU): each merge record's tile of the output is the
    sum of its chunks' scratch slots, rounded once; other rows are left as they were."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton on the CPU under TRITON_INTERPRET=1")
    from sparse_flash.kernels.gluon import merge

    # two split lists (plan slots 0-2 and 3-4) walked by 2 copies, mask blocks of 256 rows (2 tiles each):
    # chunk c of (slot s, copy k, tile t) lies in scratch tile ((s + c) * 2 + k) * 2 + t
    split = mock.Mock(rows=5 * 2 * 256, copies=2, mask_block=256)
    merges = torch.tensor([[256, 0, 3, 1, 1], [0, 3, 2, 0, 0]], dtype=torch.int32)
    summed = merge.ChunkSum(merges, split, 128, 128)
    assert summed.slots == 20
    part = torch.randn(summed.slots, 128, 128)
    out = torch.full((4 * 128, 128), float("nan"), dtype=torch.float16)
    summed(out, part)
    want = torch.full_like(out, float("nan"))
    want[256:384] = (part[3] + part[7] + part[11]).half()  # slots 0, 1, 2 of copy 1, tile 1
    want[0:128] = (part[12] + part[16]).half()  # slots 3, 4 of copy 0, tile 0
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("programs", [1, 2, 7, 132])
def test_dealing_runs_on_the_gpu_places_them_as_the_host_heap_does(programs):
    """`schedule.deal_runs`: the Triton kernel (under TRITON_INTERPRET=1, as on a GPU: no host
    synchronisation) gives every run the program the host's heap gives it (least loaded so far, lowest number
    among equals), on skewed, tied and a few very heavy costs, with unused runs (cost 0) after the real ones;
    and the placement
    keeps the most loaded program within one run's cost of the mean."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton on the CPU under TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(programs)
    sizes = ((1, 0), (5, 3), (150, 0), (300, 100)) + (((700, 7), ) if programs > 100 else ())  # 700: 5+ rounds
    for n, unused in sizes:
        skewed = (torch.rand(n, generator=gen) ** 4 * 400).long() + 2
        tied = torch.full((n, ), 3) + (torch.rand(n, generator=gen) < 0.1).long() * 40
        heavy = torch.full((n, ), 8) + (torch.arange(n) < max(1, n // 40)).long() * 120  # a few global rows
        for costs in (skewed, tied, heavy):
            costs = torch.cat([torch.sort(costs, descending=True).values, torch.zeros(unused, dtype=torch.long)])
            on_gpu = schedule.deal_runs(costs, programs)
            with mock.patch.object(schedule.settings, "interpreting", lambda: False):
                on_host = schedule.deal_runs(costs, programs)
            used = costs > 0
            assert torch.equal(on_gpu[used], on_host[used]), (n, programs)
            assert ((on_gpu >= 0) & (on_gpu < programs)).all()
            loads = torch.zeros(programs, dtype=torch.long).index_add_(0, on_gpu, costs)
            assert loads.max() <= costs.sum() / programs + costs.max()


def _plan_on_host(along, B, Hq, Hkv, N, causal, index, geometry, programs, sub, balance):
    """`whole_plan`'s torch operators (the host's deal of runs)."""
    with settings.override(hopper_balance=balance, gpu_index=False), \
            mock.patch.object(schedule.settings, "interpreting", lambda: False):
        return schedule.whole_plan(along, B, Hq, Hkv, N, N, causal, index, geometry, "cpu", programs, sub, 128, 64)


@pytest.mark.parametrize("along, B, Hq, Hkv, blocks, block, programs, causal, balance", [
    ("rows", 1, 2, 2, 8, 128, 3, True, True), ("rows", 2, 4, 2, 6, 128, 5, False, True),
    ("cols", 1, 2, 1, 12, 256, 7, False, True), ("cols", 1, 3, 3, 10, 128, 4, True, True),
    ("rows", 2, 2, 2, 9, 128, 4, False, False), ("rows", 1, 1, 1, 4, 128, 8, True, True),
    ("rows", 1, 4, 4, 16, 128, 6, False, True),
    # more items than one program ranks, and than one chunk it counts against
    ("rows", 2, 4, 4, 24, 128, 9, True, True), ("cols", 2, 4, 2, 40, 128, 5, False, True),
    ("rows", 2, 4, 4, 24, 128, 7, True, False), ("cols", 2, 2, 2, 40, 256, 11, False, False),
    # causal calls past HEAD_ORDER_TOKENS start longest first, balanced too
    ("rows", 1, 2, 2, 40, 128, 5, True, True), ("cols", 1, 2, 1, 20, 256, 6, True, True)])
def test_triton_launches_order_and_place_items_as_the_torch_operators_do(along, B, Hq, Hkv, blocks, block, programs,
                                                                         causal, balance):
    """`schedule.placed_items` (Triton launches, under TRITON_INTERPRET=1 as on a GPU) gives exactly the
    records and starts of `whole_items(row_items / column_items)` then `assign_programs`: random lists with a
    global row and column (heavy lists), GQA, mask blocks of 128 and 256, causal or not, balanced or in turn,
    up to 320 items (several ranking programs, several chunks each)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton on the CPU under TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(blocks * programs)
    layout = torch.rand(B, 1 if Hq != Hkv else Hq, blocks, blocks, generator=gen) < 0.3
    layout[..., 0] = True
    layout[..., 2, :] = True  # a global row too: heavy lists on both sides, between light ones
    mask = BlockMask.from_layout(layout, block)
    N = blocks * block
    index, geometry = mask._records(causal)
    side = (index.row_full, index.row_partial) if along == "rows" else (index.col_full, index.col_partial)
    sub = block // 128 if along == "rows" else (block // 64) * (Hq // Hkv)
    want, want_starts = _plan_on_host(along, B, Hq, Hkv, N, causal, index, geometry, programs, sub, balance)
    with settings.override(hopper_balance=balance):
        got, got_starts = schedule.placed_items(along, B, Hq, Hkv, N, N, causal, *side, geometry, programs, sub)
    assert torch.equal(got, want) and torch.equal(got_starts, want_starts)


def test_placed_items_are_kept_while_the_masks_lists_live():
    """The forward and the dQ pass place the same row items of a mask: the second call takes the first's
    records (no launch); another number of programs or balancing setting places anew; the kept records go
    with the mask."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton on the CPU under TRITON_INTERPRET=1")
    N = 6 * 128
    mask = masks.random(N, 128, density=0.5, seed=3) | masks.local(N, 128, window=0)
    index, geometry = mask._records(True)

    def place(programs):
        return schedule.placed_items("rows", 1, 2, 2, N, N, True, index.row_full, index.row_partial, geometry,
                                     programs, 1)

    first = place(3)
    assert all(a is b for a, b in zip(place(3), first))
    assert place(4)[0] is not first[0]
    with settings.override(hopper_balance=False):
        unbalanced = place(3)
    assert unbalanced[0] is not first[0] and place(3)[0] is first[0]
    kept = weakref.ref(first[0])
    del mask, index, first, unbalanced
    gc.collect()
    assert kept() is None


def _one_pass_case(case, causal, B=2, Hq=4, Hkv=2, N=2048, programs=5, rows=64):
    """Placed one-pass items of a test case (dense or a mask; "_cross": twice as many keys as queries), their
    walks and turns, and the sizes; steps of `rows` query rows (`gluon.bwd.STEP_ROWS`: 64 at D = 128, 128 at
    D = 64)."""
    Nq, Nk = N, (2 * N if case.endswith("_cross") else N)
    mask = {"dense": None, "dense_cross": None,
            "butterfly": lambda: masks.butterfly(N, 128),
            "butterfly_cross": lambda: masks.butterfly(Nq, 128, seq_len_k=Nk),
            "local_256": lambda: masks.local(N, 256, window=2),
            "global_local": lambda: masks.local(N, 128, window=3) | masks.global_(N, 128),
            "empty_rows": lambda: masks.random(N, 128, density=0.05, seed=5)}[case]
    mask = None if mask is None else mask()
    index = None if mask is None else mask.kernel_index(causal)
    geometry = None if mask is None else mask.kernel_geometry(causal)
    block_q = rows if mask is None else geometry.block_q
    sub, G = block_q // rows, Hq // Hkv
    items = schedule.column_items(B, Hq, Hkv, Nq, Nk, causal, index, geometry, "cpu", 128, rows)
    placed, starts = schedule.assign_programs(schedule.whole_items(items), programs, sub * G)
    total = schedule.walk_tiles(B, Hkv, Nq, Nk, causal, index, geometry, sub, 128, rows)
    walked, turns, step_starts = schedule.one_pass_walks(placed, starts, Nq, Nk, G, sub, block_q, rows, index, total,
                                                         True)
    return placed, starts, walked, turns, step_starts, index, sub, G, (Nq, Nk), total


def _list_tiles(record, index, sub):
    """The query tiles (of the steps' rows, within the head) of an item's list tiles: the full list's, then the
    partial's."""
    _, _, lo, hi, plo, phi = record[:6]
    if index is None:
        return list(range(lo, hi)) + list(range(plo, phi))
    full, part = index.col_full.indices.tolist(), index.col_partial.indices.tolist()
    return ([full[e // sub] * sub + e % sub for e in range(lo * sub, hi * sub)]
            + [part[e // sub] * sub + e % sub for e in range(plo * sub, phi * sub)])


CASES = ["dense", "dense_cross", "butterfly", "butterfly_cross", "local_256", "global_local", "empty_rows"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES)
def test_walk_tiles_counts_the_items_list_tiles_from_host_sizes(case, causal):
    """`schedule.walk_tiles` (the one-pass plan's sizes without a host synchronisation) equals the list tiles
    that the column items walk, for the dense path and masks (broadcast over batch and heads, GQA, 256-token
    blocks)."""
    for B, Hq, Hkv in ((2, 4, 2), (1, 1, 1), (3, 3, 3)):
        placed, *_, index, sub, G, N, total = _one_pass_case(case, causal, B=B, Hq=Hq, Hkv=Hkv, N=1024, programs=3)
        assert total == sum(len(_list_tiles(r, index, sub)) for r in placed.tolist())
    if case != "dense":
        return
    mask = masks.random(1024, 128, density=0.3, seed=2, num_heads=3)  # one layout per head
    index, geometry = mask.kernel_index(causal), mask.kernel_geometry(causal)
    items = schedule.column_items(2, 3, 3, 1024, 1024, causal, index, geometry, "cpu", 128, 64)
    total = schedule.walk_tiles(2, 3, 1024, 1024, causal, index, geometry, 2, 128, 64)
    assert total == sum(len(_list_tiles(r, index, 2)) for r in items.tolist())


@pytest.mark.parametrize("rows", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES)
def test_one_pass_walks_start_on_the_diagonal_and_turns_cannot_deadlock(case, causal, rows):
    """`schedule.one_pass_walks`: each item's rotation is the list tile where its walk starts: the first tile
    at or past its keys (dense self-attention: the diagonal), 0 where none is. The turns of every dQ tile are
    0, 1, ..., count - 1, and a run of the kernel's protocol (a step proceeds once its tile has counted its
    turn, then counts one) finishes whatever order the programs move in: no wait can last for ever. Steps of 64
    and of 128 query rows (the kernel's at D = 128 and D = 64)."""
    placed, starts, walked, turns, step_starts, index, sub, G, (Nq, Nk), total = _one_pass_case(case, causal,
                                                                                                rows=rows)
    assert torch.equal(walked[:, :7], placed[:, :7]) and turns.dtype == torch.int32
    steps = []  # per program: (dQ tile, turn) of its steps in order
    s, t0 = starts.tolist(), step_starts.tolist()
    for p in range(len(s) - 1):
        own, t = [], t0[p]
        for rec in walked[s[p]:s[p + 1]].tolist():
            tiles, rot = _list_tiles(rec, index, sub), rec[7]
            n = len(tiles)
            key_tile = (rec[0] % Nk) * Nq // Nk // rows  # the query tile level with the item's keys
            later = [e for e in range(n) if tiles[e] >= key_tile]
            assert rot == (min(later, key=lambda e: (tiles[e], e)) if later else 0)
            for g in range(G):
                for j in range(n):
                    own.append(((rec[1] + g * Nq) // rows + tiles[(j + rot) % n], int(turns[t])))
                    t += 1
        steps.append(own)
    assert t0[-1] == sum(map(len, steps)) == total * G
    by_tile = {}
    for own in steps:
        for tile, turn in own:
            by_tile.setdefault(tile, []).append(turn)
    assert all(sorted(v) == list(range(len(v))) for v in by_tile.values())
    # The add warp's protocol (`gluon/bwd.py`): a step issues once its tile has counted its turn; the step
    # before it is counted once this one is issued, or before the program waits for a turn. Programs move in a
    # random order each round (a program whose turn has not come counts the step it holds); a round where none
    # moves is a deadlock.
    for seed in range(3):
        rng = torch.Generator().manual_seed(seed)
        count, at, held = {}, [0] * len(steps), [None] * len(steps)
        while any(at[p] < len(steps[p]) or held[p] is not None for p in range(len(steps))):
            moved = False
            for p in torch.randperm(len(steps), generator=rng).tolist():
                if at[p] == len(steps[p]) or count.get(steps[p][at[p]][0], 0) != steps[p][at[p]][1]:
                    if held[p] is not None:  # the end, or a wait: count the step held first
                        count[held[p]] = count.get(held[p], 0) + 1
                        held[p], moved = None, True
                    continue
                if held[p] is not None:
                    count[held[p]] = count.get(held[p], 0) + 1
                held[p] = steps[p][at[p]][0]
                at[p] += 1
                moved = True
            assert moved, "deadlock"


def test_dense_walks_start_each_key_tile_on_its_diagonal():
    """Dense self-attention: the item of key tile k starts at query tile 2k (rows 128k), so the items of one head
    in flight reach each dQ tile two steps apart."""
    placed, _, walked, *_ = _one_pass_case("dense", False, B=1, Hq=1, Hkv=1, N=1024, programs=8)
    assert sorted((r[0] // 128, r[7]) for r in walked.tolist()) == [(k, 2 * k) for k in range(8)]

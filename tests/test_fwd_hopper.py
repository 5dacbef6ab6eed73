"""The warp-specialised Hopper forward's host side, on the CPU: which calls it takes and the work items
it walks. Its kernel runs on sm_90 GPUs only (tests/test_gpu.py); tests/test_codegen.py compiles it."""

import os

import pytest
import torch

from sparse_flash import masks

fwd_hopper = pytest.importorskip("sparse_flash.kernels.fwd_hopper", exc_type=ImportError)
hopper = pytest.importorskip("sparse_flash.kernels.hopper", exc_type=ImportError)


def call(mask, B=1, Hq=4, Hkv=4, N=1024, D=128, causal=False):
    """shape_supported's arguments for a call with this mask (None: dense)."""
    index = [] if mask is None else mask.kernel_index(causal).rows()
    geometry = [1, 1, 1, 1, 128, 128, 0] if mask is None else [*mask.shape, *mask.block_size, 0]
    return (B, Hq, N, D), (B, Hkv, N, D), index, geometry


@pytest.mark.parametrize("mask", [None, masks.butterfly(1024, 128), masks.local(1024, 256, window=1)],
                         ids=["dense", "butterfly", "block256"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_takes_16_bit_d128_calls_with_whole_blocks(mask, dtype):
    q_shape, k_shape, index, geometry = call(mask)
    assert fwd_hopper.shape_supported(q_shape, k_shape, dtype, index, geometry)


@pytest.mark.parametrize("causal", [False, True])
def test_takes_causal_calls_dense_and_sparse(causal):
    for mask in (None, masks.butterfly(1024, 128)):
        q_shape, k_shape, index, geometry = call(mask, causal=causal)
        assert fwd_hopper.shape_supported(q_shape, k_shape, torch.bfloat16, index, geometry)


@pytest.mark.parametrize("case", ["fp32", "d64", "tail", "block64", "split_lists_switched_off"])
def test_leaves_other_calls_to_the_triton_forward(case, monkeypatch):
    mask = masks.butterfly(1024, 128)
    q_shape, k_shape, index, geometry = call(mask)
    dtype = torch.bfloat16
    if case == "fp32":
        dtype = torch.float32
    elif case == "d64":
        q_shape, k_shape, index, geometry = call(mask, D=64)
    elif case == "tail":
        mask = masks.butterfly(1000, 128)
        q_shape, k_shape, index, geometry = call(mask, N=1000)
    elif case == "block64":
        q_shape, k_shape, index, geometry = call(masks.butterfly(1024, 64))
    else:  # a global row: the work plan cuts its list into chunks, which SPLIT_LISTS=False leaves to fwd.py
        mask = masks.bigbird(16384, 128, seed=0)
        q_shape, k_shape, index, geometry = call(mask, N=16384)
        assert index[8].shape[0] > 0
        assert fwd_hopper.shape_supported(q_shape, k_shape, dtype, index, geometry)
        monkeypatch.setattr(fwd_hopper, "SPLIT_LISTS", False)
    assert not fwd_hopper.shape_supported(q_shape, k_shape, dtype, index, geometry)


def test_work_items_cover_every_tile_once_heavy_lists_first():
    """Records (first Q row, first K/V row, list start, list end) for GQA and a per-head mask of 256-token
    blocks: every (batch, head, 128-row tile) once, with its head's K/V rows and its mask row's list."""
    B, Hq, Hkv, N = 2, 4, 2, 4096
    mask = masks.random(N, 256, density=0.05, seed=1, num_heads=Hq) | masks.global_(N, 256)
    rows = mask.kernel_index(False).rows()
    offsets = rows[0]
    items = hopper.row_items(B, Hq, Hkv, N, N, False, rows, [*mask.shape, *mask.block_size, 0], "cpu")
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
    heavy = length > hopper.HEAVY_FACTOR * length.mean()
    assert heavy.any() and not (heavy[1:] & ~heavy[:-1]).any()  # heavy items come first


def test_dense_items_walk_every_key_tile():
    items = hopper.row_items(1, 2, 2, 512, 768, False, [], None, "cpu")
    assert items[:, 2].eq(0).all() and items[:, 3].eq(768 // 128).all() and items[:, 4].eq(items[:, 5]).all()


@pytest.mark.parametrize("Nk", [1024, 512])
def test_dense_causal_items_end_on_the_diagonal_longest_first(Nk):
    """Query tile i: key tiles [0, i) full and tile i on the diagonal (none past the keys' end)."""
    Nq = 1024
    items = hopper.row_items(1, 2, 2, Nq, Nk, True, [], None, "cpu")
    key_tiles = Nk // 128
    for q_row, kv_row, lo, hi, plo, phi in items.tolist():
        i = (q_row % Nq) // 128
        assert (lo, hi, plo, phi) == (0, min(i, key_tiles), min(i, key_tiles), min(i + 1, key_tiles))
    length = items[:, 3] - items[:, 2] + items[:, 5] - items[:, 4]
    assert (length[:-1] >= length[1:]).all()


def test_sparse_causal_items_take_the_full_and_partial_lists():
    N = 2048
    mask = masks.butterfly(N, 256)
    rows = mask.kernel_index(True).rows()
    items = hopper.row_items(1, 2, 1, N, N, True, rows, [*mask.shape, *mask.block_size, 0], "cpu")
    full_off, part_off = rows[0], rows[2]
    assert int(part_off[-1]) > 0  # diagonal blocks
    for q_row, kv_row, lo, hi, plo, phi in items.tolist():
        r = (q_row % N) // 256
        assert (lo, hi, plo, phi) == (int(full_off[r]), int(full_off[r + 1]), int(part_off[r]), int(part_off[r + 1]))


@pytest.mark.parametrize("causal", [False, True])
def test_split_items_cover_each_list_once_in_chunks_with_their_own_scratch(causal, monkeypatch):
    """A mask whose work plan cuts lists into chunks (`SPARSE_FLASH_HOPPER_SPLIT=1`): each chunk is an item
    of its own whose ranges, together, walk its tile's full and partial lists once; chunks of one tile write
    distinct scratch rows inside the split plan's scratch; unsplit tiles write their output rows; one merge
    record per split tile and (batch, head) names its first slot and number of chunks."""
    from sparse_flash import layout
    from sparse_flash.kernels.split import SplitPlan

    monkeypatch.setattr(layout, "SPLIT_MIN_CHUNK", 2)  # cut every list longer than 2 blocks
    monkeypatch.setattr(layout, "SPLIT_FACTOR", 0)
    monkeypatch.setattr(layout, "SPLIT_MAX_CHUNKS", 3)
    B, Hq, Hkv, N, block = 2, 4, 2, 2048, 256
    mask = masks.bigbird(N, block, seed=0)
    rows = mask.kernel_index(causal).rows()
    assert rows[8].shape[0] > 0
    geometry = [*mask.shape, *mask.block_size, 0]
    split = SplitPlan(torch.device("cpu"), (rows[4], rows[8], rows[9]), B, Hq, 1, 1, block, 128, with_lse=True)
    items, merges = fwd_hopper._split_items(B, Hq, Hkv, N, N, rows, geometry, split, "cpu")
    assert items.shape[1] == fwd_hopper.SPLIT_ITEM_WIDTH.value
    full_off, part_off = rows[0], rows[2]
    walked = {}  # (q_row) -> full and partial positions walked
    scratch_rows, tile_scratch = [], {}
    for q_row, kv_row, lo, hi, plo, phi, scratch, _ in items.tolist():
        bh, start = divmod(q_row, N)
        b, h = divmod(bh, Hq)
        assert kv_row == (b * Hkv + h // 2) * N
        seen = walked.setdefault(q_row, [set(), set(), 0])
        assert not seen[0] & set(range(lo, hi)) and not seen[1] & set(range(plo, phi))
        seen[0] |= set(range(lo, hi))
        seen[1] |= set(range(plo, phi))
        seen[2] += 1
        if scratch >= 0:
            scratch_rows.append(scratch)
            tile_scratch.setdefault(q_row, set()).add(scratch)
            assert 0 <= scratch and scratch + 128 <= split.rows
    assert len(walked) == B * Hq * N // 128  # every (batch, head, 128-row tile)
    for q_row, (full, part, chunks) in walked.items():
        r = (q_row % N) // block
        assert full == set(range(int(full_off[r]), int(full_off[r + 1])))
        assert part == set(range(int(part_off[r]), int(part_off[r + 1])))
    assert len(set(scratch_rows)) == len(scratch_rows)  # no two chunks share scratch
    split_tiles = {q for q, (_, _, n) in walked.items() if n > 1}
    assert split_tiles and sorted(merges[:, 0].tolist()) == sorted(split_tiles)
    for q_row, first, num_chunks, copy, tile in merges.tolist():
        assert num_chunks == walked[q_row][2] and first >= 0 and tile == (q_row % N) % block // 128
        # the rows `split.store_chunk_merge` reads are the ones the tile's chunks write
        reads = {((first + c) * split.copies + copy) * block + tile * 128 for c in range(num_chunks)}
        assert reads == tile_scratch[q_row]
    assert (items[:, 6] >= 0).int().diff().le(0).all()  # chunks first


def _tiles(items, sub=1):
    return (items[:, 3] - items[:, 2] + items[:, 5] - items[:, 4]).long() * sub


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("programs", [7, 132])
def test_programs_take_each_item_once_with_balanced_loads(causal, programs):
    """`hopper.assign_programs`: every item exactly once, each program's items in their order in the item list
    (heavy lists first), and the most loaded program within one run's cost of the mean load (a run: the
    consecutive items placed together), where item i on program i % programs can be far above it."""
    B, Hq, N = 2, 4, 4096
    mask = masks.random(N, 128, density=0.08, seed=3, num_heads=Hq) | masks.global_(N, 128)
    rows = mask.kernel_index(causal).rows()
    items = hopper.row_items(B, Hq, Hq, N, N, causal, rows, [*mask.shape, *mask.block_size, 0], "cpu")
    placed, starts = hopper.assign_programs(items, programs, 1)
    assert starts.dtype == torch.int32 and starts.shape == (programs + 1, ) and starts[0] == 0
    assert starts[-1] == items.shape[0] and (starts[1:] >= starts[:-1]).all()
    position = {tuple(r): i for i, r in enumerate(items.tolist())}
    assert sorted(position[tuple(r)] for r in placed.tolist()) == list(range(items.shape[0]))
    cost = _tiles(placed) + hopper.ITEM_COST
    loads = torch.stack([cost[starts[p]:starts[p + 1]].sum() for p in range(programs)]).double()
    for p in range(programs):  # each program's items keep the list's order
        mine = [position[tuple(r)] for r in placed[starts[p]:starts[p + 1]].tolist()]
        assert mine == sorted(mine)
    run = -(-items.shape[0] // (hopper.BUNDLES_PER_PROGRAM * programs))  # items per run placed
    assert loads.max() <= loads.mean() + run * cost.max()
    if run == 1:  # single items placed: never worse than taking them in turn
        static = torch.stack([(_tiles(items) + hopper.ITEM_COST)[p::programs].sum() for p in range(programs)])
        assert loads.max() <= static.max()


def test_programs_split_lists_weighted_by_their_key_tiles(monkeypatch):
    """Lists count mask blocks of SUB key tiles each; with balancing off, item i goes to program i % P."""
    items = torch.tensor([[0, 0, 0, n, 0, 0] for n in (8, 1, 1, 1, 1, 1)], dtype=torch.int32)
    placed, starts = hopper.assign_programs(items, 2, 2)
    assert starts.tolist() == [0, 1, 6]  # 8 blocks x 2 tiles + 1 against 5 x (2 + 1)
    monkeypatch.setattr(hopper, "BALANCE", False)
    placed, starts = hopper.assign_programs(items, 2, 2)
    assert starts.tolist() == [0, 3, 6] and placed[:3, 3].tolist() == [8, 1, 1]


def test_merge_combines_the_chunks_of_each_split_tile_by_their_log_sum_exp():
    """`_merge_split_rows` (a Triton kernel; under the interpreter on the CPU): for each merge record, the
    chunks' normalised outputs in the scratch rows, weighted by exp(lse_chunk - lse), into Out and Lse;
    a row empty in some chunks takes the others, a row empty in all gets 0 and -inf. Outputs NaN-poisoned."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or the Triton interpreter")
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
    grid = (len(records), fwd_hopper.BLOCK // fwd_hopper.MERGE_ROWS.value)
    fwd_hopper._merge_split_rows[grid](*args, copies, HEAD_D=D, MASK_BLOCK_Q=block_q, BLOCK_M=fwd_hopper.BLOCK)
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

"""The warp-specialised Hopper backward kernels' host side, on the CPU: which calls the dK/dV and dQ kernels
take, and the work items the dK/dV kernel walks (the dQ kernel walks the forward's, tested in
tests/test_fwd_hopper.py). The kernels run on sm_90 GPUs only (tests/test_gpu.py); tests/test_codegen.py
compiles them."""

import pytest
import torch

from sparse_flash import masks

bwd_hopper = pytest.importorskip("sparse_flash.kernels.bwd_hopper", exc_type=ImportError)
dq_hopper = pytest.importorskip("sparse_flash.kernels.dq_hopper", exc_type=ImportError)


def call(mask, B=1, Hq=4, Hkv=4, N=1024, D=128, causal=False):
    """shape_supported's arguments for a call with this mask (None: dense)."""
    index = [] if mask is None else mask.kernel_index(causal).rows() + mask.kernel_index(causal).cols()
    geometry = [1, 1, 1, 1, 128, 128, 0] if mask is None else [*mask.shape, *mask.block_size, 0]
    return (B, Hq, N, D), (B, Hkv, N, D), index, geometry


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask", [None, masks.butterfly(1024, 128), masks.local(1024, 256, window=1)],
                         ids=["dense", "butterfly", "block256"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_takes_16_bit_d128_calls_with_whole_blocks(mask, dtype, causal):
    q_shape, k_shape, index, geometry = call(mask, causal=causal)
    assert bwd_hopper.shape_supported(q_shape, k_shape, dtype, index, geometry)


@pytest.mark.parametrize("kernel", ["dq", "dkdv"])
def test_takes_masks_whose_work_plan_splits_lists(kernel):
    """A global row and column (lists the Triton kernels' work plans split): the Hopper kernels cut them
    their own way (`hopper.split_long_items`)."""
    mask = masks.bigbird(16384, 128, seed=0)
    q_shape, k_shape, index, geometry = call(mask, N=16384)
    assert index[8].shape[0] > 0 and index[10 + 8].shape[0] > 0
    module = dq_hopper if kernel == "dq" else bwd_hopper
    assert module.shape_supported(q_shape, k_shape, torch.bfloat16, index, geometry)


def test_takes_gqa_with_a_mask_shared_by_the_heads():
    assert bwd_hopper.shape_supported(*call(masks.butterfly(1024, 128), Hq=8, Hkv=2)[:2], torch.bfloat16,
                                      *call(masks.butterfly(1024, 128), Hq=8, Hkv=2)[2:])


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
    items = bwd_hopper._dkdv_items(B, Hq, Hkv, Nq, Nk, causal, [], None, "cpu")
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
    cols = index.cols()
    geometry = [*mask.shape, *mask.block_size, 0]
    items = bwd_hopper._dkdv_items(B, H, H, N, N, causal, cols, geometry, "cpu")
    layout = mask.layout.bool()[0]  # (H, Mq, Mk)
    full_idx, part_idx = cols[1].tolist(), cols[3].tolist()
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



@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask", [None, masks.butterfly(1024, 128), masks.local(1024, 256, window=1),
                                  masks.random(1024, 128, density=0.2, seed=0, num_heads=8)],
                         ids=["dense", "butterfly", "block256", "gqa_per_head_mask"])
def test_dq_kernel_takes_16_bit_d128_calls_with_whole_blocks(mask, causal):
    """The dQ kernel walks row lists, one query head at a time: per-head masks under GQA are fine."""
    q_shape, k_shape, index, geometry = call(mask, Hq=8, Hkv=2, causal=causal)
    assert dq_hopper.shape_supported(q_shape, k_shape, torch.bfloat16, index, geometry)


def _other_call(case):
    """(q_shape, k_shape, dtype, index, geometry) of a call that a Hopper backward kernel leaves to Triton."""
    mask, kwargs, dtype = masks.butterfly(1024, 128), {}, torch.bfloat16
    if case == "fp32":
        dtype = torch.float32
    elif case == "d64":
        kwargs = dict(D=64)
    elif case == "tail":
        mask, kwargs = masks.butterfly(1000, 128), dict(N=1000)
    elif case == "block64":
        mask = masks.butterfly(1024, 64)
    else:  # per-head layouts under GQA
        mask, kwargs = masks.random(1024, 128, density=0.2, seed=0, num_heads=8), dict(Hq=8, Hkv=2)
    q_shape, k_shape, index, geometry = call(mask, **kwargs)
    return q_shape, k_shape, dtype, index, geometry


@pytest.mark.parametrize("kernel, case", [(k, c) for k in ("dq", "dkdv")
                                          for c in ("fp32", "d64", "tail", "block64")]
                         + [("dkdv", "gqa_per_head_mask")])
def test_leaves_other_calls_to_the_triton_kernels(kernel, case):
    """Neither kernel takes fp32, D=64, sequence tails or 64-token blocks; the dK/dV kernel also leaves per-head masks under GQA (it walks every group head's list in one item)."""
    module = dq_hopper if kernel == "dq" else bwd_hopper
    assert not module.shape_supported(*_other_call(case))


def _items_with_long_lists(causal):
    """dK/dV items of BigBird with two global blocks at 4,096 tokens (B=1, H=4), and its column lists."""
    mask = masks.bigbird(4096, 128, num_global_blocks=2, seed=1)
    cols = mask.kernel_index(causal).cols()
    return bwd_hopper._dkdv_items(1, 4, 4, 4096, 4096, causal, cols, [*mask.shape, *mask.block_size, 0], "cpu")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("programs", [64, 128])
def test_long_lists_are_cut_into_chunks_that_cover_them_once(causal, programs):
    """`split_long_items`: the chunks of a cut item walk its full list exactly once in order and its partial
    list with the last chunk; no chunk is longer than a program's mean load; slots are 0, 1, ... in item
    order and each merge record names its item's first row, first slot and chunk count; items that are not
    cut keep their ranges and slot -1."""
    from sparse_flash.kernels import hopper

    items = _items_with_long_lists(causal)
    cut_items, merges = hopper.split_long_items(items, programs, 2)
    assert cut_items.dtype == torch.int32 and cut_items.shape[1] == 7 and merges.shape[0] > 0
    length = (items[:, 3] - items[:, 2] + items[:, 5] - items[:, 4]).long()
    limit = -(-int(float((length * 2 + hopper.ITEM_COST).sum()) / programs) // 2)
    by_row = {}
    for rec in cut_items.tolist():
        by_row.setdefault(rec[0], []).append(rec)
    assert sorted(by_row) == sorted(items[:, 0].tolist())
    slots = [rec[6] for rec in cut_items.tolist() if rec[6] >= 0]
    assert slots == list(range(len(slots)))
    merged = {row: (first, n) for row, first, n in merges.tolist()}
    for rec in items.tolist():
        chunks = by_row[rec[0]]
        if len(chunks) == 1 and chunks[0][6] < 0:
            assert chunks[0][:6] == rec and rec[0] not in merged
            continue
        assert merged[rec[0]] == (chunks[0][6], len(chunks))
        assert [c[6] for c in chunks] == list(range(chunks[0][6], chunks[0][6] + len(chunks)))
        assert all(c[1] == rec[1] for c in chunks)
        walked = [j for c in chunks for j in range(c[2], c[3])]
        assert walked == list(range(rec[2], rec[3])) and all(c[3] - c[2] <= limit for c in chunks)
        assert [(c[4], c[5]) for c in chunks[:-1]] == [(rec[5], rec[5])] * (len(chunks) - 1)
        assert (chunks[-1][4], chunks[-1][5]) == (rec[4], rec[5])


def test_lists_of_even_length_are_not_cut():
    """Dense and local masks have no list much longer than the others: no chunk, no merge."""
    from sparse_flash.kernels import hopper

    for items in (bwd_hopper._dkdv_items(2, 4, 4, 2048, 2048, False, [], None, "cpu"),
                  _items_with_long_lists(False)[4:8]):
        cut_items, merges = hopper.split_long_items(items, 132, 2)
        assert merges.shape[0] == 0 and torch.equal(cut_items[:, :6], items) and (cut_items[:, 6] == -1).all()


def test_each_chunk_is_placed_as_a_run_of_its_own():
    """`assign_programs` places runs of consecutive items (here 8 per run); the chunks of a cut list are
    consecutive, so each must be a run of its own, or they would all land on one program and cutting would
    not spread the list."""
    from sparse_flash.kernels import hopper

    # 2,000 one-entry lists and two of 1,000 entries, on 16 programs: runs of 8 items
    items = torch.tensor([[128 * i, 0, i, i + 1, 0, 0] for i in range(1000)] + [[-1, 0, 0, 1000, 0, 0]]
                         + [[128 * i, 0, i, i + 1, 0, 0] for i in range(1000, 2000)] + [[-2, 0, 0, 1000, 0, 0]])
    cut_items, merges = hopper.split_long_items(items, 16, 2)
    placed, starts = hopper.assign_programs(cut_items, 16, 2)
    program_of_slot = {}
    for p in range(16):
        for slot in placed[starts[p]:starts[p + 1], 6].tolist():
            program_of_slot[slot] = p
    assert merges.shape[0] == 2 and min(merges[:, 2].tolist()) > 1
    for _, first, chunks in merges.tolist():
        assert len({program_of_slot[s] for s in range(first, first + chunks)}) > 1


def test_chunk_sum_adds_the_chunks_of_each_tile_in_order():
    """`chunk_sum.ChunkSum` (under the interpreter on the CPU): each merge record's tile of the output is the
    sum of its chunks' scratch slots, rounded once; other rows are left as they were."""
    import os

    from sparse_flash.kernels import chunk_sum

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton on the CPU under TRITON_INTERPRET=1")
    merges = torch.tensor([[256, 0, 3], [0, 3, 2]], dtype=torch.int32)
    summed = chunk_sum.ChunkSum(merges, 128, 128)
    part = torch.randn(summed.slots, 128, 128)
    out = torch.full((4 * 128, 128), float("nan"), dtype=torch.float16)
    summed(out, part)
    want = torch.full_like(out, float("nan"))
    want[256:384] = (part[0] + part[1] + part[2]).half()
    want[0:128] = (part[3] + part[4]).half()
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)

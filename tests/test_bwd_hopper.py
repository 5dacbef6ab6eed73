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
    elif case == "split_lists":  # a global row and column: the work plans cut their lists into chunks
        mask, kwargs = masks.bigbird(16384, 128, seed=0), dict(N=16384)
    else:  # per-head layouts under GQA
        mask, kwargs = masks.random(1024, 128, density=0.2, seed=0, num_heads=8), dict(Hq=8, Hkv=2)
    q_shape, k_shape, index, geometry = call(mask, **kwargs)
    if case == "split_lists":
        assert index[8].shape[0] > 0 and index[10 + 8].shape[0] > 0
    return q_shape, k_shape, dtype, index, geometry


@pytest.mark.parametrize("kernel, case", [(k, c) for k in ("dq", "dkdv")
                                          for c in ("fp32", "d64", "tail", "block64", "split_lists")]
                         + [("dkdv", "gqa_per_head_mask")])
def test_leaves_other_calls_to_the_triton_kernels(kernel, case):
    """Neither kernel takes fp32, D=64, sequence tails, 64-token blocks or lists the work plan splits; the
    dK/dV kernel also leaves per-head masks under GQA (it walks every group head's list in one item)."""
    module = dq_hopper if kernel == "dq" else bwd_hopper
    assert not module.shape_supported(*_other_call(case))

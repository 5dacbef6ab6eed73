"""BlockMask: construction, index lists, algebra, devices, repr and plots."""

import itertools
import math
import os
from unittest import mock

import pytest
import torch
from conftest import DeviceWaits, examples
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sparse_flash import BlockMask, masks
from sparse_flash.mask_index import HEAVY_FACTOR, ITEM_FIELDS, LONG_LIST_BLOCKS


@st.composite
def layouts(draw):
    B = draw(st.sampled_from([1, 2]))
    H = draw(st.sampled_from([1, 3]))
    Mq, Mk = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    bq, bk = draw(st.sampled_from([16, 32, 48])), draw(st.sampled_from([16, 64]))
    seed = draw(st.integers(0, 10_000))
    density = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0, "causal"]))
    Nq = draw(st.integers((Mq - 1) * bq + 1, Mq * bq))
    Nk = draw(st.integers((Mk - 1) * bk + 1, Mk * bk))
    if density == "causal":  # every block holding a pair key <= query, plus random others
        tril = torch.ones(Nq, Nk, dtype=torch.bool).tril()
        pairs = torch.stack([torch.stack([tril[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any() for j in range(Mk)])
                             for i in range(Mq)])
        layout = pairs | (torch.rand(B, H, Mq, Mk, generator=torch.Generator().manual_seed(seed)) < 0.3)
    else:
        layout = torch.rand(B, H, Mq, Mk, generator=torch.Generator().manual_seed(seed)) < density
    return BlockMask.from_layout(layout, (bq, bk), seq_len_q=Nq, seq_len_k=Nk)


def lists_from_index(index):
    """Decode CSR index lists into Python lists, one per row."""
    offs = index.offsets.tolist()
    idx = index.indices.tolist()
    return [idx[offs[r] : offs[r + 1]] for r in range(len(offs) - 1)]


@given(m=layouts())
def test_to_dense_agrees_with_layout(m):
    dense = m.to_dense()
    B, H, Mq, Mk = m.shape
    assert dense.shape == (B, H, m.seq_len_q, m.seq_len_k)
    bq, bk = m.block_size
    for i in range(Mq):
        for j in range(Mk):
            block = dense[:, :, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            assert torch.equal(block.all(-1).all(-1), m.layout[:, :, i, j])
            assert torch.equal(block.any(-1).any(-1), m.layout[:, :, i, j])


@given(m=layouts(), causal=st.booleans())
def test_index_lists_agree_with_layout(m, causal):
    B, H, Mq, Mk = m.shape
    bq, bk = m.block_size
    tril = torch.ones(m.seq_len_q, m.seq_len_k, dtype=torch.bool).tril()
    elem = m.to_dense() & tril if causal else m.to_dense()

    rows = lists_from_index(m.row_index(causal))
    cols = lists_from_index(m.col_index(causal))
    kidx = m.kernel_index(causal)
    row_full, row_part = lists_from_index(kidx.row_full), lists_from_index(kidx.row_partial)
    col_full, col_part = lists_from_index(kidx.col_full), lists_from_index(kidx.col_partial)
    assert m.has_long_lists(causal) == (sum(map(len, rows)) >= LONG_LIST_BLOCKS * B * H * Mq)
    covered = True
    assert m.row_index(causal).counts.shape == (B, H, Mq)
    assert m.col_index(causal).counts.shape == (B, H, Mk)
    for b in range(B):
        for h in range(H):
            for i in range(Mq):
                r = (b * H + h) * Mq + i
                block_elems = [elem[b, h, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk] for j in range(Mk)]
                live = [j for j in range(Mk) if block_elems[j].any()]
                assert rows[r] == live  # sorted, exactly the blocks with an allowed pair
                assert sorted(row_full[r] + row_part[r]) == live
                for j in row_full[r]:  # a full block needs no element mask and no bounds
                    assert block_elems[j].all() and block_elems[j].shape == (bq, bk)
                assert int(m.row_index(causal).counts[b, h, i]) == len(live)
                if causal:
                    pairs = [j for j in range(Mk) if tril[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].any()]
                    covered &= set(pairs) <= set(live)
            for j in range(Mk):
                c = (b * H + h) * Mk + j
                live = [i for i in range(Mq) if elem[b, h, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].any()]
                assert cols[c] == live
                assert sorted(col_full[c] + col_part[c]) == live
                assert set(col_full[c]) == {i for i in live if j in row_full[(b * H + h) * Mq + i]}
    if causal:
        assert m.covers_causal == covered


@given(m=layouts(), causal=st.booleans())
def test_work_plan_leads_with_heavy_items(m, causal):
    """`lead` counts the ranks that hold, in some (batch, head), an item longer than HEAVY_FACTOR x the
    mean list length; items are longest first, so in every head those are the first ranks."""
    kidx = m.kernel_index(causal)
    for plan, counts in ((kidx.row_plan, m.row_index(causal).counts), (kidx.col_plan, m.col_index(causal).counts)):
        B, H, M = counts.shape
        mean = counts.sum().item() / counts.numel()
        chunks = plan.chunks.reshape(B, H, M)
        heavy = []
        for b in range(B):
            for h in range(H):
                blocks = [i for i, *_ in plan.items[b, h].tolist() if i >= 0]
                lengths = [int(counts[b, h, i]) // int(chunks[b, h, i]) for i in blocks]
                assert lengths == sorted(lengths, reverse=True)
                heavy.append(sum(length > HEAVY_FACTOR * mean for length in lengths))
        assert plan.lead.tolist() == [max(heavy)]


def check_work_items(full, part, plan):
    """Every list's items, taken in chunk order, walk its full blocks, then its partial blocks, exactly once;
    each item's record holds its chunk count, scratch slot and the first block of each range."""
    full_lists, part_lists = lists_from_index(full), lists_from_index(part)
    B, H, M = full.counts.shape
    walked = {}
    for b in range(B):
        for h in range(H):
            for record in plan.items[b, h].tolist():
                item = dict(zip(ITEM_FIELDS, record))
                if item["block"] < 0:  # padding: nothing to walk, nowhere to store
                    assert item["full_lo"] == item["full_hi"] and item["part_lo"] == item["part_hi"]
                    assert item["slot"] == -1
                    continue
                r = (b * H + h) * M + item["block"]
                assert item["chunks"] == int(plan.chunks[r])
                assert item["slot"] == (int(plan.slots[r]) + item["chunk"] if item["chunks"] > 1 else -1)
                full_blocks = full.indices[item["full_lo"]:item["full_hi"]].tolist()
                part_blocks = part.indices[item["part_lo"]:item["part_hi"]].tolist()
                assert item["full_first"] == (full_blocks[0] if full_blocks else 0)
                assert item["part_first"] == (part_blocks[0] if part_blocks else 0)
                walked[r, item["chunk"]] = (full_blocks, part_blocks)
    for r in range(B * H * M):
        n = int(plan.chunks[r])
        chunks = [walked[r, c] for c in range(n)]
        assert sum((f for f, _ in chunks), []) == full_lists[r] and sum((p for _, p in chunks), []) == part_lists[r]


@given(m=layouts(), causal=st.booleans())
def test_work_items_hold_their_share_of_the_list(m, causal):
    kidx = m.kernel_index(causal)
    check_work_items(kidx.row_full, kidx.row_partial, kidx.row_plan)
    check_work_items(kidx.col_full, kidx.col_partial, kidx.col_plan)


@pytest.mark.parametrize("causal", [False, True])
def test_work_items_of_split_lists(causal):
    """BigBird's global rows (not causal: a causal global row is short) and columns are split into chunks:
    each chunk's record covers its share."""
    kidx = masks.bigbird(128 * 96 + 50, 128, num_global_blocks=2, seed=0).kernel_index(causal)
    assert kidx.row_plan.split.numel() == (0 if causal else 2) and kidx.col_plan.split.numel() == 2
    check_work_items(kidx.row_full, kidx.row_partial, kidx.row_plan)
    check_work_items(kidx.col_full, kidx.col_partial, kidx.col_plan)


@given(m=layouts())
def test_index_tensors_share_no_storage(m):
    """The work plans of both flags are built in one batch, then cut apart: no list or plan tensor is a view of
    another (torch.compile guards on how its inputs alias, and these sizes differ from mask to mask)."""
    tensors = [t for causal in (False, True) for part in m.kernel_index(causal) for t in part if t.numel()]
    storages = [t.untyped_storage().data_ptr() for t in tensors]
    assert len(set(storages)) == len(storages)


def test_item_fields_agree_with_the_kernels():
    pytest.importorskip("triton")
    from sparse_flash.kernels.triton import common

    assert common.ITEM_WIDTH == len(ITEM_FIELDS)
    for i, name in enumerate(ITEM_FIELDS):
        assert getattr(common, f"ITEM_{name.upper()}") == i


@pytest.mark.parametrize("builder", ["torch", "triton"])
@pytest.mark.parametrize("layout_kind", ["random", "bigbird"])
def test_index_build_waits_on_the_device_three_times_twice_or_once(layout_kind, builder, monkeypatch):
    """The torch operators wait for the layout's nonzero blocks, the class sizes of both causal flags, and the
    sizes of the four work plans (rows and columns, for each flag) in one read; the Triton launches
    (`index_gpu.layout_lists`, here under TRITON_INTERPRET=1) read their six totals and the longest lists
    instead of the first two, and skip the third where no list is long enough to be cut into chunks (random;
    BigBird's global rows are cut). Every other size is derived on the host or passed along."""
    from sparse_flash import mask_index

    if builder == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton on the CPU under TRITON_INTERPRET=1")
    n = 128 * 40 + 50  # a sequence tail: partial blocks in every flag
    if layout_kind == "random":
        layout = torch.rand(2, 3, 41, 41, generator=torch.Generator().manual_seed(0)) < 0.3
    else:
        layout = masks.bigbird(n, 128, num_global_blocks=2, seed=0).layout  # split lists
    with mock.patch.object(mask_index, "_on_gpu", lambda t: builder == "triton"), \
            DeviceWaits(monkeypatch) as counter:
        m = BlockMask.from_layout(layout, 128, seq_len_q=n, seq_len_k=n)
    monkeypatch.undo()
    cut = layout_kind == "bigbird"
    assert counter.waits == (3 if builder == "torch" else 2 if cut else 1)
    assert m.kernel_index(False).row_plan.split.numel() == (2 if cut else 0)


def test_int32_pieces_are_disjoint_aligned_views_of_one_allocation():
    """`index_gpu.int32_pieces`: each piece has its shape, starts a multiple of 128 bytes into the shared
    allocation, and a write to one changes no other; the shared pieces share one storage, each own piece
    starts one of its own."""
    from sparse_flash.index_gpu import int32_pieces

    shapes = [(2, 3, 5), (0,), (7,), (1,), (33,), (0,), (4, 10), (6,)]
    own = [2, 5, 7]
    pieces = int32_pieces(shapes, torch.device("cpu"), own)
    assert [tuple(p.shape) for p in pieces] == shapes
    shared = [p for i, p in enumerate(pieces) if i not in own]
    assert len({p.untyped_storage().data_ptr() for p in shared}) == 1
    owned = [pieces[i] for i in own]
    assert all(p.storage_offset() == 0 for p in owned)
    assert len({p.untyped_storage().data_ptr() for p in owned + shared[:1]}) == len(owned) + 1
    start = shared[0].data_ptr()  # the allocation's start (on CUDA on a 512-byte boundary)
    assert all((p.data_ptr() - start) % 128 == 0 and p.is_contiguous() for p in shared if p.numel())
    for k, piece in enumerate(pieces):
        piece.fill_(k)
    assert all(bool((p == k).all()) for k, p in enumerate(pieces))


@pytest.mark.parametrize("cut", [False, True], ids=["whole-lists", "cut-lists"])
def test_gpu_builders_put_a_masks_lists_and_plans_in_few_allocations(cut):
    """Under TRITON_INTERPRET=1: the Triton-built lists of both sides and flags (36 tensors) keep their counts
    and offsets in one allocation, and the four plans' chunks and slots in another (one builder makes the four
    plans), whether or not some list is cut into chunks (a build's host time is mostly allocations and
    launches); every tensor whose size differs
    from mask to mask (index lists, work items, split tables) starts an allocation of its own, as torch.compile
    needs to share one graph between masks (tests/test_nn.py); the lists are the torch operators'."""
    from sparse_flash import mask_index

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton on the CPU under TRITON_INTERPRET=1")
    if cut:  # BigBird's global rows and columns are cut into chunks
        n, block = 128 * 40 + 50, 128
        layout = masks.bigbird(n, block, num_global_blocks=2, seed=0).layout
        geometry = dict(seq_len_q=n, seq_len_k=n)
    else:
        layout = torch.rand(2, 3, 9, 7, generator=torch.Generator().manual_seed(1)) < 0.4
        block, geometry = 16, dict(seq_len_q=16 * 9 - 3, seq_len_k=16 * 7)
    with mock.patch.object(mask_index, "_on_gpu", lambda t: True):
        index = BlockMask.from_layout(layout, block, **geometry)._index
    by_torch = BlockMask.from_layout(layout, block, **geometry)._index
    assert (index.kernel[False].row_plan.split.numel() > 0) == cut

    def lists(ix):
        return [t for flag in (False, True) for side in (ix.rows[flag], ix.cols[flag], *ix.kernel[flag][:4])
                for t in side]

    plans = [plan for flag in (False, True) for plan in (index.kernel[flag].row_plan, index.kernel[flag].col_plan)]
    fixed, sized = lists(index), []
    assert len(fixed) == 36
    sized += fixed[2::3]  # the index lists
    del fixed[2::3]
    sized += [t for plan in plans for t in (plan.items, plan.split, plan.slot_list) if t.numel()]
    tables = [t for plan in plans for t in (plan.chunks, plan.slots)]  # the four plans' chunk and slot tables
    for group in (fixed, tables):
        storages = {t.untyped_storage().data_ptr() for t in group if t.numel()}
        assert len(storages) == 1, storages
    assert all(t.storage_offset() == 0 for t in sized)
    storages = [t.untyped_storage().data_ptr() for t in sized if t.numel()]
    assert len(set(storages)) == len(storages)
    assert all(torch.equal(a, b) for a, b in zip(lists(index), lists(by_torch)))
    # the plans' scratch is not kept: the tables' allocation holds them and little more
    held = tables[0].untyped_storage().nbytes()
    assert held == sum(-(-t.numel() * 4 // 128) * 128 for t in tables)  # each piece padded to 128 bytes


def test_long_lists_and_causal_cover():
    n = 16 * 20  # 20 blocks of 16
    assert masks.dense(n, 16).has_long_lists() and not masks.local(n, 16, window=2).has_long_lists()
    assert masks.dense(n, 16).has_long_lists(True) is False  # causal rows average 10.5 blocks
    assert masks.causal(n, 16).covers_causal and masks.dense(n, 16).covers_causal
    assert (masks.causal(n, 16) | masks.local(n, 16, window=1)).covers_causal
    assert not masks.local(n, 16, window=3).covers_causal
    assert masks.causal(n, (16, 32)).covers_causal  # any block shape: it holds every block with a causal pair


def test_index_memory_is_proportional_to_nonzero_blocks():
    m = masks.butterfly(1 << 18, 128)
    idx = m.kernel_index(False)
    total = sum(part.indices.numel() for part in (idx.row_full, idx.row_partial, idx.col_full, idx.col_partial))
    assert total == 2 * m.nnz  # rows and columns, nothing for the zero blocks
    assert idx.row_full.offsets.numel() == m.num_blocks[0] + 1


def test_from_layout_shapes_and_checks():
    m = BlockMask.from_layout(torch.ones(3, 4, dtype=torch.int64), (32, 16), seq_len_q=70, seq_len_k=50)
    assert m.shape == (1, 1, 3, 4) and m.layout.dtype == torch.bool
    assert m.block_size == (32, 16) and m.nnz == 12 and m.density == 1.0
    with pytest.raises(ValueError, match=r"ceil\(100/32\) = 4 blocks, but the layout has 3"):
        BlockMask.from_layout(torch.ones(3, 4, dtype=torch.bool), (32, 16), seq_len_q=100)
    with pytest.raises(ValueError, match="only 0 and 1"):
        BlockMask.from_layout(torch.full((2, 2), 2), 16)
    with pytest.raises(TypeError, match="bool or integer"):
        BlockMask.from_layout(torch.ones(2, 2), 16)
    with pytest.raises(ValueError, match="shape"):
        BlockMask.from_layout(torch.ones(2, dtype=torch.bool), 16)
    with pytest.raises(TypeError, match="torch.Tensor"):
        BlockMask.from_layout([[1]], 16)


def test_union_and_intersection():
    a = masks.local(1024, 64, window=1)
    b = masks.random(1024, 64, density=0.3, seed=2, num_heads=4)
    u, x = a | b, a & b
    assert u.shape == (1, 4, 16, 16)
    assert torch.equal(u.layout, a.layout | b.layout)
    assert torch.equal(x.layout, a.layout & b.layout)
    assert torch.equal(u.to_dense(), a.to_dense() | b.to_dense())
    assert torch.equal(x.to_dense(), a.to_dense() & b.to_dense())
    with pytest.raises(ValueError, match="same"):
        a | masks.local(1024, 128)
    with pytest.raises(ValueError, match="head sizes 4 and 3"):
        b | masks.random(1024, 64, density=0.3, num_heads=3)
    with pytest.raises(TypeError, match="BlockMask"):
        a | torch.ones(1)


def test_to_device_keeps_the_mask():
    m = masks.butterfly(1000, 64)
    assert m.to("cpu") is m
    assert m.to(torch.device("cpu")) == m


def test_repr_grid_and_summary():
    small = masks.butterfly(512, 64, n_factors=2)
    text = repr(small)
    assert "butterfly" in text and "density=0.3750" in text
    assert "###....." in text and ".....###" in text
    big = masks.butterfly(65536, 128)
    assert "\n" not in repr(big) and "(1, 1, 512, 512)" in repr(big)


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "mask.png"
    fig = masks.bigbird(4096, 128, num_heads=2).plot(path)
    assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"
    assert "bigbird" in fig._suptitle.get_text() and "density" in fig._suptitle.get_text()


def test_gallery_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "gallery.png"
    fig = masks.gallery(path)
    assert path.stat().st_size > 10_000
    assert sum(1 for ax in fig.axes if ax.images) == len(masks.PATTERNS)


def test_plot_without_matplotlib_names_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match=r"sparse-flash\[viz\]"):
        masks.local(512, 64).plot()


@pytest.mark.parametrize("n", [1, 127, 129])
def test_single_and_partial_blocks(n):
    m = masks.dense(n, 128)
    assert m.num_blocks == (math.ceil(n / 128),) * 2
    assert m.to_dense().all()


@given(m=layouts(), causal=st.booleans(), topk=st.booleans(), tile=st.sampled_from([1, 64, 8192]))
def test_work_plans_built_on_the_gpu_equal_the_torch_ones(m, causal, topk, tile):
    """`sparse_flash.index_gpu` (programs of a few lists of one (batch, head), `tile` comparisons each, from one
    list to a whole head; here under TRITON_INTERPRET=1) builds the plans that `mask_index._plan_items` builds
    for lists that no program splits: the same items, chunk and slot tables and lead, on layouts and on top-k
    masks (both flags)."""
    from sparse_flash import index_gpu

    from sparse_flash import mask_index

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton on the CPU under TRITON_INTERPRET=1")
    if topk:
        B, H, Mq, Mk = m.layout.shape
        scores = torch.randn(B, H, Mq, Mk, generator=torch.Generator().manual_seed(Mq * 31 + Mk))
        m = BlockMask.from_topk(scores, max(1, Mk // 2), causal=causal, block_size=m.block_size)
    kidx = m.kernel_index(causal)
    inputs, plans = [], []
    for plan, live, full, part in ((kidx.row_plan, m.row_index(causal), kidx.row_full, kidx.row_partial),
                                   (kidx.col_plan, m.col_index(causal), kidx.col_full, kidx.col_partial)):
        if plan.split.numel():  # a list cut into chunks: not a plan this builder makes
            return
        inputs.append(mask_index._PlanInput(live.counts, 0, live.counts.sum().item() / live.counts.numel(), full, part))
        plans.append(plan)
    with mock.patch.object(mask_index, "_on_gpu", lambda t: True), mock.patch.object(index_gpu, "PLAN_TILE", tile):
        on_gpu = mask_index._unsplit_plans_on_gpu(inputs)
    for built, expected in zip(on_gpu, plans):
        for name, a, b in zip(mask_index.WorkPlan._fields, built, expected):
            assert a.dtype == b.dtype and torch.equal(a, b), name


CUT_MIN_CHUNK = 12  # `mask_index.SPLIT_MIN_CHUNK` in `cut_layouts`' tests: lists cut on small grids (the interpreter's
#                     time grows with the grid)


@st.composite
def cut_layouts(draw):
    """Layouts whose global rows (and columns) are long enough to be cut into chunks for some causal flag."""
    B, H = draw(st.sampled_from([(1, 1), (1, 2), (2, 1)]))
    Mq, Mk = draw(st.integers(16, 20)), draw(st.integers(24, 32))  # rows average under a quarter of a global one
                                                                  # (cut past `CUT_MIN_CHUNK` blocks)
    bq, bk = draw(st.sampled_from([16, 32])), draw(st.sampled_from([16, 64]))
    Nq = draw(st.integers((Mq - 1) * bq + 1, Mq * bq))
    Nk = draw(st.integers((Mk - 1) * bk + 1, Mk * bk))
    g = torch.Generator().manual_seed(draw(st.integers(0, 10_000)))
    layout = torch.rand(B, H, Mq, Mk, generator=g) < draw(st.sampled_from([0.0, 0.05]))
    heads = layout.view(B * H, Mq, Mk)[: draw(st.sampled_from([1, B * H]))]  # the first or every (b, h): some
    heads[..., : draw(st.integers(1, 2)), :] = True  # global rows             # heads may have fewer work items
    heads[..., :, : draw(st.integers(0, 1))] = True  # and columns
    return layout, (bq, bk), Nq, Nk


def zero_filled(int32_pieces):
    """`index_gpu.int32_pieces` whose allocations start as zeros: uninitialised memory that reads as list
    number 0, so that a kernel reading a slot it did not write makes a wrong plan, not a lucky one."""

    def pieces(*args, **kwargs):
        out = int32_pieces(*args, **kwargs)
        for t in out:
            t.untyped_storage().fill_(0)
        return out

    return pieces


def _assert_same_index(got, want):
    assert (got.nnz, got.is_dense, got.covers_causal) == (want.nnz, want.is_dense, want.covers_causal)
    for causal in (False, True):
        assert (got.long_lists[causal], got.longest_row[causal]) == (want.long_lists[causal], want.longest_row[causal])
        for a, b in ((got.rows[causal], want.rows[causal]), (got.cols[causal], want.cols[causal]),
                     *zip(got.kernel[causal], want.kernel[causal])):
            for name, x, y in zip(a._fields, a, b):
                assert x.dtype == y.dtype and torch.equal(x, y), (causal, type(a).__name__, name)


@settings(max_examples=examples(8), deadline=None)
@given(case=cut_layouts())
def test_plans_with_cut_lists_built_on_the_gpu_equal_the_torch_ones(case):
    """`sparse_flash.index_gpu.plan_sizes` (one Triton launch per plan) and `split_plans` (one launch for the four
    plans, those without a cut list among them; here under TRITON_INTERPRET=1, with no torch plan batch) build
    the plans that `mask_index._plan_items` builds where global rows or columns are cut into chunks: the same
    items (chunk ranges, scratch slots, order, padding), chunk and slot tables, lead, split lists and slot
    owners, for both causal flags; also where heads have fewer items than others, with the tables' memory
    starting as zeros (a rank without an item once read a slot of another head's row: an illegal address on
    the H200, a duplicated chunk elsewhere; tuning log, step 94)."""
    from sparse_flash import index_gpu, mask_index

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton on the CPU under TRITON_INTERPRET=1")
    layout, block, Nq, Nk = case
    with mock.patch.object(mask_index, "SPLIT_MIN_CHUNK", CUT_MIN_CHUNK):
        want = mask_index.build_index(layout, block, Nq, Nk)
    with mock.patch.object(mask_index, "SPLIT_MIN_CHUNK", CUT_MIN_CHUNK), \
            mock.patch.object(mask_index, "_on_gpu", lambda t: True), \
            mock.patch.object(index_gpu, "split_plans", wraps=index_gpu.split_plans) as built, \
            mock.patch.object(index_gpu, "plan_sizes", wraps=index_gpu.plan_sizes) as sized, \
            mock.patch.object(index_gpu, "unsplit_plans", wraps=index_gpu.unsplit_plans) as whole, \
            mock.patch.object(mask_index, "_plan_batch", side_effect=AssertionError("the torch plan batch")), \
            mock.patch.object(index_gpu, "int32_pieces", zero_filled(index_gpu.int32_pieces)):
        got = mask_index.build_index(layout, block, Nq, Nk)
    cut = sum(bool(plan.split.numel()) for flag in (False, True) for plan in want.kernel[flag][4:])
    assert cut > 0
    assert built.call_count == 1  # the four plans, cut or not, in one launch
    assert whole.call_count == 0
    assert sized.call_count == 1  # the chunks and sizes of the four plans
    _assert_same_index(got, want)


@given(m=layouts())
def test_lists_of_a_layout_built_on_the_gpu_equal_the_torch_ones(m):
    """`sparse_flash.index_gpu.layout_lists` (one Triton program per list; here under TRITON_INTERPRET=1, as on
    a GPU) builds every row and column list of both causal flags that the torch operators build, and the
    same index (sizes, cover, plans) follows."""
    from sparse_flash import index_gpu, mask_index

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton on the CPU under TRITON_INTERPRET=1")
    want = mask_index.build_index(m.layout, m.block_size, m.seq_len_q, m.seq_len_k)
    with mock.patch.object(mask_index, "_on_gpu", lambda t: True), \
            mock.patch.object(index_gpu, "layout_lists", wraps=index_gpu.layout_lists) as built:
        got = mask_index.build_index(m.layout, m.block_size, m.seq_len_q, m.seq_len_k)
    assert built.call_count == 1
    _assert_same_index(got, want)


def _runs_of(layout: torch.Tensor, rng, mode: str):
    """`BlockRuns` of a `(1, H, Mq, Mk)` layout: each row's maximal runs, cut at drawn places ("pieces"), or one
    block each ("blocks"), with empty runs put anywhere on the grid, in a shuffled order."""
    from sparse_flash.mask_index import BlockRuns

    _, H, Mq, Mk = layout.shape
    runs = []
    for r, line in enumerate(layout.reshape(H * Mq, Mk).tolist()):
        j = 0
        while j < Mk:
            if not line[j]:
                j += 1
                continue
            end = j
            while end < Mk and line[end]:
                end += 1
            cuts = range(j + 1, end) if mode == "blocks" else sorted(rng.sample(range(j + 1, end), rng.randint(0, end - j - 1)))
            bounds = [j, *cuts, end]
            runs += [(r, s, e) for s, e in zip(bounds, bounds[1:])]
            j = end
    if mode != "blocks":
        runs += [(rng.randrange(H * Mq), x, x - rng.randint(0, 1)) for x in (rng.randint(0, Mk) for _ in range(3))]
    rng.shuffle(runs)
    rows, starts, ends = (torch.tensor([run[k] for run in runs], dtype=torch.int64) for k in range(3))
    return BlockRuns(rows, starts, ends)


@settings(deadline=None)
@given(H=st.integers(1, 3), Mq=st.integers(1, 12), Mk=st.integers(1, 12), bq=st.sampled_from([1, 3, 16, 32, 48]),
       bk=st.sampled_from([1, 5, 16, 64]), tail_q=st.integers(0, 47), tail_k=st.integers(0, 63),
       density=st.sampled_from([0.0, 0.2, 0.6, 1.0]), mode=st.sampled_from(["pieces", "blocks"]),
       seed=st.integers(0, 10_000))
def test_run_sizes_and_layouts_equal_the_lists_of_the_layout(H, Mq, Mk, bq, bk, tail_q, tail_k, density, mode, seed):
    """From a layout's runs on the host (`BlockRuns`: cut anywhere, one block each, empty ones among them, in
    any order), `mask.layout_from_runs` makes the layout (by the torch operators, and under TRITON_INTERPRET=1 by
    the GPU builders' launch too) and `mask_index.run_sizes` gives the totals of each
    kind, the longest lists and every list's count that the lists built from the layout hold, for both causal
    flags, with and without sequence tails."""
    import random

    from sparse_flash import mask_index
    from sparse_flash.mask import layout_from_runs

    Nq, Nk = Mq * bq - min(tail_q, bq - 1), Mk * bk - min(tail_k, bk - 1)
    layout = torch.rand(1, H, Mq, Mk, generator=torch.Generator().manual_seed(seed)) < density
    runs = _runs_of(layout, random.Random(seed), mode)
    made = layout_from_runs(runs, H, Mq, Mk)
    assert torch.equal(made, layout) and made.is_contiguous()
    if os.environ.get("TRITON_INTERPRET") == "1":  # the GPU builders' one launch (`index_gpu.runs_layout`)
        from sparse_flash import index_gpu

        with mock.patch.object(mask_index, "_on_gpu", lambda t: True), \
                mock.patch.object(index_gpu, "runs_layout", wraps=index_gpu.runs_layout) as built:
            made = layout_from_runs(runs, H, Mq, Mk)
        assert built.call_count == 1 and torch.equal(made, layout) and made.is_contiguous()
    index = mask_index.build_index(layout, (bq, bk), Nq, Nk)
    got = mask_index.run_sizes(runs, H, (bq, bk), Nq, Nk)
    want = []
    for flag in (False, True):
        kernel = index.kernel[flag]
        want += [index.rows[flag].indices.numel(), kernel.row_full.indices.numel(), kernel.row_partial.indices.numel()]
        assert got.longest[flag] == (int(index.rows[flag].counts.max()), int(index.cols[flag].counts.max()))
        rows, cols = got.lists[flag]
        assert torch.equal(rows, index.rows[flag].counts.long()) and torch.equal(cols, index.cols[flag].counts.long())
    assert list(got.totals) == want


@st.composite
def patterns(draw, Mq: int, Mk: int) -> dict:
    """Keyword arguments of `masks._common.pattern_runs` on a grid of Mq x Mk blocks: a band of drawn offsets and
    width (or none), column and row ranges reaching past the grid, empty or overlapping, causal or not."""
    i = torch.arange(Mq)
    pattern = {"causal": draw(st.booleans())}
    if draw(st.booleans()):
        shift, before, after = draw(st.integers(-3, 3)), draw(st.integers(0, 5)), draw(st.integers(0, 6))
        pattern["band"] = (i + shift - before, i + shift + after)
    ranges = st.tuples(st.integers(-2, max(Mq, Mk) + 1), st.integers(0, 3)).map(lambda r: (r[0], r[0] + r[1]))
    pattern["columns"] = draw(st.lists(ranges, max_size=5))
    pattern["rows"] = draw(st.lists(ranges, max_size=2))
    return pattern


@settings(deadline=None)
@given(data=st.data(), Nq=st.integers(1, 600), Nk=st.integers(1, 600), bq=st.sampled_from([16, 32, 48]),
       bk=st.sampled_from([16, 32, 64]), heads=st.integers(1, 4))
def test_pattern_sizes_equal_those_counted_from_the_patterns_runs(data, Nq, Nk, bq, bk, heads):
    """`pattern_sizes` counts from a pattern (band, columns, rows, causal: one per head, heads sharing them) the
    totals, longest lists and every list's count that `run_sizes` counts from its runs (`pattern_runs`), for
    both causal flags, with and without sequence tails."""
    from sparse_flash.mask_index import run_sizes
    from sparse_flash.masks._common import geometry, joined_runs, pattern_runs, pattern_sizes

    geo = geometry(Nq, (bq, bk), Nk)
    Mq = geo.num_blocks_q
    drawn = data.draw(st.lists(patterns(Mq, geo.num_blocks_k), min_size=1, max_size=3))
    head_pattern = data.draw(st.lists(st.integers(0, len(drawn) - 1), min_size=heads, max_size=heads))
    runs = [pattern_runs(geo, **pattern) for pattern in drawn]
    runs = joined_runs(*(runs[p]._replace(row=runs[p].row + h * Mq) for h, p in enumerate(head_pattern)))
    want, got = run_sizes(runs, heads, (bq, bk), Nq, Nk), pattern_sizes(geo, drawn, head_pattern)
    assert (got.totals, got.longest) == (want.totals, want.longest)
    for flag in (False, True):
        assert all(torch.equal(a, b) for a, b in zip(got.lists[flag], want.lists[flag]))


@st.composite
def fixed_patterns(draw):
    """`(L, G, P, causal, horizontal)` of a valid `masks.fixed`: G global blocks of each of P patterns fit in a
    window of L blocks, and horizontal global attention is not causal (drawn in that order: no filtering)."""
    L = draw(st.integers(1, 6))
    G = draw(st.integers(1, L))
    P = draw(st.integers(1, min(3, L // G)))
    causal = draw(st.booleans())
    return L, G, P, causal, False if causal else draw(st.booleans())


@settings(max_examples=examples(8), deadline=None)
@given(N=st.integers(1, 400), b=st.sampled_from([16, 32]), pattern=fixed_patterns(), extra_heads=st.integers(0, 2),
       builder=st.sampled_from(["triton", "torch"]))
def test_fixed_with_too_many_runs_to_list_builds_without_waiting(N, b, pattern, extra_heads, builder):
    """Past `MAX_LISTED_RUNS` (a global column every few blocks on a long grid: `masks.fixed(65536, 128)` has
    131,584 runs) `fixed` makes its layout on the device (`index_gpu.fixed_layout`, or the torch operators
    without Triton) and counts its lists' sizes from the pattern (`pattern_sizes`): the layout that it lists
    otherwise, built by the GPU builders (here under TRITON_INTERPRET=1) without a device wait, with the lists
    of `from_layout`."""
    import sys

    from sparse_flash import mask_index

    L, G, P, causal, horizontal = pattern
    kwargs = dict(num_local_blocks=L, num_global_blocks=G, causal=causal, horizontal_global_attention=horizontal,
                  num_different_global_patterns=P, num_heads=P + extra_heads if P > 1 or extra_heads else None)
    listed = masks.fixed(N, b, **kwargs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys.modules["sparse_flash.masks.fixed"], "MAX_LISTED_RUNS", -1)
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if interpreted:
            patch.setattr(mask_index, "_on_gpu", lambda t: True)
        if builder == "torch":  # the layout by the torch operators, its lists by the GPU builders
            patch.setattr(sys.modules["sparse_flash.masks.fixed"], "gpu_builders", lambda t: None)
        with DeviceWaits(patch) as counter:
            made = masks.fixed(N, b, **kwargs)
    assert listed._runs is not None and made._runs is None
    assert torch.equal(made.layout, listed.layout) and made.name == listed.name
    assert counter.waits == 0 or not interpreted
    _assert_same_index(made._index, mask_index.build_index(made.layout, made.block_size, made.seq_len_q,
                                                           made.seq_len_k))


def test_host_tables_are_counted_on_one_thread_and_the_threads_come_back():
    """`mask_index.one_host_thread`: the builds' host operators on one intra-op thread (tuning log step 118),
    the caller's thread count restored after them, after an error too; a CPU layout's build keeps its threads."""
    from sparse_flash.mask_index import one_host_thread
    from sparse_flash.masks import _common

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        counts = _common._pattern_counts

        def spy(*args, **kwargs):
            seen.append(torch.get_num_threads())
            return counts(*args, **kwargs)

        with mock.patch.object(_common, "_pattern_counts", spy):
            _common.pattern_sizes(_common.geometry(512, 64), [dict(band=(torch.arange(8), torch.arange(8) + 1))], [0])
        assert seen == [1] and torch.get_num_threads() == 2
        with one_host_thread("cpu"):
            assert torch.get_num_threads() == 2
        with pytest.raises(KeyError), one_host_thread():
            with one_host_thread():
                assert torch.get_num_threads() == 1
            raise KeyError
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_fixed_layout_kernel_equals_the_torch_operators_on_small_grids():
    """`index_gpu.fixed_layout` against `masks.fixed`'s torch operators on every small grid and pattern: windows
    that fit the grid or not, global columns clamped to its end, several patterns, both flags, global rows."""
    import sys

    from sparse_flash import mask_index
    from sparse_flash.masks._common import geometry

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("runs Triton on the CPU under TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fixed = sys.modules["sparse_flash.masks.fixed"]
    for M, L in itertools.product((1, 4, 5, 11), range(1, 6)):  # windows that fit, a partial last one
        geo = geometry(M * 16, 16)
        for G, P, causal, horizontal in itertools.product(range(1, L + 1), (1, 2, 3), (False, True), (False, True)):
            if P * G > L or (causal and horizontal):
                continue
            with mock.patch.object(mask_index, "_on_gpu", lambda t: True):
                made = fixed._layout(geo, P + 1, L, G, P, causal, horizontal, device)
            with mock.patch.object(fixed, "gpu_builders", lambda t: None):
                want = fixed._layout(geo, P + 1, L, G, P, causal, horizontal, "cpu")
            assert torch.equal(made.cpu(), want), (M, L, G, P, causal, horizontal)


# Every constructor that lists its blocks on the host (`pattern_runs`, `diagonal_runs`, the butterfly's grid)
LISTED = {
    "butterfly": lambda Nq, Nk, b, p: masks.butterfly(Nq, b, seq_len_k=Nk, n_factors=p or None, num_global_blocks=p % 2),
    "local": lambda Nq, Nk, b, p: masks.local(Nq, b, seq_len_k=Nk, window=p),
    "local_causal": lambda Nq, Nk, b, p: masks.local(Nq, b, seq_len_k=Nk, window=p, causal=True),
    "dense": lambda Nq, Nk, b, p: masks.dense(Nq, b, seq_len_k=Nk),
    "causal": lambda Nq, Nk, b, p: masks.causal(Nq, b, seq_len_k=Nk),
    "global": lambda Nq, Nk, b, p: masks.global_(Nq, b, seq_len_k=Nk, num_global_blocks=p),
    # two global ranges where the longer grid has room for them (4 blocks), one global block otherwise
    "longformer": lambda Nq, Nk, b, p: masks.longformer(
        Nq, b, seq_len_k=Nk, num_sliding_window_blocks=2 * p + 1, causal=p % 2 == 1,
        **({"global_block_indices": (0,)} if p < 3 or max(-(-Nq // b[0]), -(-Nk // b[1])) < 4 else
           {"global_block_indices": (0, 2), "global_block_end_indices": (1, 4)})),
    "strided": lambda Nq, Nk, b, p: masks.strided(Nq, b[0], stride=p + 1, bandwidth=max(1, p - 1)),
    "fixed": lambda Nq, Nk, b, p: masks.fixed(Nq, b[0], num_local_blocks=p + 2, causal=p % 2 == 1, num_heads=2,
                                              num_different_global_patterns=2),
    # tiles of 4 x 4 (16 tokens) on an image of about Nq pixels, 2 x 2 x 4 on a video of about Nk
    "neighborhood_2d": lambda Nq, Nk, b, p: masks.neighborhood_2d(4 * (1 + Nq // 80), 4 * (1 + p), 4,
                                                                  [p % 3, (1, p % 2)]),
    "neighborhood_3d": lambda Nq, Nk, b, p: masks.neighborhood_3d(2 * (1 + p), 4, 4 * (1 + Nk // 100), (2, 2, 4),
                                                                  (1, p % 2, 2)),
    "butterfly_2d": lambda Nq, Nk, b, p: masks.butterfly_2d(4 * (1 + Nq // 40), 4 * (3 + p), 4, n_factors=p or None),
}
ONE_GRID = sorted(set(LISTED) - {"neighborhood_2d", "neighborhood_3d", "butterfly_2d"})  # lengths as given


@pytest.mark.parametrize("build", [
    lambda d: masks.butterfly(128 * 40 + 50, 128, device=d),
    lambda d: masks.butterfly(700, 64, seq_len_k=2000, n_factors=3, device=d),
    lambda d: masks.butterfly(128 * 96 + 50, 128, num_global_blocks=2, device=d),
    lambda d: masks.butterfly(128 * 40 + 50, 128, butterfly_size=16, num_global_blocks=1, device=d),
    lambda d: masks.butterfly(900, 64, seq_len_k=2000, butterfly_size=6, device=d),
    lambda d: masks.local(128 * 40 + 50, 128, window=3, device=d),
    lambda d: masks.local(1000, (64, 32), seq_len_k=700, window=2, causal=True, device=d),
    lambda d: masks.longformer(128 * 96 + 50, 128, global_block_indices=(0, 9), causal=True, device=d),
    lambda d: masks.fixed(128 * 40, 128, num_local_blocks=8, num_heads=3, num_different_global_patterns=2, device=d),
], ids=["butterfly", "butterfly_cross", "butterfly_global", "butterfly_size", "butterfly_size_cross", "local", "local_causal_cross", "longformer", "fixed"])
def test_constructors_that_list_their_blocks_build_without_waiting(build, monkeypatch):
    """Masks that list their blocks as runs on the host count their lists' sizes there (`run_sizes`), and
    the plans of lists cut into chunks (global rows and columns) from those counts: built by the GPU builders
    (here under TRITON_INTERPRET=1) they never wait for the device, and their lists and plans equal those
    built from the layout alone."""
    from sparse_flash import mask_index

    from sparse_flash import index_gpu

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton on the CPU under TRITON_INTERPRET=1")
    with mock.patch.object(mask_index, "_on_gpu", lambda t: True), DeviceWaits(monkeypatch) as counter, \
            mock.patch.object(index_gpu, "plan_sizes", side_effect=AssertionError("chunks counted on the device")):
        m = build("cpu")
    monkeypatch.undo()
    assert counter.waits == 0  # and the chunks of cut lists come from the host's counts (`_host_split`)
    want = BlockMask.from_layout(m.layout, m.block_size, seq_len_q=m.seq_len_q, seq_len_k=m.seq_len_k)
    _assert_same_index(m._index, want._index)


def test_butterfly_global_blocks_are_its_first_rows_and_columns():
    """The butterfly's global rows and columns join its listed blocks once each (and past the grid's short
    side they add only what fits)."""
    plain = masks.butterfly(1000, 64, seq_len_k=3000).layout[0, 0]
    for g in (1, 2, 40):
        got = masks.butterfly(1000, 64, seq_len_k=3000, num_global_blocks=g).layout[0, 0]
        want = plain.clone()
        want[:g, :] = True
        want[:, :g] = True
        assert torch.equal(got, want) and masks.butterfly(1000, 64, seq_len_k=3000, num_global_blocks=g).nnz == int(want.sum())


@pytest.mark.parametrize("pattern", sorted(LISTED))
@settings(max_examples=examples(4), deadline=None)
@given(Nq=st.integers(1, 400), Nk=st.integers(1, 400), bq=st.sampled_from([16, 32, 48]), bk=st.sampled_from([16, 64]),
       param=st.integers(0, 4))
def test_listed_constructors_equal_their_layouts_on_drawn_geometries(pattern, Nq, Nk, bq, bk, param):
    """Every constructor that lists its blocks (`LISTED`), built by the GPU builders from its host-counted sizes
    (here under TRITON_INTERPRET=1), holds the index of its layout built the usual way, on drawn lengths,
    tails and block sizes, and no build waits for the device."""
    from sparse_flash import mask_index

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton on the CPU under TRITON_INTERPRET=1")
    with pytest.MonkeyPatch.context() as patch:
        with mock.patch.object(mask_index, "_on_gpu", lambda t: True), DeviceWaits(patch) as counter:
            m = LISTED[pattern](Nq, Nk, (bq, bk) if pattern not in ("strided", "fixed") else (bq, bq), param)
    assert counter.waits == 0
    _assert_same_index(m._index, mask_index.build_index(m.layout, m.block_size, m.seq_len_q, m.seq_len_k))


@settings(max_examples=examples(12), deadline=None)
@given(N=st.integers(1, 256), b=st.sampled_from([16, 32]), first=st.sampled_from(sorted(ONE_GRID)),
       second=st.sampled_from(sorted(ONE_GRID)), p=st.integers(0, 4), q=st.integers(0, 4))
@pytest.mark.parametrize("op", ["|", "&"])
def test_unions_and_intersections_of_listed_masks_are_listed_too(op, N, b, first, second, p, q):
    """`a | b` and `a & b` of two masks that listed their blocks (`LISTED`, one geometry; fixed has two heads,
    broadcast against one) list their blocks too (`mask_index.union_runs`, `complement_runs`): the layouts'
    union or intersection, built by the GPU builders (here under TRITON_INTERPRET=1) without a device wait, with
    the lists of `from_layout`."""
    from sparse_flash import mask_index

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton on the CPU under TRITON_INTERPRET=1")
    a, c = LISTED[first](N, N, (b, b), p), LISTED[second](N, N, (b, b), q)
    with pytest.MonkeyPatch.context() as patch:
        with mock.patch.object(mask_index, "_on_gpu", lambda t: True), DeviceWaits(patch) as counter:
            both = a | c if op == "|" else a & c
    assert counter.waits == 0 and both._runs is not None
    assert torch.equal(both.layout, a.layout | c.layout if op == "|" else a.layout & c.layout)
    assert both.name == (f"{a.name} | {c.name}" if op == "|" else f"({a.name}) & ({c.name})")
    _assert_same_index(both._index, mask_index.build_index(both.layout, both.block_size, both.seq_len_q,
                                                           both.seq_len_k))


@settings(deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 3), M=st.lists(st.integers(1, 9), min_size=4, max_size=4),
       chunk=st.integers(1, 6), data=st.data())
def test_host_split_equals_the_plan_batch(B, H, M, chunk, data):
    """`mask_index._host_split` counts from the lists' counts on the host the chunks of every list, their prefix
    sums and the four plans' sizes that the plan batch counts (`_plan_batch`, `_plan_sizes`) and that
    `_split_plans_on_gpu` sums, lists of one block to lists cut into more than `SPLIT_MAX_CHUNKS` chunks."""
    from sparse_flash import mask_index

    lengths = st.integers(0, chunk * (mask_index.SPLIT_MAX_CHUNKS + 2))
    counts = [torch.tensor(data.draw(st.lists(lengths, min_size=B * H * m, max_size=B * H * m))).view(B, H, m)
              for m in M]
    inputs = [mask_index._PlanInput(c.to(torch.int32), chunk + p, 1.0, None, None) for p, c in enumerate(counts)]
    longest = {flag: tuple(int(c.max()) for c in pair) for flag, pair in ((False, counts[:2]), (True, counts[2:]))}
    layout_sizes = mask_index.LayoutSizes((), longest, {False: counts[:2], True: counts[2:]})
    n, firsts, base, sizes = mask_index._host_split(inputs, layout_sizes, "cpu")
    batch = mask_index._plan_batch(inputs)
    assert torch.equal(n, batch.n) and base == batch.base
    assert sizes == mask_index._plan_sizes(batch).tolist()
    is_split = (batch.n > 1).long()
    want = torch.nn.functional.pad(torch.stack([batch.n * is_split, is_split]).cumsum(1), (1, 0))
    assert torch.equal(firsts, want)


@settings(max_examples=examples(8), deadline=None)
@given(m=layouts())
def test_a_mask_moved_to_a_gpu_builds_its_lists_from_its_own_sizes(m):
    """`mask.to("cuda")` of a CPU mask hands the GPU builders the sizes of the mask's own lists and their counts
    (`BlockMask._list_sizes`), so the copy waits for the device at no point: built so (here under
    TRITON_INTERPRET=1), every list and plan equals the one built from the layout alone."""
    from sparse_flash import mask_index

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton on the CPU under TRITON_INTERPRET=1")
    sizes = m._list_sizes()
    with pytest.MonkeyPatch.context() as patch:
        with mock.patch.object(mask_index, "_on_gpu", lambda t: True), DeviceWaits(patch) as counter:
            got = mask_index.build_index(m.layout, m.block_size, m.seq_len_q, m.seq_len_k, sizes)
    assert counter.waits == 0  # also where lists are cut: their plans come from the lists' counts
    _assert_same_index(got, m._index)


@pytest.mark.parametrize("block", [(128, 128), (256, 128), (128, 256), (256, 256)])
@settings(max_examples=examples(5), deadline=None)
@given(blocks=st.integers(1, 5), density=st.floats(0.1, 1.0), seed=st.integers(0, 2**16))
def test_causal_lists_leave_the_element_mask_to_each_items_last_tile(block, blocks, density, seed):
    """The Hopper forward masks only the last live tile of an item (tuning log, step 104): walking a query
    block's causal full list, then its partial list, each block as 128-key tiles, the tiles that start at or
    before a 128-row item's last row come first (the kernel counts them and takes that many), and every one of
    them but the last is wholly allowed for the item's rows. Lengths are multiples of 128 and of the blocks,
    as that kernel requires."""
    bq, bk = block
    n = blocks * max(bq, bk)
    layout = torch.rand(1, 1, n // bq, n // bk, generator=torch.Generator().manual_seed(seed)) < density
    index, _ = BlockMask.from_layout(layout, block, seq_len_q=n, seq_len_k=n).kernel_records(True)
    assume(index is not None)  # every causal block held: the dense causal walk, no lists
    full, part = index.row_full, index.row_partial
    for i in range(n // bq):
        walk = [full.indices[full.offsets[i]:full.offsets[i + 1]], part.indices[part.offsets[i]:part.offsets[i + 1]]]
        tiles = [int(j) * bk + t for side in walk for j in side for t in range(0, bk, 128)]
        for first_row in range(i * bq, (i + 1) * bq, 128):
            live = [start for start in tiles if start <= first_row + 127]
            assert tiles[:len(live)] == live, (i, first_row, tiles)
            assert all(start + 127 <= first_row for start in live[:-1]), (i, first_row, tiles)

"""Masks chosen from the data: BlockMask.from_topk and from_scores, their static-shape index lists, every
backend on them (forward and backward), the waits for the device, bad input, and the MoBA layer."""

import itertools
import math
import os
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from conftest import DEVICE, DeviceWaits, triton_usable
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_layout import check_work_items, lists_from_index

import sparse_flash
from sparse_flash import BlockMask, mask_index
from sparse_flash.mask_index import HEAVY_FACTOR
from sparse_flash.nn import MoBAAttention
from sparse_flash.testing import compare_to_reference, make_qkv

BACKENDS = ["reference", "torch"] + (["triton"] if triton_usable() else [])
FEWER = max(1, settings().max_examples * 2 // 5)  # attention draws under the Triton interpreter are the slow ones


@dataclass(frozen=True)
class TopK:
    """A from_topk problem: scores of shape (B, H, Mq, Mk) drawn from `seed`, `k` an int or one per head."""

    B: int
    H: int
    Mq: int
    Mk: int
    block_q: int
    block_k: int
    Nq: int
    Nk: int
    k: int | tuple
    causal: bool
    ties: bool  # scores from a few values (many ties) rather than a continuous draw
    seed: int

    def scores(self, device="cpu"):
        gen = torch.Generator().manual_seed(self.seed)
        shape = (self.B, self.H, self.Mq, self.Mk)
        s = torch.randint(0, 3, shape, generator=gen).float() if self.ties else torch.randn(shape, generator=gen)
        return s.to(device)

    def mask(self, scores=None, **kwargs):
        return BlockMask.from_topk(self.scores() if scores is None else scores, self.k, causal=self.causal,
                                   block_size=(self.block_q, self.block_k), seq_len_q=self.Nq, seq_len_k=self.Nk,
                                   **kwargs)

    @property
    def exact(self) -> bool:
        """Square blocks and no sequence tails: the static partial lists are exactly build_index's."""
        return self.block_q == self.block_k and self.Nq == self.Mq * self.block_q and self.Nk == self.Mk * self.block_k


@st.composite
def topk_problems(draw, block_sizes=(16, 32, 48), max_blocks=8):
    B, H = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 3]))
    bq, bk = draw(st.sampled_from(block_sizes)), draw(st.sampled_from(block_sizes))
    Mq, Mk = draw(st.integers(1, max_blocks)), draw(st.integers(1, max_blocks))
    if draw(st.booleans()):  # square blocks without tails, the exact case, half of the time
        bk, Nq, Nk = bq, Mq * bq, Mk * bq
    else:
        Nq = draw(st.integers((Mq - 1) * bq + 1, Mq * bq))
        Nk = draw(st.integers((Mk - 1) * bk + 1, Mk * bk))
    per_head = H > 1 and draw(st.booleans())
    k = tuple(draw(st.lists(st.integers(1, Mk), min_size=H, max_size=H))) if per_head else draw(st.integers(1, Mk))
    return TopK(B, H, Mq, Mk, bq, bk, Nq, Nk, k, draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 999)))


EDGES = [
    TopK(1, 1, 1, 1, 16, 16, 16, 16, 1, True, False, 0),  # one block
    TopK(1, 3, 5, 5, 32, 32, 160, 160, 5, True, True, 1),  # k = Mk: the causal mask itself (covers_causal)
    TopK(2, 1, 6, 6, 16, 16, 96, 96, 6, False, True, 2),  # k = Mk, not causal: the dense mask
    TopK(1, 2, 2, 7, 32, 16, 40, 100, 4, False, False, 3),  # queries shorter than keys: covers_causal read
    TopK(1, 3, 6, 6, 48, 16, 280, 90, (1, 3, 6), True, True, 4),  # per head, rectangular blocks, tails
]


def plain_topk(p: TopK, scores: torch.Tensor) -> torch.Tensor:
    """The layout from_topk must choose, row by row in Python: the k best candidates (higher score first, then
    lower key block); with `causal`, the candidates hold a causal pair and the last of them is always kept."""
    ks = p.k if isinstance(p.k, tuple) else (p.k,) * p.H
    layout = torch.zeros(p.B, p.H, p.Mq, p.Mk, dtype=torch.bool)
    s = scores.cpu().tolist()
    for b in range(p.B):
        for h in range(p.H):
            for i in range(p.Mq):
                last_query = min((i + 1) * p.block_q, p.Nq) - 1
                cands = [j for j in range(p.Mk) if not p.causal or j * p.block_k <= last_query]
                n = min(ks[h], len(cands))
                forced = cands[-1:] if p.causal else []
                rest = sorted((j for j in cands if j not in forced), key=lambda j: (-s[b][h][i][j], j))
                for j in forced + rest[: n - len(forced)]:
                    layout[b, h, i, j] = True
    return layout


@given(p=topk_problems())
@example(p=EDGES[0])
@example(p=EDGES[1])
@example(p=EDGES[2])
@example(p=EDGES[3])
@example(p=EDGES[4])
def test_topk_layout_is_a_plain_topk(p):
    scores = p.scores()
    m = p.mask(scores)
    assert m.shape == (p.B, p.H, p.Mq, p.Mk) and (m.seq_len_q, m.seq_len_k) == (p.Nq, p.Nk)
    assert torch.equal(m.layout, plain_topk(p, scores))
    if not p.ties:  # without ties the choice is torch.topk's among the (other) candidates
        for b, h, i in [(0, p.H - 1, p.Mq - 1), (p.B - 1, 0, 0)]:
            kh = p.k[h] if isinstance(p.k, tuple) else p.k
            row = scores[b, h, i].clone()
            if p.causal:
                last = int(m.layout[b, h, i].nonzero().max())  # the diagonal: the last kept block
                row[last + 1:] = -math.inf
                row[last] = math.inf
            n = min(kh, int(torch.isfinite(row).sum()) + (1 if p.causal else 0))
            assert set(torch.topk(row, n).indices.tolist()) == set(m.layout[b, h, i].nonzero().flatten().tolist())


def _lists(index):
    return lists_from_index(index)


@given(p=topk_problems())
@example(p=EDGES[1])
@example(p=EDGES[3])
@example(p=EDGES[4])
def test_topk_index_agrees_with_build_index(p):
    """The static lists hold what build_index's hold: the same live rows and columns, the same sizes; every
    block needing an element mask is partial, and in the exact case (square blocks, no tails) the full and
    partial lists and the work plans are build_index's (when its plan splits nothing)."""
    m = p.mask()
    ref = BlockMask.from_layout(m.layout.clone(), (p.block_q, p.block_k), seq_len_q=p.Nq, seq_len_k=p.Nk)
    assert (m.nnz, m.is_dense, m.covers_causal) == (ref.nnz, ref.is_dense, ref.covers_causal)
    for causal in (False, True):
        assert m.longest_row(causal) == ref.longest_row(causal)
        assert m.has_long_lists(causal) == ref.has_long_lists(causal)
        for ours, theirs in ((m.row_index(causal), ref.row_index(causal)), (m.col_index(causal), ref.col_index(causal))):
            for a, b in zip(ours, theirs):
                assert torch.equal(a, b)
        mine, want = m.kernel_index(causal), ref.kernel_index(causal)
        for full, part, ref_full, ref_part in ((mine.row_full, mine.row_partial, want.row_full, want.row_partial),
                                               (mine.col_full, mine.col_partial, want.col_full, want.col_partial)):
            for f, q, rf, rq in zip(_lists(full), _lists(part), _lists(ref_full), _lists(ref_part)):
                assert set(f) <= set(rf) and set(q) >= set(rq) and sorted(f + q) == sorted(rf + rq)
            if p.exact or (not p.causal and causal):  # the non-causal mask's causal lists are build_index's
                for a, b in zip((*full, *part), (*ref_full, *ref_part)):
                    assert torch.equal(a, b)
        check_work_items(mine.row_full, mine.row_partial, mine.row_plan)
        check_work_items(mine.col_full, mine.col_partial, mine.col_plan)
        static = p.causal or not causal  # built without reading the device: nothing is split
        for plan, theirs, live in ((mine.row_plan, want.row_plan, m.row_index(causal)),
                                   (mine.col_plan, want.col_plan, m.col_index(causal))):
            if static:
                assert plan.chunks.eq(1).all() and plan.split.numel() == 0 and plan.slot_list.numel() == 0
                mean = live.counts.sum().item() / live.counts.numel()  # lead: ranks holding a heavy item
                assert plan.lead.item() == int((live.counts > HEAVY_FACTOR * mean).sum(-1).max())
            if (p.exact or not static) and theirs.split.numel() == 0:
                for a, b in zip(plan, theirs):
                    assert torch.equal(a, b)


@given(p=topk_problems(), tile=st.sampled_from([1, 4, 16, 8192]))
@example(p=EDGES[0], tile=8192)
@example(p=EDGES[1], tile=1)
@example(p=EDGES[4], tile=4)
def test_topk_lists_and_plans_built_on_the_gpu_equal_the_torch_ones(p, tile):
    """`sparse_flash.index_gpu` (programs of a few rows for the row lists, one per column, one per plan; here
    under TRITON_INTERPRET=1, as on a GPU, with `tile` slots per row or column program: from one row or
    column per program to whole heads) builds the index that the torch operators build: every list and plan of every flag the mask
    builds without reading the device."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton on the CPU under TRITON_INTERPRET=1")
    scores = p.scores()
    want = p.mask(scores)
    from sparse_flash import index_gpu

    with mock.patch.object(mask_index, "_on_gpu", lambda t: True), mock.patch.object(index_gpu, "ROW_TILE", tile), \
            mock.patch.object(index_gpu, "COLUMN_TILE", tile), mock.patch.object(index_gpu, "PLAN_TILE", tile), \
            mock.patch.object(index_gpu, "topk_lists", wraps=index_gpu.topk_lists) as lists, \
            mock.patch.object(index_gpu, "unsplit_plans", wraps=index_gpu.unsplit_plans) as plans, \
            mock.patch.object(index_gpu, "choose_topk", wraps=index_gpu.choose_topk) as choice:
        got = p.mask(scores)
        assert (lists.call_count, plans.call_count, choice.call_count) == (1, 1, 1)  # the mask's own flag
        assert len(plans.call_args.args[0]) == 2  # its row and column plans, in one launch
        if p.causal:  # its non-causal lists: on first use, by the same launches
            got.kernel_index(False)
            assert (lists.call_count, plans.call_count) == (2, 2)
    assert torch.equal(got.layout, want.layout) and (got.nnz, got.covers_causal) == (want.nnz, want.covers_causal)
    for causal in (True, False) if p.causal else (False, ):  # a non-causal mask builds its causal lists on use
        for a, b in ((got.row_index(causal), want.row_index(causal)), (got.col_index(causal), want.col_index(causal)),
                     *zip(got.kernel_index(causal), want.kernel_index(causal))):
            for name, x, y in zip(a._fields, a, b):
                assert x.dtype == y.dtype and torch.equal(x, y), (causal, type(a).__name__, name)


@pytest.mark.parametrize("causal", [True, False])
def test_topk_choice_on_the_gpu_ranks_nan_infinities_and_signed_zeros_as_torch_does(causal):
    """`index_gpu.choose_topk` (under TRITON_INTERPRET=1) makes the torch choice (`mask._choose_topk`) and its
    layout: NaN ranks as -inf, -0.0 equals 0.0 (the lower block wins), infinities and ties, fp16 scores, rows
    keeping none, some or all of their candidates."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton on the CPU under TRITON_INTERPRET=1")
    from sparse_flash import index_gpu
    from sparse_flash.mask import _choose_topk

    values = torch.tensor([0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), float("-inf"), 2.0, 1.0, -0.0])
    gen = torch.Generator().manual_seed(1)
    scores = values[torch.randint(0, values.numel(), (1, 2, 9, 11), generator=gen)]
    geometry = (9, 11, 16, 16, 9 * 16, 11 * 16)
    cand = mask_index.candidates(causal, geometry, "cpu")
    for dtype, ks in ((torch.float32, (1, 3, 11)), (torch.float16, (2, 5))):
        for k in ks:
            counts = mask_index.topk_counts((k, ), causal, geometry, "cpu", cand)
            width = mask_index.topk_sizes((k, ), causal, 1, 2, geometry).longest_row
            want = _choose_topk(scores.to(dtype), counts, width, causal, cand)
            layout = torch.zeros(1, 2, 9, 12, dtype=torch.bool).scatter_(-1, want, True)[..., :11]
            got, got_layout = index_gpu.choose_topk(scores.to(dtype), counts, width, causal, cand)
            assert torch.equal(got, want) and torch.equal(got_layout, layout), (dtype, k)


@given(p=topk_problems(block_sizes=(16, 32), max_blocks=5), backend=st.sampled_from(BACKENDS))
@settings(max_examples=FEWER)
@example(p=EDGES[1], backend=BACKENDS[-1])
@example(p=EDGES[4], backend=BACKENDS[-1])
def test_attention_with_topk_mask_matches_reference(p, backend):
    """Forward and gradients of q, k, v on every backend against the float64 reference with the mask
    materialised (2x rule); the non-causal masks with causal=True too (their causal lists built on use)."""
    q, k, v = make_qkv(p.B, p.H, 1, p.Nq, p.Nk, 16, dtype=torch.float32, device=DEVICE, seed=p.seed)
    mask = p.mask(p.scores(DEVICE))
    for causal in {p.causal, True}:
        result = compare_to_reference(q, k, v, mask, causal=causal, backend=backend)
        assert not result.failures(), f"{p}, causal={causal}: {result.failures()}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_scores_get_no_gradient(backend):
    p = EDGES[4]
    scores = p.scores(DEVICE).requires_grad_()
    mask = p.mask(scores)
    q, k, v = make_qkv(p.B, p.H, p.H, p.Nq, p.Nk, 16, dtype=torch.float32, device=DEVICE, seed=0)
    sparse_flash.block_sparse_attention(q, k, v, mask, causal=True, backend=backend).square().sum().backward()
    assert scores.grad is None and not mask.layout.requires_grad
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))


# ---------------------------------------------------------------------------------------------- device waits
SYNCING_OPS = (torch.ops.aten.bincount.default, torch.ops.aten._local_scalar_dense.default,
               torch.ops.aten.unique_dim.default, torch.ops.aten._unique2.default)


@pytest.mark.parametrize("p", [EDGES[4], TopK(2, 3, 9, 9, 32, 32, 280, 260, 3, False, False, 5),
                               TopK(1, 2, 8, 8, 64, 64, 512, 512, (2, 5), True, False, 6)],
                         ids=["per-head-causal-tails", "non-causal-tails", "square"])
@pytest.mark.parametrize("builder", ["torch", "triton"])
def test_from_topk_never_waits_for_the_device(p, builder, monkeypatch):
    """No value read on the host and no operator sized by the data (bincount, unique included): every size
    comes from k and the geometry, with the torch operators and with the Triton launches (`index_gpu`, here
    under TRITON_INTERPRET=1). The finiteness check is the one read, skipped with check_finite=False."""
    if builder == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton on the CPU under TRITON_INTERPRET=1")
    scores = p.scores()
    with mock.patch.object(mask_index, "_on_gpu", lambda t: builder == "triton"), \
            DeviceWaits(monkeypatch, ops=SYNCING_OPS) as counter:
        m = p.mask(scores, check_finite=False)
        m.kernel_records(p.causal)
    monkeypatch.undo()
    assert counter.waits == 0
    assert torch.equal(m.layout, plain_topk(p, scores))
    with DeviceWaits(monkeypatch) as counter:
        p.mask(scores)
    monkeypatch.undo()
    assert counter.waits == 1  # check_finite: one read


def test_non_causal_topk_waits_only_where_the_causal_lists_are_used(monkeypatch):
    """A non-causal choice says nothing of its causal lists: they are build_index's, built on first use (its
    three waits); and whether the mask covers every causal block is read at once only when it can (queries
    shorter than keys and k at least a row's causal candidates)."""
    p = TopK(1, 2, 6, 6, 32, 32, 192, 192, 2, False, False, 7)
    with DeviceWaits(monkeypatch, ops=SYNCING_OPS) as counter:
        m = p.mask(check_finite=False)
    monkeypatch.undo()
    assert counter.waits == 0 and m.covers_causal is False
    with DeviceWaits(monkeypatch) as counter:
        m.kernel_index(True)
        m.row_index(True)  # built once for every list of the flag
    monkeypatch.undo()
    assert counter.waits == 3
    with DeviceWaits(monkeypatch) as counter:
        short = EDGES[3].mask(check_finite=False)
    monkeypatch.undo()
    assert counter.waits == 1 and short.covers_causal == BlockMask.from_layout(
        short.layout.clone(), (32, 16), seq_len_q=40, seq_len_k=100).covers_causal


def test_from_scores_keeps_blocks_above_the_threshold_and_the_diagonal():
    scores = torch.tensor([[0.9, 0.1, 0.8, 0.0], [0.2, 0.1, 0.3, 0.7], [0.1, 0.9, 0.2, 0.6]])[None, None]
    m = BlockMask.from_scores(scores, 0.5, block_size=16)
    assert m.layout[0, 0].int().tolist() == [[1, 0, 1, 0], [0, 1, 0, 1], [0, 1, 1, 1]]
    causal = BlockMask.from_scores(scores, 0.5, causal=True, block_size=(32, 16), seq_len_q=90, seq_len_k=64)
    # query block i's last query is min(32 i + 31, 89): key blocks up to 1, 3 and 3 hold a causal pair
    assert causal.layout[0, 0].int().tolist() == [[1, 1, 0, 0], [0, 0, 0, 1], [0, 1, 0, 1]]
    assert "scores > 0.5" in repr(causal)


@pytest.mark.parametrize("backend", BACKENDS)
def test_from_scores_attention_matches_reference(backend):
    scores = torch.randn(2, 2, 4, 3, generator=torch.Generator().manual_seed(0))
    mask = BlockMask.from_scores(scores.to(DEVICE), 0.3, causal=True, block_size=(32, 48), seq_len_q=100,
                                 seq_len_k=130)
    q, k, v = make_qkv(2, 2, 2, 100, 130, 16, dtype=torch.float32, device=DEVICE, seed=1)
    result = compare_to_reference(q, k, v, mask, causal=True, backend=backend)
    assert not result.failures(), result.failures()


# ---------------------------------------------------------------------------------------------- bad input
GOOD = dict(block_size=16, seq_len_q=64, seq_len_k=64)


@pytest.mark.parametrize("scores, k, kwargs, error, match", [
    (torch.randn(1, 1, 4, 4), 0, {}, ValueError, r"k must be between 1 and Mk = 4 .*got 0"),
    (torch.randn(1, 1, 4, 4), 5, {}, ValueError, r"k must be between 1 and Mk = 4 .*got 5"),
    (torch.randn(1, 2, 4, 4), (1, 9), {}, ValueError, r"got 9 for head 1"),
    (torch.randn(1, 2, 4, 4), torch.tensor([1, 2, 3]), {}, ValueError, r"shape \(H,\) = \(2,\).*got shape \(3,\)"),
    (torch.randn(1, 2, 4, 4), torch.tensor([[1, 2]]), {}, ValueError, r"shape \(H,\) = \(2,\).*got shape \(1, 2\)"),
    (torch.randn(1, 2, 4, 4), torch.tensor([1.0, 2.0]), {}, TypeError, r"integer tensor, got dtype torch.float32"),
    (torch.randn(1, 1, 4, 4), 2.0, {}, TypeError, r"k must be an int.*got float 2.0"),
    (torch.randn(1, 1, 4, 4), True, {}, TypeError, r"k must be an int.*got bool True"),
    (torch.randn(4, 4), 1, {}, ValueError, r"scores must have shape \(B, H, Mq, Mk\).*got shape \(4, 4\)"),
    (torch.randn(1, 1, 1, 4, 4), 1, {}, ValueError, r"got shape \(1, 1, 1, 4, 4\)"),
    (torch.randint(0, 3, (1, 1, 4, 4)), 1, {}, TypeError, r"float16, bfloat16, float32 or float64, got dtype torch.int64"),
    ([[0.0]], 1, {}, TypeError, r"scores must be a torch.Tensor, got list"),
    (torch.tensor([[[[0.0, math.nan], [1.0, 2.0]]]]), 1, dict(seq_len_q=32, seq_len_k=32), ValueError,
     r"scores must be finite .*got 1 non-finite"),
    (torch.tensor([[[[0.0, math.inf], [1.0, 2.0]]]]), 1, dict(seq_len_q=32, seq_len_k=32), ValueError,
     r"scores must be finite"),
    (torch.randn(1, 1, 4, 4), 1, dict(seq_len_q=100), ValueError,
     r"seq_len_q=100 with block size 16 needs ceil\(100/16\) = 7 blocks, but scores.shape\[2\] = 4"),
    (torch.randn(1, 1, 4, 4), 1, dict(block_size=(16, 32)), ValueError,
     r"seq_len_k=64 with block size 32 needs ceil\(64/32\) = 2 blocks, but scores.shape\[3\] = 4"),
    (torch.randn(1, 1, 4, 4), 1, dict(block_size=0), ValueError, r"block_size must be positive"),
    (torch.randn(1, 1, 4, 4), 1, dict(causal=1), TypeError, r"causal must be a bool, got int 1"),
    (torch.randn(1, 1, 0, 4), 1, dict(seq_len_q=None), ValueError, r"at least one batch, head and block"),
], ids=["k0", "k-too-big", "k-per-head-too-big", "k-per-head-shape", "k-per-head-rank", "k-float-tensor",
        "k-float", "k-bool", "rank-2", "rank-5", "int-scores", "list-scores", "nan", "inf", "seq-len-q",
        "block-size-k", "block-size-0", "causal-int", "empty"])
def test_from_topk_refuses_bad_input(scores, k, kwargs, error, match):
    with pytest.raises(error, match=match):
        BlockMask.from_topk(scores, k, **{**GOOD, **kwargs})


@pytest.mark.parametrize("threshold, kwargs, error, match", [
    (math.nan, {}, ValueError, r"threshold must be finite, got nan"),
    ("0.5", {}, TypeError, r"threshold must be a finite real number or a float tensor, got str"),
    (0.5, dict(scores=torch.full((1, 1, 4, 4), math.nan)), ValueError, r"scores must be finite .*16 non-finite"),
    (0.5, dict(scores=torch.randn(3, 4)), ValueError, r"scores must have shape \(B, H, Mq, Mk\)"),
    (0.5, dict(seq_len_k=10), ValueError, r"seq_len_k=10 .* but scores.shape\[3\] = 4"),
])
def test_from_scores_refuses_bad_input(threshold, kwargs, error, match):
    scores = kwargs.pop("scores", torch.randn(1, 1, 4, 4))
    with pytest.raises(error, match=match):
        BlockMask.from_scores(scores, threshold, **{**GOOD, **kwargs})


def test_unchecked_scores_still_give_a_valid_mask():
    """check_finite=False: a NaN ranks as -inf; rows keep their counts and the diagonal whatever the values."""
    scores = torch.tensor([[[[math.nan, 1.0, math.inf, -math.inf], [math.nan] * 4, [0.0] * 4, [1.0] * 4]]])
    m = BlockMask.from_topk(scores, 2, causal=True, block_size=16, check_finite=False)
    assert m.layout[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]]
    m = BlockMask.from_topk(scores, 2, block_size=16, check_finite=False)
    assert m.layout[0, 0].int().tolist() == [[0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]]


def test_topk_masks_are_values():
    p = EDGES[4]
    m = p.mask()
    with pytest.raises(RuntimeError, match="read-only"):
        m.layout[0, 0, 0, 0] = True
    assert m == BlockMask.from_layout(m.layout.clone(), (48, 16), seq_len_q=280, seq_len_k=90)
    import copy
    import pickle

    again = pickle.loads(pickle.dumps(m))
    assert again == m and again.nnz == m.nnz and copy.deepcopy(m) == m
    assert "top-k per head causal" in repr(m) and "top-2" in repr(TopK(1, 1, 2, 2, 16, 16, 32, 32, 2, False,
                                                                        False, 0).mask())


# ---------------------------------------------------------------------------------------------- MoBA layer
def moba_reference(layer: MoBAAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's computation written out densely in float64: block means, gate scores, the chosen key blocks
    (plain_topk) as an element mask with the causal rule, masked softmax. Returns (output, chosen layout)."""
    B, N, E = x.shape
    H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    bq, bk = layer.block_pair
    x = x.double()

    def project(proj, heads):
        return torch.nn.functional.linear(x, proj.weight.double(), None if proj.bias is None else proj.bias.double()
                                          ).view(B, N, heads, D).transpose(1, 2)

    q, k, v = project(layer.q_proj, H), project(layer.k_proj, Hkv), project(layer.v_proj, Hkv)
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    Mq, Mk = -(-N // bq), -(-N // bk)
    q_mean = torch.stack([q[:, :, i * bq:(i + 1) * bq].mean(2) for i in range(Mq)], 2)
    k_mean = torch.stack([k[:, :, j * bk:(j + 1) * bk].mean(2) for j in range(Mk)], 2)
    if layer.causal:  # the gate of block i reads block i - 1's queries (block 0 chooses nothing)
        q_mean = torch.cat([torch.zeros_like(q_mean[:, :, :1]), q_mean[:, :, :-1]], 2)
    scores = q_mean @ k_mean.transpose(-1, -2)
    if layer.causal:  # the key blocks overlapping query block i (keys from i * bq to its last query) always
        for i in range(Mq):
            for j in range(Mk):
                if j * bk <= min((i + 1) * bq, N) - 1 and min((j + 1) * bk, N) > i * bq:
                    scores[:, :, i, j] = math.inf
    layout = plain_topk(TopK(B, H, Mq, Mk, bq, bk, N, N, min(layer.top_k, Mk), layer.causal, False, 0), scores)
    allowed = layout.repeat_interleave(bq, 2).repeat_interleave(bk, 3)[:, :, :N, :N].to(x.device)
    if layer.causal:
        allowed = allowed & torch.ones(N, N, dtype=torch.bool, device=x.device).tril()
    s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    p = torch.softmax(s.masked_fill(~allowed, -math.inf), -1)
    out = (p @ v).transpose(1, 2).reshape(B, N, E)
    return torch.nn.functional.linear(out, layer.out_proj.weight.double(), layer.out_proj.bias.double()), layout


@pytest.mark.parametrize("backend", BACKENDS[1:])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("N, block_size, top_k, kv_heads", [(150, 32, 2, 2), (96, (32, 16), 3, 1), (40, 16, 9, 2)],
                         ids=["tail", "rect-gqa", "k-past-Mk"])
def test_moba_layer_matches_dense_reference(N, block_size, top_k, kv_heads, causal, backend):
    torch.manual_seed(0)
    layer = MoBAAttention(64, 4, block_size, top_k, num_kv_heads=kv_heads, causal=causal, backend=backend).to(DEVICE)
    x = torch.randn(2, N, 64, device=DEVICE, requires_grad=True)
    out = layer(x)
    want, layout = moba_reference(layer, x)
    assert torch.equal(layer.select(*layer._heads(x, x, x)[:2]).layout.cpu(), layout)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)
    out.square().sum().backward()
    grads = [x.grad, layer.q_proj.weight.grad, layer.k_proj.weight.grad, layer.v_proj.weight.grad]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("backend", BACKENDS[1:])
def test_moba_layer_with_sinks(backend):
    """`sinks=True` on the MoBA layer: a sink logit far below every score leaves the output of the layer without
    sinks; at 0 it takes a share of each row and gets a gradient."""
    torch.manual_seed(0)
    plain = MoBAAttention(64, 4, 32, 2, backend=backend).to(DEVICE)
    sinks = MoBAAttention(64, 4, 32, 2, sinks=True, backend=backend).to(DEVICE)
    sinks.load_state_dict({**plain.state_dict(), "sink": torch.full((4,), -1e4)})
    x = torch.randn(2, 150, 64, device=DEVICE)
    torch.testing.assert_close(sinks(x), plain(x), atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        sinks.sink.zero_()
    out = sinks(x)
    assert not torch.allclose(out, plain(x), atol=1e-3) and "sinks=True" in repr(sinks)
    out.square().sum().backward()
    assert sinks.sink.grad is not None and torch.isfinite(sinks.sink.grad).all() and sinks.sink.grad.abs().sum() > 0


def test_moba_layer_checks_and_repr():
    layer = MoBAAttention(64, 4, 32, 3)
    assert "top_k=3" in repr(layer) and "causal=True" in repr(layer) and layer.prepare(100) is None
    for kwargs, error, match in [(dict(top_k=0), ValueError, "top_k must be at least 1"),
                                 (dict(top_k=2.5), TypeError, "top_k must be an int"),
                                 (dict(block_size=(16,)), TypeError, "block_size must be an int or a pair"),
                                 (dict(causal="yes"), TypeError, "causal must be a bool")]:
        with pytest.raises(error, match=match):
            MoBAAttention(**{**dict(embed_dim=64, num_heads=4, block_size=32, top_k=3), **kwargs})


@pytest.mark.parametrize("p", [EDGES[0], EDGES[1], EDGES[2], EDGES[3], EDGES[4]], ids=[f"edge{i}" for i in range(5)])
def test_topk_masks_made_inside_torch_compile_take_the_triton_builders(p):
    """Inside torch.compile a top-k mask's choice, lists and plans come from `index_gpu`'s launches as custom ops
    (their fake implementations give the shapes; Dynamo cannot trace the launches themselves): the same layout
    and every list and plan of every flag built there equal the torch operators' outside (on a GPU with
    inductor; on the CPU under TRITON_INTERPRET=1 with aot_eager, which runs the ops' fake implementations
    first)."""
    on_gpu = DEVICE == "cuda"
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton on the CPU under TRITON_INTERPRET=1")
    from sparse_flash import index_gpu
    from sparse_flash.kernels import settings as kernel_settings

    scores = p.scores().to(DEVICE)
    with kernel_settings.override(gpu_index=False):
        want = p.mask(scores)  # the torch operators (and, for a non-causal choice, its causal lists' builder made)
    flags = (False, True) if p.causal else (False, )

    def build(s):
        m = p.mask(s)
        return m.layout, [[tuple(r) for r in (m.row_index(f), m.col_index(f), *m.kernel_index(f))] for f in flags]

    torch._dynamo.reset()
    with mock.patch.object(mask_index, "_on_gpu", lambda t: True if not on_gpu else t.is_cuda), \
            mock.patch.object(index_gpu, "_topk_lists", wraps=index_gpu._topk_lists) as lists, \
            mock.patch.object(index_gpu, "_unsplit_plans", wraps=index_gpu._unsplit_plans) as plans, \
            mock.patch.object(index_gpu, "_choose_topk", wraps=index_gpu._choose_topk) as choice:
        compiled = torch.compile(build, fullgraph=True, backend="inductor" if on_gpu else "aot_eager")
        layout, got = compiled(scores)
        assert (choice.call_count, lists.call_count, plans.call_count) == (1, len(flags), 1)  # one run of the graph
    assert torch.equal(layout, want.layout)
    for f, records in zip(flags, got):
        wanted = (want.row_index(f), want.col_index(f), *want.kernel_index(f))
        for mine, theirs in zip(records, wanted):
            for name, x, y in zip(theirs._fields, mine, theirs):
                assert x.dtype == y.dtype and torch.equal(x, y), (f, type(theirs).__name__, name)


def test_index_builder_ops_pass_opcheck():
    """The custom ops that build a top-k mask inside torch.compile: schema, autograd registration and fake
    implementations agree with the launches (`torch.library.opcheck`). The lists' and plans' ops return one
    allocation with uninitialised padding between the pieces, so their eager-against-traced comparison is
    the test above, piece by piece."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton on the CPU under TRITON_INTERPRET=1")
    from sparse_flash import index_gpu

    scores = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    ks, geometry = (3, ), (8, 8, 16, 16, 128, 128)
    tables = mask_index.topk_tables(ks, True, geometry, "cpu")
    sizes = mask_index.topk_sizes(ks, True, 2, 3, geometry)
    choice = (scores, tables.counts, tables.cand, sizes.longest_row, True)
    torch.library.opcheck(index_gpu._choose_topk_op, choice)
    selected, _ = index_gpu.choose_topk(scores, tables.counts, sizes.longest_row, True, tables.cand)
    full, part = sizes.nnz - sizes.partial[True], sizes.partial[True]
    lists = (selected, tables.counts, tables.partials[True].contiguous(), tables.group_sizes[True], 8,
             [full + part, full, part])
    no_traced_comparison = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(index_gpu._topk_lists_op, lists, test_utils=no_traced_comparison)
    kinds = torch.zeros(2 * 3 * 8, 8, dtype=torch.int8)
    rows, cols = index_gpu.topk_lists(selected, lists[1], lists[2], 8, tuple(lists[5]), kinds, lists[3])
    flat = [t for side in (rows, cols) for t in (side[0][0], *side[1], *side[2])]
    torch.library.opcheck(index_gpu._unsplit_plans_op, (flat, [4.0, 3.0], 8), test_utils=no_traced_comparison)


@pytest.mark.parametrize("backend", BACKENDS[1:])
def test_moba_layer_compiles_fullgraph(backend):
    """from_topk traces: the whole layer (choice, mask, attention) in one graph, forward and backward."""
    torch.manual_seed(0)
    layer = MoBAAttention(64, 4, 32, 2, backend=backend).to(DEVICE)
    x = torch.randn(2, 150, 64, device=DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="inductor" if DEVICE == "cuda" else "aot_eager")
    outs = []
    for fn in (layer, compiled):
        xi = x.clone().requires_grad_()
        y = fn(xi)
        y.square().sum().backward()
        outs.append((y, xi.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_from_topk_never_asks_for_the_capture_state_inside_torch_compile(monkeypatch):
    """Dynamo cannot trace `torch.cuda.is_current_stream_capturing` (it fails a fullgraph compile): a top-k
    mask built inside torch.compile must not ask it, nor one first used there with its other causal flag
    (`fill`; the GPU suite found that one). On the CPU the query is reached only for CUDA tensors, so here
    every device is taken for a GPU (`mask_index._capturing`, which answers without asking while compiling)."""
    scores = torch.randn(1, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    q = torch.randn(1, 2, 64, 8, generator=torch.Generator().manual_seed(1))

    def build(s):
        return BlockMask.from_topk(s, 2, causal=True, block_size=16).layout

    def attend_causally(s):  # a non-causal choice: its causal lists are built on first use (`fill`)
        mask = BlockMask.from_topk(s, 2, block_size=16)
        return sparse_flash.block_sparse_attention(q, q, q, mask, causal=True, backend="torch")

    want = build(scores)
    capturing = mask_index._capturing
    monkeypatch.setattr(mask_index, "_capturing", lambda device: capturing(torch.device("cuda")))
    torch._dynamo.reset()
    assert torch.equal(torch.compile(build, fullgraph=True, backend="aot_eager")(scores), want)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="Use the mask once with causal=True before the compiled call"):
        torch.compile(attend_causally, fullgraph=True, backend="aot_eager")(scores)


def test_topk_tables_are_made_once_per_geometry_and_equal_the_plain_arithmetic():
    """`mask_index.topk_tables`: the same object for the same (ks, causal, geometry, device), so masks chosen
    per call reuse it; its values are those of `candidates`, `topk_counts` and `_partial_counts` (and the
    per-group block counts they give); masks built
    with it equal masks built afresh; the cache keeps the last 32 entries only."""
    geometry = (6, 7, 32, 32, 6 * 32 - 5, 7 * 32 - 3)
    a = mask_index.topk_tables((3, 2), True, geometry, "cpu")
    assert a is mask_index.topk_tables((3, 2), True, geometry, torch.device("cpu"))
    cand = mask_index.candidates(True, geometry, "cpu")
    counts = mask_index.topk_counts((3, 2), True, geometry, "cpu", cand)
    assert torch.equal(a.cand, cand) and torch.equal(a.counts, counts)
    for flag in (False, True):
        partial = mask_index._partial_counts(counts, cand, flag, geometry)
        assert torch.equal(a.partials[flag], partial)
        assert a.group_sizes[flag].tolist() == [counts.sum(-1).tolist(), (counts - partial).sum(-1).tolist(),
                                                partial.sum(-1).tolist()]
    scores = torch.randn(2, 2, 6, 7, generator=torch.Generator().manual_seed(0))
    kw = dict(causal=True, block_size=32, seq_len_q=geometry[4], seq_len_k=geometry[5])
    first = BlockMask.from_topk(scores, (3, 2), **kw)  # tables from the cache
    with mock.patch.object(mask_index, "_TABLES", {}):
        fresh = BlockMask.from_topk(scores, (3, 2), **kw)
    assert first == fresh
    for flag in (False, True):
        for x, y in zip(first.kernel_index(flag), fresh.kernel_index(flag)):
            assert all(torch.equal(u, v) for u, v in zip(x, y))
    for n in range(40):
        mask_index.topk_tables((1 + n, ), False, (64, 64, 16, 16, 1024, 1024), "cpu")
    assert len(mask_index._TABLES) == mask_index._TABLES_KEPT
    assert a is not mask_index.topk_tables((3, 2), True, geometry, "cpu")  # pushed out by the 40 newer ones


@pytest.mark.parametrize("causal", [True, False])
def test_a_topk_mask_builds_the_other_flag_on_first_use_and_refuses_it_in_a_capture(causal, monkeypatch):
    """A top-k mask builds the lists of its own causal flag; the other flag's on first use (a causal mask's
    without waiting for the device), equal to a layout mask's. Inside a CUDA-graph capture (stood in for on the
    CPU) the first use of the other flag is refused with a clear error, and a mask made inside a capture refuses
    it for good: its lists would not follow the graph's replays."""
    from conftest import DeviceWaits

    scores = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(0))
    kw = dict(causal=causal, block_size=32, seq_len_q=6 * 32, seq_len_k=6 * 32)  # square, no tails: exact lists
    mask = BlockMask.from_topk(scores, 3, **kw)
    assert list(mask._index.kernel) == [causal]
    layout_mask = BlockMask.from_layout(mask.layout, 32, seq_len_q=kw["seq_len_q"], seq_len_k=kw["seq_len_k"])
    with DeviceWaits(monkeypatch) as counter:
        other = mask.kernel_index(not causal)
    monkeypatch.undo()
    assert (counter.waits == 0) == causal  # a non-causal mask reads its choice (build_index)
    for x, y in zip(other, layout_mask.kernel_index(not causal)):
        assert all(torch.equal(u, v) for u, v in zip(x, y))
    fresh = BlockMask.from_topk(scores, 3, **kw)
    with mock.patch.object(mask_index, "_capturing", lambda device: True), \
            mock.patch.object(mask_index, "_CAPTURED", {}):
        with pytest.raises(RuntimeError, match=f"causal={not causal} attention on first use, and is first used so"):
            fresh.kernel_index(not causal)
        captured = BlockMask.from_topk(scores, 3, check_finite=False, **kw)
    assert torch.equal(captured.layout, mask.layout)
    with pytest.raises(RuntimeError, match="was made inside a CUDA-graph capture"):
        captured.kernel_index(not causal)
    assert fresh.kernel_index(not causal) is not None  # refused inside the capture only


def test_a_cuda_graph_capture_reads_the_tables_made_before_it_and_keeps_them():
    """Inside a capture, `topk_tables` returns the tables a warm-up call made (no operators in the graph for
    them) and keeps them past the cache's eviction, since the graph holds their addresses; tables not made
    before the capture are made afresh. (The capture is stood in for on the CPU; the GPU test of replays is
    `test_topk_choice_and_attention_replay_from_a_cuda_graph`.)"""
    key = ((2, ), True, (4, 4, 64, 64, 256, 256), torch.device("cuda", 0))
    warm = mask_index._make_topk_tables(*key[:3], "cpu")
    made = []

    def make(*args):
        made.append(args)
        return warm

    with mock.patch.object(mask_index, "_TABLES", {key: warm}), mock.patch.object(mask_index, "_CAPTURED", {}), \
            mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: True), \
            mock.patch.object(mask_index, "_make_topk_tables", make):
        assert mask_index.topk_tables(*key) is warm and not made
        assert mask_index._CAPTURED == {key: warm}
        mask_index._TABLES.clear()  # evicted from the cache: the graph still reads them
        assert mask_index.topk_tables(*key) is warm and not made
        other = ((3, ), True, *key[2:])
        mask_index.topk_tables(*other)  # never made before the capture: made in it, not kept
        assert made == [other] and other not in mask_index._CAPTURED


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_from_topk_on_the_gpu_never_synchronises(causal):
    """CUDA's own record of synchronising calls (torch.cuda.set_sync_debug_mode), at 65,536 tokens."""
    scores = torch.randn(1, 16, 512, 512, device="cuda")
    BlockMask.from_topk(scores, 8, causal=causal, block_size=128, check_finite=False)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        m = BlockMask.from_topk(scores, 8, causal=causal, block_size=128, check_finite=False)
        m.kernel_records(causal)
        BlockMask.from_topk(scores, (4,) * 8 + (8,) * 8, causal=causal, block_size=128, check_finite=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(m.layout.cpu(), BlockMask.from_topk(scores.cpu(), 8, causal=causal, block_size=128).layout)


def _moba_inputs(B, H, N, D, bs):
    """Block scores `(B, H, N / bs, N / bs)` and bf16 q, k, v (requiring grad) and dO `(B, H, N, D)` on CUDA."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.randn(B, H, N // bs, N // bs, device="cuda", generator=gen)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    return scores, q, k, v, do


@pytest.mark.gpu
def test_a_moba_step_on_the_default_kernels_never_synchronises():
    """A mask chosen per call and the attention's forward and backward on the kernels the library picks (the
    Hopper ones at D=128 on an H100/H200: their launch plans place items on the device, and a top-k mask's
    lists are never long enough to cut, which the plans show from host sizes): no host synchronisation."""
    bs = 128
    scores, q, k, v, do = _moba_inputs(1, 4, 8192, 128, bs)

    def step():
        mask = BlockMask.from_topk(scores, 4, causal=True, block_size=bs, check_finite=False)
        sparse_flash.block_sparse_attention(q, k, v, mask, causal=True).backward(do)

    step()  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.gpu
def test_a_causal_topk_mask_builds_its_non_causal_lists_on_the_gpu_without_waiting():
    """On a GPU, a causal top-k mask and, on first use, its non-causal lists are built without a host
    synchronisation (sync debug mode makes one an error), equal to a layout mask's lists."""
    scores = torch.randn(2, 4, 64, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mask = BlockMask.from_topk(scores, 6, causal=True, block_size=128, check_finite=False)
        lists = mask.kernel_index(False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = BlockMask.from_layout(mask.layout, 128).kernel_index(False)
    for x, y in zip(lists, want):
        assert all(torch.equal(u, v) for u, v in zip(x, y))


@pytest.mark.gpu
def test_topk_choice_and_attention_replay_from_a_cuda_graph():
    """from_topk and the attention's forward and backward captured together (Triton kernels; the Hopper ones
    schedule their work on the host per mask): replays on new scores and inputs give the eager results."""
    from sparse_flash.kernels import settings as kernel_settings

    bs = 128
    scores, q, k, v, do = _moba_inputs(1, 4, 4096, 64, bs)

    def step():
        mask = BlockMask.from_topk(scores, 4, causal=True, block_size=bs, check_finite=False)
        out = sparse_flash.block_sparse_attention(q, k, v, mask, causal=True, backend="triton")
        out.backward(do)
        return out, mask

    with kernel_settings.override(hopper_forward=False, hopper_backward=False):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        q.grad = k.grad = v.grad = None
        graph = torch.cuda.CUDAGraph()
        mask_index._CAPTURED.clear()
        with torch.cuda.graph(graph):
            static_out, static_mask = step()
        assert len(mask_index._CAPTURED) == 1  # the warm-up's tables, read by the graph, kept for it
        for seed in (1, 2):
            g = torch.Generator(device="cuda").manual_seed(seed)
            with torch.no_grad():
                for t in (scores, q, k, v, do):
                    t.copy_(torch.randn(t.shape, device="cuda", dtype=t.dtype, generator=g))
            graph.replay()
            torch.cuda.synchronize()
            replayed = [static_out.clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()]
            q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
            mask = BlockMask.from_topk(scores, 4, causal=True, block_size=bs)
            assert torch.equal(static_mask.layout, mask.layout)
            out = sparse_flash.block_sparse_attention(q2, k2, v2, mask, causal=True, backend="triton")
            out.backward(do)
            for got, want in zip(replayed, [out, q2.grad, k2.grad, v2.grad]):
                torch.testing.assert_close(got, want.detach(), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["topk causal", "topk", "topk per head", "butterfly", "bigbird tails"])
def test_index_built_by_triton_on_the_gpu_equals_the_torch_one(kind):
    """`settings.gpu_index` on (the lists and plans from `index_gpu`'s Triton launches) and off (torch operators)
    give the same index, every list and plan of both causal flags, on the GPU at 16,384 tokens."""
    from sparse_flash.kernels import settings as kernel_settings

    scores = torch.randn(2, 4, 128, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    builders = {"topk causal": lambda: BlockMask.from_topk(scores, 8, causal=True, block_size=128),
                "topk": lambda: BlockMask.from_topk(scores, 5, block_size=128),
                "topk per head": lambda: BlockMask.from_topk(scores, (1, 3, 8, 128), causal=True, block_size=128),
                "butterfly": lambda: sparse_flash.masks.butterfly(16384, 128, device="cuda"),
                "bigbird tails": lambda: sparse_flash.masks.bigbird(16000, 128, num_global_blocks=2, seed=0,
                                                                     device="cuda")}
    masks_built = {}
    for on in (False, True):
        with kernel_settings.override(gpu_index=on):
            masks_built[on] = builders[kind]()
    want, got = masks_built[False], masks_built[True]
    assert torch.equal(got.layout, want.layout)
    for causal in (False, True):
        for a, b in ((got.row_index(causal), want.row_index(causal)), (got.col_index(causal), want.col_index(causal)),
                     *zip(got.kernel_index(causal), want.kernel_index(causal))):
            for name, x, y in zip(a._fields, a, b):
                assert x.dtype == y.dtype and torch.equal(x, y), (causal, type(a).__name__, name)


# ------------------------------------------------------------------------ findings of the dynamic-mask probe
@pytest.mark.parametrize("values", [(1.0, 1.0 + 1e-12, 0.5, 0.0), (1e39, 2e39, 0.0, 0.0), (1e-46, 3e-46, 0.0, 0.0)],
                         ids=["below-float32-precision", "past-float32-range", "below-float32-subnormals"])
def test_float64_scores_are_ranked_in_float64_by_every_builder(values):
    """float64 scores that differ only below float32's precision, or past its range, are distinct: the GPU
    builder ranks 32-bit keys, so float64 scores take the torch sort there too (they became ties, the lower
    block winning)."""
    scores = torch.tensor(values, dtype=torch.float64).reshape(1, 1, 1, 4)
    want = torch.zeros(1, 1, 1, 4, dtype=torch.bool)
    want[..., scores.argmax()] = True  # torch's own top-1 of the float64 scores
    assert torch.equal(BlockMask.from_topk(scores, 1, block_size=16).layout.cpu(), want)
    if os.environ.get("TRITON_INTERPRET") == "1":
        with mock.patch.object(mask_index, "_on_gpu", lambda t: True):
            assert torch.equal(BlockMask.from_topk(scores, 1, block_size=16).layout.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_from_scores_keeps_exactly_the_scores_above_the_threshold(dtype):
    """`score > threshold` as real numbers: torch would round a Python threshold to the scores' dtype first
    (0.9999 is 1.0 in bfloat16, so a score of 1.0 was dropped)."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 6, 6, generator=gen).to(dtype)
    exact = scores.double()
    thresholds = [0.9999, 0.1, -0.3333333333, 1e-30, -1e-30, 1e39, -1e39, 0.0,
                  *exact.flatten()[:8].tolist()]  # the scores themselves: never above themselves
    for t in thresholds:
        mask = BlockMask.from_scores(scores, t, block_size=16)
        diagonal = torch.eye(6, dtype=torch.bool)
        assert torch.equal(mask.layout, (exact > t) | diagonal), (dtype, t)
    ones = torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=dtype).expand(1, 1, 4, 4).contiguous()
    assert BlockMask.from_scores(ones, 0.9999, block_size=16).layout[0, 0, 0].tolist() == [True, True, True, False]


SCORE_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@settings(deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 3), Mq=st.integers(1, 6), Mk=st.integers(1, 6),
       dtype=st.sampled_from(SCORE_DTYPES), threshold_dtype=st.sampled_from(SCORE_DTYPES),
       shape=st.sampled_from(["row", "head-row", "scalar", "block", "column"]), causal=st.booleans(),
       seed=st.integers(0, 2**16))
@example(B=1, H=2, Mq=3, Mk=4, dtype=torch.bfloat16, threshold_dtype=torch.float64, shape="row", causal=False, seed=0)
@example(B=2, H=1, Mq=2, Mk=5, dtype=torch.float16, threshold_dtype=torch.float32, shape="row", causal=True, seed=1)
def test_from_scores_with_a_threshold_tensor_keeps_exactly_the_blocks_above_it(B, H, Mq, Mk, dtype, threshold_dtype,
                                                                              shape, causal, seed):
    """A threshold tensor broadcasting against the scores (one per row, per head and row, one for all, one per
    block, one per key block) keeps the blocks whose score is above it as real numbers (both dtypes compared
    exactly; float64 here) and each row's diagonal block, with `causal` none past it."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(B, H, Mq, Mk, generator=gen).to(dtype)
    sizes = {"row": (B, H, Mq, 1), "head-row": (H, Mq, 1), "scalar": (), "block": (B, H, Mq, Mk),
             "column": (1, 1, 1, Mk)}[shape]
    threshold = (torch.randn(sizes, generator=gen) * 0.5).to(threshold_dtype)
    if shape == "row":  # the first row's threshold just below its first score (in the threshold's dtype): a
        first = scores[..., 0, :1].to(threshold_dtype)  # comparison in the scores' narrower dtype drops that block
        threshold[..., 0, :] = torch.nextafter(first, torch.tensor(-math.inf, dtype=threshold_dtype))
    geometry = dict(block_size=(32, 16), seq_len_q=32 * Mq - 5, seq_len_k=16 * Mk)
    mask = BlockMask.from_scores(scores.to(DEVICE), threshold.to(DEVICE), causal=causal, **geometry)
    above = (scores.double() > threshold.double()).expand(B, H, Mq, Mk)
    want = torch.zeros(B, H, Mq, Mk, dtype=torch.bool)
    for i in range(Mq):  # row by row: the diagonal holds the row's last query
        diagonal = min(min(32 * i + 31, geometry["seq_len_q"] - 1) // 16, Mk - 1)
        want[:, :, i] = above[:, :, i] & (torch.arange(Mk) <= diagonal) if causal else above[:, :, i]
        want[:, :, i, diagonal] = True
    assert torch.equal(mask.layout.cpu(), want)
    assert mask.name == f"scores > threshold of shape {tuple(sizes)}"


def test_from_scores_takes_a_threshold_tensor_without_its_gradient():
    scores = torch.tensor([[0.9, 0.1], [0.2, 0.7]])[None, None].requires_grad_()
    threshold = torch.tensor(0.5, requires_grad=True)
    mask = BlockMask.from_scores(scores * 1, threshold * 1, block_size=16)
    assert mask.layout[0, 0].int().tolist() == [[1, 0], [0, 1]] and not mask.layout.requires_grad
    assert torch.equal(mask.layout, BlockMask.from_scores(scores.detach(), 0.5, block_size=16).layout)


@pytest.mark.parametrize("threshold, error, match", [
    (torch.tensor([[1, 2]]), TypeError, r"threshold given as a tensor must be float16, .* got dtype torch.int64"),
    (torch.tensor(True), TypeError, r"threshold given as a tensor must be float16, .* got dtype torch.bool"),
    (torch.zeros(1, 1, 4, 2), ValueError, r"must broadcast against scores of shape \(1, 2, 4, 4\) .* got shape "
                                          r"\(1, 1, 4, 2\)"),
    (torch.zeros(3, 2, 4, 1), ValueError, r"without growing it.* got shape \(3, 2, 4, 1\)"),
    (torch.zeros(1, 1, 2, 4, 1), ValueError, r"got shape \(1, 1, 2, 4, 1\)"),
    (torch.zeros(1, 2, 4, 1, device="meta"), ValueError, r"on the scores' device cpu, got meta"),
    (torch.tensor([[[[math.nan]]]]), ValueError, r"threshold must be finite .* got 1 non-finite values among 1"),
    (torch.full((1, 2, 4, 1), math.inf), ValueError, r"threshold must be finite .* got 8 non-finite"),
    (torch.zeros(4, 1).to_sparse(), TypeError, r"threshold given as a tensor must be a dense \(torch.strided\) tensor"),
], ids=["int", "bool", "columns-differ", "grows-batch", "rank-5", "meta", "nan", "inf", "sparse"])
def test_from_scores_refuses_a_bad_threshold_tensor(threshold, error, match):
    with pytest.raises(error, match=match):
        BlockMask.from_scores(torch.randn(1, 2, 4, 4), threshold, **GOOD)


def test_from_scores_takes_any_finite_real_threshold():
    from fractions import Fraction

    scores = torch.tensor([[0.2, 0.4], [0.6, 0.8]]).expand(1, 1, 2, 2)
    for t, row0 in ((10**30, [True, False]), (-2**63 - 1, [True, True]), (Fraction(1, 3), [True, True]),
                    (Fraction(1, 2), [True, False])):
        assert BlockMask.from_scores(scores, t, block_size=16).layout[0, 0, 0].tolist() == row0, t
    with pytest.raises(ValueError, match="threshold must be finite"):
        BlockMask.from_scores(scores, 10**400, block_size=16)


@pytest.mark.parametrize("make", ["sparse", "nested", "float8"])
def test_scores_of_another_layout_or_dtype_get_a_type_error_naming_them(make):
    scores = torch.randn(1, 1, 4, 4)
    if make == "sparse":
        scores = scores.to_sparse()
    elif make == "nested":
        scores = torch.nested.nested_tensor([torch.randn(1, 4, 4), torch.randn(1, 3, 4)])
    else:
        if not hasattr(torch, "float8_e4m3fn"):
            pytest.skip("this torch has no float8")
        scores = scores.to(torch.float8_e4m3fn)
    for build in (lambda: BlockMask.from_topk(scores, 2, block_size=16),
                  lambda: BlockMask.from_scores(scores, 0.0, block_size=16)):
        with pytest.raises(TypeError, match="scores must be"):
            build()


def test_k_messages_name_what_was_given():
    scores = torch.randn(1, 2, 4, 4)
    with pytest.raises(TypeError, match="0-d tensor of dtype torch.float32"):
        BlockMask.from_topk(scores, torch.tensor(2.0), block_size=16)
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match="got a NumPy ndarray of dtype float64"):
        BlockMask.from_topk(scores, np.array([1.0, 2.0]), block_size=16)
    assert BlockMask.from_topk(scores, np.array(2), block_size=16).nnz == 16  # 0-d: one k, as a 0-d tensor
    with pytest.raises(ValueError, match=r"shape \(H,\) = \(2,\)"):  # as a 2-d tensor
        BlockMask.from_topk(scores, np.array([[1, 2]]), block_size=16)
    with pytest.raises(ValueError, match="check_finite=False"):
        BlockMask.from_topk(torch.full((1, 1, 2, 2), float("nan")), 1, block_size=16)


@pytest.mark.parametrize("causal", [False, True])
def test_moba_a_non_finite_key_reaches_the_rows_that_attend_it(causal):
    """A key block holding a NaN ranks first in the gate, so the NaN reaches the output as in attention (it
    ranked last and vanished); a NaN among a query block's tokens shows in that token's output row."""
    torch.manual_seed(0)
    layer = MoBAAttention(16, 1, 4, 2 if causal else 1, causal=causal, backend="torch")  # causal: the diagonal and one
    x, kv = torch.randn(1, 16, 16), torch.randn(1, 16, 16)
    kv[0, 5] = float("nan")  # key block 1
    out = layer(x, kv)
    reach = torch.arange(16) >= 5 if causal else torch.ones(16, dtype=torch.bool)  # rows that may attend key 5
    assert torch.isnan(out[0, reach]).all() and not torch.isnan(out[0, ~reach]).any()
    x = torch.randn(1, 16, 16)
    x[0, 9] = float("nan")
    out = layer(x)
    assert torch.isnan(out[0, 9]).all()


@pytest.mark.parametrize("block_size, top_k", [(16, 2), ((32, 16), 2), ((16, 32), 2), ((48, 32), 3)],
                         ids=["square", "short-keys", "long-keys", "misaligned"])
def test_moba_causal_outputs_never_depend_on_later_tokens(block_size, top_k):
    """With causal=True no token's output changes when a later token does (a probe found 27 of 63 tokens that
    changed an earlier one's output: the gate read the mean of the whole query block, later tokens included)."""
    torch.manual_seed(0)
    layer = MoBAAttention(32, 2, block_size, top_k, causal=True, backend="torch", dtype=torch.float64)
    x = torch.randn(1, 90, 32, dtype=torch.float64)
    y = layer(x)
    for t in range(1, 90, 7):
        changed = x.clone()
        changed[0, t:] += 10 * torch.randn(90 - t, 32, dtype=torch.float64)
        assert torch.equal(layer(changed)[0, :t], y[0, :t]), t


def test_moba_causal_top_k_keeps_room_for_the_overlapping_key_blocks():
    with pytest.raises(ValueError, match="top_k must be at least 2"):
        MoBAAttention(16, 1, (32, 16), 1)
    layer = MoBAAttention(16, 1, (32, 16), 1, causal=False)  # no causal rule: any top_k
    layer.causal = True  # the rule holds for a flag set after construction too (else rows would keep no key)
    with pytest.raises(ValueError, match="top_k must be at least 2"):
        layer(torch.randn(1, 64, 16))


def test_moba_block_size_and_top_k_are_fixed_and_checked_for_the_backend():
    layer = MoBAAttention(16, 2, 4, 2)
    for name, value in (("block_pair", (8, 8)), ("top_k", 0), ("block_size", 8)):
        with pytest.raises(AttributeError, match="fixed at construction"):
            setattr(layer, name, value)
    assert (layer.block_pair, layer.top_k) == ((4, 4), 2)
    with pytest.raises(ValueError, match="multiples of 16"):
        MoBAAttention(16, 2, 8, 2, backend="triton")
    copy = __import__("copy").deepcopy(layer)
    assert (copy.block_pair, copy.top_k) == ((4, 4), 2)

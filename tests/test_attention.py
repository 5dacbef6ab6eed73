"""Every backend against the dense float64 oracle: outputs, log-sum-exp and gradients (2x rule)."""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, KERNEL_DTYPES, fresh_plans, triton_usable
from hypothesis import example, given, settings
from strategies import Problem, problems

import sparse_flash
from sparse_flash import BlockMask, masks
from sparse_flash.reference import attention_reference
from sparse_flash.testing import compare_to_reference, make_qkv

BACKENDS = ["torch"] + (["triton"] if triton_usable() else [])
needs_triton = pytest.mark.skipif(not triton_usable(), reason="triton is not usable here")


def dtype_id(dtype):
    return str(dtype).replace("torch.", "")


def check(p: Problem, dtype, backend, layout="contiguous"):
    q, k, v = make_qkv(p.B, p.Hq, p.Hkv, p.Nq, p.Nk, p.D, dtype=dtype, device=DEVICE, seed=p.seed, layout=layout)
    result = compare_to_reference(q, k, v, p.mask(DEVICE), causal=p.causal, backend=backend)
    assert not result.failures(), f"{p}: {result.failures()}"


EDGE_CASES = [
    # the empty row, the single block, the all-dense mask, odd lengths, GQA, long head dims
    Problem(1, 2, 1, 100, 90, 24, 32, 16, "empty_rows", 0.5, False, 1),
    Problem(1, 1, 1, 1, 1, 8, 16, 16, "dense", 1.0, False, 0),
    Problem(1, 1, 1, 1, 1, 8, 16, 16, "random", 0.0, True, 0),
    Problem(2, 4, 2, 97, 131, 59, 64, 32, "dense", 1.0, True, 3),
    Problem(1, 4, 1, 130, 130, 40, 16, 48, "butterfly", 1.0, True, 4),
    Problem(2, 2, 2, 200, 77, 16, 128, 64, "per_batch", 0.5, False, 5),
    Problem(1, 2, 2, 64, 200, 72, 64, 64, "causal", 1.0, True, 6),
    # one query or one key on the dense causal path at D > 64: the dQ kernel's loop is at most one tile
    # long, which must not be known when compiling (a ptxas crash in Triton 3.6, fp16 and bf16)
    Problem(1, 1, 1, 1, 130, 128, 64, 64, "dense", 1.0, True, 7),
    Problem(1, 1, 1, 130, 1, 72, 64, 64, "dense", 1.0, True, 8),
    # one key for 2,198 query rows: dK is exactly 0, and the delta form of the backward sums fp32 rounding
    # noise over every row (found by the GPU fuzz; `testing.delta_form_gradients` measures PyTorch's own)
    Problem(1, 2, 1, 1099, 1, 64, 32, 32, "causal", 0.1, True, 12258),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
@given(p=problems())
@example(p=EDGE_CASES[0])
@example(p=EDGE_CASES[1])
@example(p=EDGE_CASES[2])
@example(p=EDGE_CASES[3])
@example(p=EDGE_CASES[4])
@example(p=EDGE_CASES[5])
@example(p=EDGE_CASES[6])
@example(p=EDGE_CASES[7])
@example(p=EDGE_CASES[8])
@example(p=EDGE_CASES[9])
def test_backend_matches_reference(backend, dtype, p):
    check(p, dtype, backend)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
@given(p=problems(block_sizes=(8, 24, 40, 100)))
def test_torch_backend_any_block_size(dtype, p):
    check(p, dtype, "torch")


@given(p=problems(max_len=120))
def test_torch_backend_float64_is_exact(p):
    q, k, v = make_qkv(p.B, p.Hq, p.Hkv, p.Nq, p.Nk, p.D, dtype=torch.float64, device=DEVICE, seed=p.seed)
    mask = p.mask(DEVICE)
    out, lse = sparse_flash.block_sparse_attention(q, k, v, mask, causal=p.causal, return_lse=True, backend="torch")
    ref, ref_lse = attention_reference(q, k, v, mask, causal=p.causal)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("head_dim", [96, 111, 128, 256])
@pytest.mark.parametrize("backend", BACKENDS)
def test_large_head_dims(backend, head_dim):
    p = Problem(1, 2, 1, 150, 140, head_dim, 64, 32, "random", 0.5, True, 11)
    check(p, torch.float16, backend)


@pytest.mark.parametrize("layout", ["transposed", "strided-d"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend, layout):
    p = Problem(2, 4, 2, 100, 120, 32, 32, 32, "random", 0.5, True, 12)
    check(p, torch.float32, backend, layout=layout)


@pytest.mark.parametrize("block", [16, 32, 64, 128, 256])
@needs_triton
def test_triton_mask_block_sizes(block):
    p = Problem(1, 2, 2, 2 * block + 5, 3 * block - 7, 32, block, block, "random", 0.6, False, block)
    check(p, torch.float16, "triton")


@needs_triton
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_long_lists_take_the_dense_tiles(split):
    """Rows averaging 16 blocks or more (`BlockMask.has_long_lists`) run the forward on the dense kernel's
    128 x 128 tiles at D = 128 in 16-bit dtypes (`configs.fwd_config`), partial tail blocks included, and
    with every list cut into chunks that the last one merges."""
    from sparse_flash.kernels.triton import configs, fwd

    p = Problem(1, 1, 1, 300, 2100, 96, 128, 128, "random", 0.97, False, 9)  # three query rows of 17 key blocks
    chosen = []
    with pytest.MonkeyPatch.context() as mp, fresh_plans(), split_every_list() if split else contextlib.nullcontext():
        assert p.mask(DEVICE).has_long_lists(False)
        mp.setattr(fwd, "fwd_config", lambda *a: chosen.append(configs.fwd_config(*a)) or chosen[-1])
        check(p, torch.float16, "triton")
    assert [(c.block_m, c.block_n, c.num_warps) for c in chosen] == [(128, 128, 8)]


@pytest.mark.parametrize("seq_len, long_lists, dtype, block, wide", [
    (16384, False, torch.bfloat16, 128, True), (4096, True, torch.float16, 256, True),
    (4096, False, torch.bfloat16, 128, False), (16384, False, torch.float32, 128, False),
    (16384, True, torch.bfloat16, 64, False)])
def test_sparse_forward_at_d128_takes_the_dense_tiles_on_long_lists_or_long_sequences(seq_len, long_lists, dtype,
                                                                                      block, wide):
    from sparse_flash.kernels.triton import configs

    cfg = configs.fwd_config(128, dtype, block, block, False, seq_len, long_lists)
    assert ((cfg.block_m, cfg.block_n, cfg.num_warps) == (128, 128, 8)) == wide


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
@settings(max_examples=max(1, settings().max_examples // 2))
@given(p=problems())
@example(p=EDGE_CASES[0])
@example(p=EDGE_CASES[5])
@example(p=EDGE_CASES[9])
def test_gradients_through_lse_match_reference(backend, dtype, p):
    """The log-sum-exp is differentiable: with random gradients for both out and lse, dq, dk and dv meet the
    2x rule against the float64 reference (empty rows, per-batch masks, a query tail and split lists drawn)."""
    q, k, v = make_qkv(p.B, p.Hq, p.Hkv, p.Nq, p.Nk, p.D, dtype=dtype, device=DEVICE, seed=p.seed)
    result = compare_to_reference(q, k, v, p.mask(DEVICE), causal=p.causal, backend=backend, lse_grad=True)
    assert not result.failures(), f"{p}: {result.failures()}"


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
def test_a_loss_of_lse_alone_differentiates_to_the_attention_weights(backend):
    """d lse_i / d s_ij = P_ij: with out unused, dq = scale * P K (and dv = 0) where a row attends, 0 in an empty
    row; the lse of an empty row (-inf) passes no gradient."""
    layout = torch.tensor([[1, 0, 1], [0, 0, 0], [1, 1, 0]], dtype=torch.bool)
    mask = BlockMask.from_layout(layout.to(DEVICE), 32, seq_len_q=90, seq_len_k=80)
    q, k, v = make_qkv(1, 2, 1, 90, 80, 16, dtype=torch.float32, device=DEVICE, seed=5)
    _, lse = sparse_flash.block_sparse_attention(q, k, v, mask, return_lse=True, backend=backend)
    weights = torch.linspace(-1, 1, 90, device=DEVICE)
    finite = torch.isfinite(lse)
    (lse.where(finite, 0.0) * weights).sum().backward()
    allowed = mask.to_dense()[0, 0]  # (Nq, Nk)
    scale = 16 ** -0.5
    s = (q.detach().double() @ k.detach().double().transpose(-1, -2)[:, [0, 0]] * scale).masked_fill(~allowed, -math.inf)
    p_ = torch.softmax(s, -1).nan_to_num(0.0) * weights.double()[:, None]
    expected_dq = p_ @ k.detach().double()[:, [0, 0]] * scale
    assert (~finite).any() and finite.any()
    torch.testing.assert_close(q.grad.double(), expected_dq, atol=2e-5, rtol=1e-4)
    assert v.grad is None or not v.grad.any()  # lse is no function of v (the kernels' backward gives zeros)


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_merged_parts_equal_one_call_over_their_union(backend, causal):
    """`merge_attention` of calls over disjoint masks equals one call over their union: out, lse, and the
    gradients of q, k and v from both (rows empty in one part, and in every part, included; per-head masks)."""
    union = masks.bigbird(200, 32, num_heads=2, seed=4) & masks.random(200, 32, density=0.7, seed=1)
    split = torch.rand(union.shape, generator=torch.Generator().manual_seed(2)) < 0.5
    parts = [union & BlockMask.from_layout(half, 32, seq_len_q=200, seq_len_k=200) for half in (split, ~split)]
    parts = [part.to(DEVICE) for part in parts]
    assert all((~part.layout.any(-1)).any() for part in parts) and (~union.layout.any(-1)).any()  # empty rows
    dtype = torch.float64 if backend == "reference" else torch.float32
    q, k, v = make_qkv(2, 2, 1, 200, 200, 16, dtype=dtype, device=DEVICE, seed=6)
    gen = torch.Generator().manual_seed(3)
    g_out, g_lse = torch.randn(q.shape, generator=gen).to(DEVICE), torch.randn(q.shape[:3], generator=gen).to(DEVICE)

    def run(fn, dtype):
        inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out, lse = fn(*inputs)
        grads = torch.autograd.grad((out, lse.where(torch.isfinite(lse), 0.0)), inputs,
                                    (g_out.to(out.dtype), g_lse.to(lse.dtype)))
        return [out, lse, *grads]

    def merged(q, k, v):
        outs, lses = zip(*(sparse_flash.block_sparse_attention(q, k, v, m, causal=causal, return_lse=True,
                                                               backend=backend) for m in parts))
        return sparse_flash.merge_attention(outs, lses)

    whole = run(lambda q, k, v: attention_reference(q, k, v, union.to(DEVICE), causal=causal), torch.float64)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), run(merged, dtype), whole):
        assert torch.isfinite(got).sum() == torch.isfinite(want).sum(), name
        tol = dict(atol=1e-9, rtol=1e-9) if dtype == torch.float64 else dict(atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(got.double(), want, **tol, msg=name)


def test_merge_attention_refuses_bad_input():
    out, lse = torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8)
    for args, error, words in [((out, [lse]), TypeError, "outs must be a sequence"),
                               (([], []), ValueError, "non-empty and of one length"),
                               (([out, out], [lse]), ValueError, "non-empty and of one length"),
                               (([out], [lse.half()]), ValueError, "lses\\[0\\] must be float32 or float64"),
                               (([out[0]], [lse]), ValueError, "outs\\[0\\] must be a floating"),
                               (([out, out[..., :2]], [lse, lse]), ValueError, "outs\\[1\\] must be"),
                               (([out, out.double()], [lse, lse]), ValueError, "one dtype each"),
                               (([out], ["x"]), TypeError, "must be tensors"),
                               (([out.to_sparse()], [lse]), TypeError, "outs\\[0\\] must be a dense \\(strided\\)"),
                               (([out], [lse.to_sparse()]), TypeError, "lses\\[0\\] must be a dense \\(strided\\)")]:
        with pytest.raises(error, match=words):
            sparse_flash.merge_attention(*args)


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_empty_rows_give_zero_output_minus_inf_lse_and_zero_gradients(backend, causal):
    layout = torch.tensor([[[0, 0, 0], [1, 0, 1], [0, 0, 0]], [[1, 1, 1], [0, 0, 0], [0, 1, 0]]], dtype=torch.bool)
    mask = BlockMask.from_layout(layout.to(DEVICE), 32, seq_len_q=90, seq_len_k=80)
    q, k, v = make_qkv(2, 2, 1, 90, 80, 16, dtype=torch.float32, device=DEVICE, seed=3)
    out, lse = sparse_flash.block_sparse_attention(q, k, v, mask, causal=causal, return_lse=True, backend=backend)
    out.sum().backward()
    empty_rows = ~mask.to_dense()[0].any(-1)  # (H, Nq)
    if causal:
        empty_rows = empty_rows | ~(mask.to_dense()[0] & torch.ones(90, 80, dtype=torch.bool, device=DEVICE).tril()).any(-1)
    assert empty_rows.any()
    assert (out[:, empty_rows] == 0).all()
    assert torch.isneginf(lse[:, empty_rows]).all()
    assert torch.isfinite(lse[:, ~empty_rows]).all()
    assert (q.grad[:, empty_rows] == 0).all()
    for t in (out, q.grad, k.grad, v.grad):
        assert torch.isfinite(t).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True])
def test_all_ones_mask_equals_sdpa(backend, dtype, causal):
    """Dense FlashAttention (the all-ones mask) against F.scaled_dot_product_attention, 2x rule."""
    B, H, N, D = 2, 3, 203, 40
    q, k, v = make_qkv(B, H, H, N, N, D, dtype=dtype, device=DEVICE, seed=21)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(DEVICE)

    def grads(fn, *inputs):
        inputs = [t.detach().clone().requires_grad_() for t in inputs]
        out = fn(*inputs)
        return (out, *torch.autograd.grad(out, inputs, g.to(out.dtype)))

    ours = grads(lambda a, b, c: sparse_flash.flash_attention(a, b, c, causal=causal, backend=backend), q, k, v)
    sdpa = grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal), q, k, v)
    ref = grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal), q.double(), k.double(), v.double())
    floor = max(1e-5, torch.finfo(dtype).eps / 2)
    for name, a, s, r in zip(("out", "dq", "dk", "dv"), ours, sdpa, ref):
        err, base = (a.double() - r).abs().max().item(), (s.double() - r).abs().max().item()
        assert err <= 2 * base + floor * max(1.0, r.abs().max().item()), f"{name}: {err:.3g} vs SDPA {base:.3g}"


@given(p=problems(max_len=120))
def test_delta_form_gradients_equal_autograd_in_float64(p):
    """The FlashAttention backward written in PyTorch (the baseline of the float32 tolerance) is the
    reference's gradient, exactly up to float64 rounding."""
    from sparse_flash.testing import delta_form_gradients

    q, k, v = make_qkv(p.B, p.Hq, p.Hkv, p.Nq, p.Nk, p.D, dtype=torch.float64, device="cpu", seed=p.seed)
    grad_out = torch.randn_like(q)
    out, _ = attention_reference(q, k, v, p.mask("cpu"), causal=p.causal)
    expected = torch.autograd.grad(out, (q, k, v), grad_out)
    for ours, theirs in zip(delta_form_gradients(q, k, v, grad_out, p.mask("cpu"), causal=p.causal), expected):
        torch.testing.assert_close(ours, theirs, atol=1e-10, rtol=1e-9)


def test_reference_equals_sdpa_with_materialised_mask():
    q, k, v = make_qkv(2, 4, 2, 150, 170, 32, dtype=torch.float64, device=DEVICE, seed=8)
    mask = masks.random(150, (32, 64), density=0.6, seed=4, num_heads=4, seq_len_k=170)
    for causal in (False, True):
        out, lse = attention_reference(q, k, v, mask, causal=causal)
        allowed = mask.to_dense()
        if causal:
            allowed = allowed & torch.ones(150, 170, dtype=torch.bool).tril()
        allowed = allowed.expand(2, 4, 150, 170).to(DEVICE)
        kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        expected = F.scaled_dot_product_attention(q, kk, vv, attn_mask=allowed)
        rows = allowed.any(-1)
        torch.testing.assert_close(out[rows], expected[rows])
        assert (out[~rows] == 0).all()
        scores = (q @ kk.transpose(-1, -2)) / math.sqrt(32)
        torch.testing.assert_close(lse[rows], scores.masked_fill(~allowed, -math.inf).logsumexp(-1)[rows])


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_and_return_types(backend):
    q, k, v = make_qkv(1, 2, 2, 64, 64, 16, dtype=torch.float32, device=DEVICE, seed=0, requires_grad=False)
    mask = masks.dense(64, 32)
    out = sparse_flash.block_sparse_attention(q, k, v, mask, scale=0.3, backend=backend)
    ref, ref_lse = attention_reference(q, k, v, mask, scale=0.3)
    assert isinstance(out, torch.Tensor) and out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    out, lse = sparse_flash.block_sparse_attention(q, k, v, mask, scale=0.3, return_lse=True, backend=backend)
    assert lse.dtype == torch.float32 and lse.shape == (1, 2, 64)
    torch.testing.assert_close(lse, ref_lse, atol=2e-6, rtol=1e-5)


@needs_triton
def test_triton_backward_is_deterministic():
    p = Problem(1, 4, 1, 200, 200, 32, 32, 32, "random", 0.7, True, 9)
    q, k, v = make_qkv(p.B, p.Hq, p.Hkv, p.Nq, p.Nk, p.D, dtype=torch.float16, device=DEVICE, seed=1)
    mask = p.mask(DEVICE)
    runs = []
    for _ in range(2):
        a, b, c = (t.detach().clone().requires_grad_() for t in (q, k, v))
        sparse_flash.block_sparse_attention(a, b, c, mask, causal=True, backend="triton").sum().backward()
        runs.append((a.grad, b.grad, c.grad))
    for x, y in zip(*runs):
        assert torch.equal(x, y)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_torch_backward_is_deterministic_on_several_threads(causal):
    """Gradients bit-identical from run to run with several CPU threads: a key block that many query blocks
    attend gets its gradients summed in a fixed order (the backward of plain indexing added them from several
    threads in any order: dK and dV 1 ulp apart)."""
    mask = masks.butterfly(300, 32) | masks.local(300, 32, window=1)
    q, k, v = make_qkv(2, 4, 2, 300, 300, 40, dtype=torch.float32, device="cpu", seed=3)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = []
        for _ in range(6):
            a, b, c = (t.detach().clone().requires_grad_() for t in (q, k, v))
            sparse_flash.block_sparse_attention(a, b, c, mask, causal=causal, backend="torch").backward(do)
            runs.append((a.grad, b.grad, c.grad))
    finally:
        torch.set_num_threads(threads)
    for run in runs[1:]:
        for name, x, y in zip(("dq", "dk", "dv"), runs[0], run):
            assert torch.equal(x, y), name


@contextlib.contextmanager
def split_every_list():
    """Masks built in this context cut every list longer than 2 blocks into chunks of about 2 blocks, at
    most 3 chunks (so longer lists get uneven chunks), so that the chunked programs and the merge by the
    last chunk run on every drawn problem."""
    from sparse_flash import mask_index

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mask_index, "SPLIT_MIN_CHUNK", 2)
        mp.setattr(mask_index, "SPLIT_FACTOR", 0)
        mp.setattr(mask_index, "SPLIT_MAX_CHUNKS", 3)
        yield


@needs_triton
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
@settings(max_examples=max(1, settings().max_examples * 2 // 5))  # every list split: the slowest draws of the suite
@given(p=problems())
@example(p=EDGE_CASES[0])
@example(p=EDGE_CASES[3])
@example(p=EDGE_CASES[5])
def test_split_lists_match_reference(dtype, p):
    with split_every_list():
        mask = p.mask(DEVICE)
    assert mask.kernel_index(p.causal).row_plan.split.numel() == int((mask.row_index(p.causal).counts > 2).sum())
    q, k, v = make_qkv(p.B, p.Hq, p.Hkv, p.Nq, p.Nk, p.D, dtype=dtype, device=DEVICE, seed=p.seed)
    # every other draw also differentiates through lse: its gradient enters delta, which each chunk recomputes
    result = compare_to_reference(q, k, v, mask, causal=p.causal, backend="triton", lse_grad=bool(p.seed % 2))
    assert not result.failures(), f"{p}: {result.failures()}"


@needs_triton
def test_split_lists_leave_their_counters_at_zero():
    """The last chunk of each split tile resets its counter, so the next call (same launch plans, same
    counters) merges again; the sums run in chunk order, so both calls agree bit for bit."""
    with split_every_list():
        mask = masks.bigbird(256, 16, seed=0, device=DEVICE)
    assert mask.kernel_index(False).row_plan.split.numel() > 0
    q, k, v = make_qkv(1, 2, 2, 256, 256, 32, dtype=torch.float32, device=DEVICE, seed=0)
    runs = []
    for _ in range(2):
        qkv = [t.detach().requires_grad_() for t in (q, k, v)]
        out = sparse_flash.block_sparse_attention(*qkv, mask, backend="triton")
        out.backward(torch.ones_like(out))
        runs.append([out.detach(), *(t.grad for t in qkv)])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    from sparse_flash.kernels.launch import mask_plans

    passes = [p for plan in mask_plans(mask).values() for p in (plan, getattr(plan, "dq", None),
                                                                  getattr(plan, "dkdv", None)) if p is not None]
    splits = [s for p in passes for s in (getattr(p, "split", None), getattr(p, "rows", None), getattr(p, "cols", None))
              if s is not None and s.num_split]
    assert len(splits) == 3  # the forward's rows, the backward's rows and columns
    for split in splits:
        assert split._counters and all(int(c.abs().sum()) == 0 for c in split._counters.values())


@needs_triton
@pytest.mark.parametrize("group", [1, 2, 3])
@settings(max_examples=max(1, settings().max_examples * 2 // 5))  # three group sizes: fewer draws each
@given(p=problems())
@example(p=EDGE_CASES[3])
@example(p=EDGE_CASES[5])
def test_head_groups_match_reference(group, p):
    """Sparse programs run (batch, head) pairs in groups (the last one smaller when the group size does
    not divide them), with split lists too: every tile is still computed exactly once."""
    from sparse_flash.kernels.triton import bwd, fwd

    with pytest.MonkeyPatch.context() as mp, split_every_list(), fresh_plans():
        for module in (fwd, bwd):
            mp.setattr(module, "schedule_heads", lambda nbytes, heads: min(group, heads))
        check(p, torch.float32, "triton")


def test_work_plan_splits_only_long_lists():
    """BigBird's global rows and columns are split into chunks of at most 4x the mean list length (at
    least 32 blocks); every other list is one program, and every list's chunks cover it exactly once."""
    mask = masks.bigbird(128 * 256, 128, num_global_blocks=2, seed=0)
    idx = mask.kernel_index(False)
    counts = mask.row_index(False).counts.reshape(-1)
    plan = idx.row_plan
    long_rows = torch.nonzero(counts > max(32, 4 * counts.float().mean())).reshape(-1)
    assert plan.split.tolist() == long_rows.tolist() and len(long_rows) == 2
    assert plan.chunks[long_rows].tolist() == [8, 8]  # 256 blocks in chunks of 32
    items = plan.items.reshape(-1, plan.items.shape[-1])
    items = items[items[:, 0] >= 0]
    assert sorted(items[:, 0].tolist()) == sorted(torch.repeat_interleave(torch.arange(256), plan.chunks).tolist())
    lengths = counts[items[:, 0].long()] // plan.chunks[items[:, 0].long()]
    assert torch.all(lengths[:-1] >= lengths[1:])  # longest first
    assert plan.lead.tolist() == [16]  # the 16 chunks of the two global rows start first in every head
    assert plan.slot_list.numel() == 16 and plan.slots[long_rows].tolist() == [0, 8]
    assert idx.col_plan.split.numel() == 2


def test_work_plan_caps_chunks_per_list(monkeypatch):
    from sparse_flash import mask_index

    monkeypatch.setattr(mask_index, "SPLIT_MAX_CHUNKS", 3)
    plan = masks.bigbird(128 * 256, 128, num_global_blocks=2, seed=0).kernel_index(False).row_plan
    assert plan.chunks[plan.split.long()].tolist() == [3, 3]  # not 8: 256 blocks in chunks of 85 or 86
    assert plan.slot_list.numel() == 6


@needs_triton
@pytest.mark.parametrize("kind", ["causal", "causal | local", "causal, 16x32 blocks", "local"])
def test_masks_covering_causal_take_the_dense_causal_path(monkeypatch, kind):
    """With causal=True, a mask holding every block with a causal pair computes what the all-ones mask
    does; the kernels then walk the dense causal path and load no index lists."""
    from sparse_flash.kernels import function

    seen, real = [], function.attn_fwd
    monkeypatch.setattr(function, "attn_fwd", lambda q, k, v, index, *a: seen.append(index) or real(q, k, v, index, *a))
    n = 150
    mask = {"causal": masks.causal(n, 32), "causal | local": masks.causal(n, 32) | masks.local(n, 32, window=1),
            "causal, 16x32 blocks": masks.causal(n, (16, 32)), "local": masks.local(n, 32, window=1)}[kind]
    q, k, v = make_qkv(1, 2, 2, n, n, 32, dtype=torch.float32, device=DEVICE, seed=3)
    result = compare_to_reference(q, k, v, mask.to(DEVICE), causal=True, backend="triton")
    assert not result.failures(), result.failures()
    assert seen and all((index is None) == (kind != "local") for index in seen)

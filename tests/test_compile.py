"""torch.compile(fullgraph=True) of a model calling block_sparse_attention: no graph break, same numbers."""

import warnings

import pytest
import torch
from conftest import DEVICE, triton_usable

import sparse_flash
from sparse_flash import BlockMask, masks

pytestmark = pytest.mark.skipif(not triton_usable(), reason="triton is not usable here")


class TinyAttention(torch.nn.Module):
    def __init__(self, mask, dim=64, heads=4):
        super().__init__()
        self.mask, self.heads = mask, heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        o = sparse_flash.block_sparse_attention(q, k, v, self.mask, causal=True, backend="triton")
        return self.out(o.transpose(1, 2).reshape(B, N, C))


def run(model, x):
    x = x.detach().clone().requires_grad_()
    y = model(x)
    y.square().sum().backward()
    return y, x.grad


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_fullgraph_forward_and_backward(dense):
    N = 200
    mask = masks.dense(N, 32, device=DEVICE) if dense else masks.butterfly(N, 32, device=DEVICE) | masks.local(N, 32, device=DEVICE)
    torch.manual_seed(0)
    model = TinyAttention(mask).to(DEVICE)
    x = torch.randn(2, N, 64, device=DEVICE)
    eager = run(model, x)
    torch._dynamo.reset()
    # aot_eager traces the whole graph (forward and backward) without a C++ or GPU compiler;
    # on a GPU the default inductor backend compiles it.
    compiled = torch.compile(model, fullgraph=True, backend="inductor" if DEVICE == "cuda" else "aot_eager")
    ours = run(compiled, x)
    for a, b in zip(ours, eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def assert_compiled_gradients_equal_eager(loss, inputs):
    """The gradients of the scalar `loss(*inputs)` under `torch.compile(fullgraph=True)` equal the eager ones."""

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in inputs]
        fn(*leaves).backward()
        return [t.grad for t in leaves]

    eager = grads(loss)
    torch._dynamo.reset()
    compiled = grads(torch.compile(loss, fullgraph=True, backend="inductor" if DEVICE == "cuda" else "aot_eager"))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_fullgraph_backward_through_lse():
    """A softmax sink, out * sigmoid(lse - sink), trains through the compiled graph: the custom backward op takes
    the log-sum-exp's gradient (its optional `dlse`), and the gradients equal the eager ones."""
    N = 160
    mask = masks.butterfly(N, 32, device=DEVICE) | masks.local(N, 32, device=DEVICE)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, N, 32, generator=gen).to(DEVICE) for _ in range(3))
    sink = torch.tensor([0.5, -0.25], device=DEVICE)[:, None]

    def loss(q, k, v):
        out, lse = sparse_flash.block_sparse_attention(q, k, v, mask, causal=True, return_lse=True, backend="triton")
        return (out * torch.sigmoid(lse - sink)[..., None]).square().sum()

    assert_compiled_gradients_equal_eager(loss, (q, k, v))


def test_merged_parts_compile_fullgraph():
    """`merge_attention` of two disjoint masks' calls traces whole (no graph break) and equals the eager merge,
    gradients included."""
    N = 128
    first = masks.local(N, 32, window=0, device=DEVICE)
    second = masks.butterfly(N, 32, device=DEVICE) & BlockMask.from_layout(~first.layout, 32)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, N, 32, generator=gen).to(DEVICE) for _ in range(3))

    def attend(q, k, v):
        parts = [sparse_flash.block_sparse_attention(q, k, v, m, return_lse=True, backend="triton")
                 for m in (first, second)]
        out, lse = sparse_flash.merge_attention(*zip(*parts))
        return out.sum() + lse.sum()

    assert_compiled_gradients_equal_eager(attend, (q, k, v))


def test_custom_ops_are_registered():
    """The kernels' autograd function (loaded on first use) registers the custom ops that torch.compile traces."""
    import sparse_flash.kernels

    assert sparse_flash.kernels.BlockSparseAttentionFunction is not None  # loads function.py, which loads ops.py

    assert hasattr(torch.ops.sparse_flash, "attn_fwd") and hasattr(torch.ops.sparse_flash, "attn_bwd")


def test_fake_tensors_take_the_registered_op():
    """Eager calls on real tensors skip the custom-op dispatcher; fake tensors (shape propagation, export)
    must still reach the op's fake implementation instead of a kernel launch."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mask = masks.butterfly(256, 64, device=DEVICE)
    with FakeTensorMode(allow_non_fake_inputs=True):  # the mask stays real
        q, k, v = (torch.randn(2, 4, 256, 32, device=DEVICE, requires_grad=True) for _ in range(3))
        out, lse = sparse_flash.block_sparse_attention(q, k, v, mask, backend="triton", return_lse=True)
        out.sum().backward()
        with torch.no_grad():
            inference = sparse_flash.block_sparse_attention(q, k, v, mask, backend="triton")
    assert out.shape == q.shape and lse.shape == (2, 4, 256) and lse.dtype == torch.float32
    assert q.grad.shape == q.shape and inference.shape == q.shape


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_fullgraph_traces_no_functools_cache(backend):
    """Dynamo warns where it traces through a functools cache (it ignores the cache): the backend choice (is
    Triton installed? the kernels' entry point) and a top-k mask built in the graph (the causal blocks of its
    geometry) read no such cache there. The top-k mask is non-causal, with more keys than queries and enough
    blocks kept per row to maybe hold every causal block: the path that counts them."""
    scores = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    q = torch.randn(1, 2, 64, 16, device=DEVICE, requires_grad=True)
    kv = torch.randn(1, 2, 128, 16, device=DEVICE, requires_grad=True)
    sparse_flash.BlockMask.from_topk(scores, 5, block_size=16, seq_len_k=128).row_index(True)  # first use: eager

    def attend(q, kv, scores):
        mask = sparse_flash.BlockMask.from_topk(scores, 5, block_size=16, seq_len_k=128)
        return sparse_flash.block_sparse_attention(q, kv, kv, mask, backend=backend)

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(attend, fullgraph=True, backend="aot_eager")(q, kv, scores)
        out.square().sum().backward()
    assert not [str(w.message) for w in caught if "lru_cache" in str(w.message)]
    torch.testing.assert_close(out, attend(q, kv, scores), atol=1e-5, rtol=1e-4)


def test_index_arena_traces_no_functools_cache():
    """The GPU builders' int32 arena (`index_gpu.int32_pieces`, which a top-k mask built inside a compiled
    function on a GPU allocates) places its pieces without a functools cache under dynamo, and in the same
    places as eagerly. On a CPU the builders themselves do not run, so the arena is traced here directly."""
    pytest.importorskip("triton")
    from sparse_flash import index_gpu

    shapes, own = [(2, 3), (4,), (5, 7)], [1]

    def pieces(x):
        return [p.fill_(1).add(x) for p in index_gpu.int32_pieces(shapes, x.device, own)]

    x = torch.zeros((), dtype=torch.int32)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.compile(pieces, fullgraph=True, backend="aot_eager")(x)
    assert not [str(w.message) for w in caught if "lru_cache" in str(w.message)]
    eager = index_gpu.int32_pieces(shapes, x.device, own)
    assert [tuple(t.shape) for t in traced] == [tuple(t.shape) for t in eager] == [tuple(s) for s in shapes]
    assert [t.stride() for t in traced] == [t.stride() for t in eager]


def test_a_non_causal_top_k_mask_chosen_inside_fullgraph_compile_builds_and_says_why_causal_use_cannot():
    """A top-k mask chosen with causal=False builds its causal=True lists on first use, which waits for the
    device: chosen inside torch.compile(fullgraph=True) it attends without causal alike; used with causal=True
    there, the error says what to do; without fullgraph Dynamo runs that frame eagerly and the result is right.
    Each graph starts from a reset Dynamo (the mask's module keeps no state that an earlier use could set)."""
    scores = torch.randn(1, 2, 8, 8, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    q = torch.randn(1, 2, 128, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def attend(q, scores, causal):
        mask = sparse_flash.BlockMask.from_topk(scores, 3, block_size=16, seq_len_q=128, seq_len_k=128)
        return sparse_flash.block_sparse_attention(q, q, q, mask, causal=causal, backend="torch")

    for causal, fullgraph in ((False, True), (True, False)):
        torch._dynamo.reset()
        out = torch.compile(attend, fullgraph=fullgraph, backend="aot_eager")(q, scores, causal)
        torch.testing.assert_close(out, attend(q, scores, causal), atol=1e-5, rtol=1e-4)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="Use the mask once with causal=True before the compiled call"):
        torch.compile(attend, fullgraph=True, backend="aot_eager")(q, scores, True)


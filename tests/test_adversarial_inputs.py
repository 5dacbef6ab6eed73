"""Arguments a hostile but realistic user passes to the mask constructors, the interop functions, the nn layer
and the command line: each is refused with an error that names the argument, the expected and the actual
value (never a ZeroDivisionError, an OverflowError or a traceback), or accepted with a defined meaning."""

import copy
import io
import math
import pickle

import numpy as np
import pytest
import torch
from conftest import DEVICE, triton_usable

from sparse_flash import cli, masks
from sparse_flash.interop import from_dense, from_deepspeed, to_deepspeed, to_flex
from sparse_flash.nn import MASK_CACHE_SIZE, BlockSparseAttention

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- mask constructors
@pytest.mark.parametrize("call, error, match", [
    (lambda: masks.longformer(1024, 128, global_block_indices=[0, 99]), ValueError,
     r"global_block_indices must name blocks below 8 \(the mask has 8 x 8 blocks\), got 99 in \[0, 99\]"),
    (lambda: masks.longformer(1024, 128, global_block_indices=[2], global_block_end_indices=[99]), ValueError,
     r"global_block_end_indices must be at most 8 \(the mask has 8 x 8 blocks\), got 99 in \[99\]"),
    (lambda: masks.longformer(1024, 128, global_block_indices={1: 2}), TypeError,
     r"global_block_indices must be a sequence of block indices such as \(0, 16\), got dict"),
    (lambda: masks.longformer(1024, 128, global_block_indices={0, 2}), TypeError, r"got set"),
    (lambda: masks.longformer(1024, 128, global_block_indices=0), TypeError,
     r"global_block_indices must be a sequence of block indices such as \(0, 16\), got int 0"),
    (lambda: masks.longformer(1024, 128, global_block_indices="0,4"), TypeError,
     r"global_block_indices must be a sequence of block indices such as \(0, 16\), got str '0,4'"),
    (lambda: masks.longformer(1024, 128, global_block_indices=[1.0]), TypeError,
     r"global_block_indices\[0\] must be an int, got float 1.0"),
    (lambda: masks.longformer(1024, 128, global_block_indices=[-1]), ValueError,
     r"global_block_indices\[0\] must be at least 0, got -1"),
    (lambda: masks.longformer(1024, 128, global_block_indices=[1, 3, 1]), ValueError,
     r"global_block_indices must not repeat a block, got \[1, 3, 1\]"),
    (lambda: masks.longformer(1024, 128, num_sliding_window_blocks=2), ValueError,
     r"num_sliding_window_blocks must be odd \(a window centred on the diagonal: 3 means \+-1\), got 2"),
    (lambda: masks.bigbird(1024, 128, num_sliding_window_blocks=4), ValueError,
     r"num_sliding_window_blocks must be odd .* got 4"),
    (lambda: masks.bigbird(1024, 128, num_sliding_window_blocks=0), ValueError,
     r"num_sliding_window_blocks must be at least 1, got 0"),
    (lambda: masks.local(1024, 128, causal="yes"), TypeError, r"causal must be a bool, got str 'yes'"),
    (lambda: masks.bigbird(1024, 128, causal=1), TypeError, r"causal must be a bool, got int 1"),
    (lambda: masks.longformer(1024, 128, causal="no"), TypeError, r"causal must be a bool, got str 'no'"),
    (lambda: masks.fixed(1024, 128, causal="yes"), TypeError, r"causal must be a bool, got str 'yes'"),
    (lambda: masks.fixed(1024, 128, horizontal_global_attention="yes"), TypeError,
     r"horizontal_global_attention must be a bool, got str 'yes'"),
    (lambda: masks.local(1024, 128, window=True), TypeError, r"window must be an int, got bool True"),
    (lambda: masks.local(1024, 128, window=10**30), ValueError,
     r"window must be at most 9223372036854775807, got 10{30}"),
    (lambda: masks.local(10**30, 128), ValueError, r"seq_len must be at most 9223372036854775807, got 10{30}"),
    (lambda: masks.dense(10**12, 128), ValueError,
     r"seq_len=1000000000000, seq_len_k=1000000000000 and block_size \(128, 128\) give 1 x 7812500000 x "
     r"7812500000 = 61035156250000000000 blocks, more than the 2147483647 .*int32 index lists"),
    (lambda: masks.random(1024, 64, density=0.5, num_heads=2**25), ValueError, r"8589934592 blocks, more than"),
    (lambda: masks.butterfly(1024, 128, n_factors=100), ValueError, r"n_factors must be at most 31, got 100"),
    (lambda: masks.butterfly(1024, 128, n_factors=2.0), TypeError, r"n_factors must be an int, got float 2.0"),
    (lambda: masks.random(1024, 128, density=0.5, seed=2**64), ValueError,
     r"seed must be an int in \[0, 2\*\*64 - 1\] or a torch.Generator, got 18446744073709551616"),
    (lambda: masks.bigbird(1024, 128, seed=-1), ValueError, r"seed must be an int in \[0, 2\*\*64 - 1\] .* got -1"),
    (lambda: masks.random(1024, 128, density=0.5, seed=1.5), TypeError,
     r"seed must be an int in \[0, 2\*\*64 - 1\] or a torch.Generator, got float 1.5"),
    (lambda: masks.random(1024, 128, density=math.nan), ValueError, r"density must be a float in \[0, 1\], got nan"),
    (lambda: masks.random(1024, 128, density=-math.inf), ValueError, r"density must be a float in \[0, 1\], got -inf"),
    (lambda: masks.random(1024, 128, density=True), TypeError, r"density must be a float in \[0, 1\], got bool True"),
    (lambda: masks.fixed(1024, (64, 128)), ValueError,
     r"fixed needs square blocks \(one grid for queries and keys\), got block_size \(64, 128\)"),
    (lambda: masks.strided(1024, (128, 64)), ValueError,
     r"strided needs square blocks \(one grid for queries and keys\), got block_size \(128, 64\)"),
    (lambda: masks.build(["local"], 1024), TypeError, r"name must be a pattern name \(str\), got list"),
], ids=[
    "longformer-index-past-last-block", "longformer-end-past-last-block", "longformer-index-dict",
    "longformer-index-set", "longformer-index-int",
    "longformer-index-str", "longformer-index-float", "longformer-index-negative", "longformer-index-repeated",
    "longformer-even-window", "bigbird-even-window", "bigbird-zero-window", "local-causal-str", "bigbird-causal-int",
    "longformer-causal-str", "fixed-causal-str", "fixed-horizontal-str", "local-window-bool", "local-window-huge",
    "seq-len-huge", "layout-past-int32-lists", "heads-past-int32-lists", "butterfly-100-factors",
    "butterfly-float-factors", "random-seed-2**64", "bigbird-seed-negative", "random-seed-float",
    "random-density-nan", "random-density-inf", "random-density-bool", "fixed-non-square-blocks",
    "strided-non-square-blocks", "build-name-not-str",
])
def test_mask_constructor_refuses(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("call, same_as", [
    (lambda: masks.local(512, 64, causal=np.bool_(True)), lambda: masks.local(512, 64, causal=True)),
    (lambda: masks.bigbird(512, 64, causal=np.bool_(True)), lambda: masks.bigbird(512, 64, causal=True)),
    (lambda: masks.local(512, np.int64(64), window=np.int32(2)), lambda: masks.local(512, 64, window=2)),
    (lambda: masks.random(512, 64, density=np.float32(0.5), seed=np.uint64(3)),
     lambda: masks.random(512, 64, density=0.5, seed=3)),
    (lambda: masks.longformer(512, 64, global_block_indices=np.array([0, 5])),
     lambda: masks.longformer(512, 64, global_block_indices=[0, 5])),
    (lambda: masks.longformer(512, 64, global_block_indices=torch.tensor([0, 5])),
     lambda: masks.longformer(512, 64, global_block_indices=(0, 5))),
], ids=["local-numpy-bool", "bigbird-numpy-bool", "numpy-ints", "numpy-float-and-seed", "numpy-indices",
        "tensor-indices"])
def test_numpy_and_tensor_values_are_accepted(call, same_as):
    assert call() == same_as()


def test_counts_past_the_grid_saturate():
    """Counts are exact by their definitions on any grid: a window or a number of factors or of global blocks
    larger than the grid means all of it."""
    assert masks.butterfly(1024, 128, n_factors=31) == masks.butterfly(1024, 128)
    assert masks.local(1024, 128, window=2**63 - 1).is_dense
    assert masks.global_(1024, 128, num_global_blocks=2**63 - 1).is_dense
    assert masks.fixed(1024, 128, num_local_blocks=2**40, num_global_blocks=2**39).is_dense


def test_longformer_ranges_may_share_an_end():
    """Starts must be distinct; overlapping global ranges (here sharing their end) are their union."""
    shared = masks.longformer(1024, 128, global_block_indices=[0, 2], global_block_end_indices=[4, 4])
    assert shared == masks.longformer(1024, 128, global_block_indices=[0], global_block_end_indices=[4])


# ---------------------------------------------------------------- interop
@pytest.mark.parametrize("call, error, match", [
    (lambda: from_dense(torch.ones(0, 8, 8, dtype=torch.bool), 4), ValueError,
     r"element_mask must have at least one batch and one head, got shape \(0, 8, 8\)"),
    (lambda: from_dense(torch.ones(0, 1, 8, 8, dtype=torch.bool), 4), ValueError,
     r"element_mask must have at least one batch and one head, got shape \(0, 1, 8, 8\)"),
    (lambda: from_deepspeed(torch.ones(4, 4, dtype=torch.int64), 0, seq_len=64), ValueError,
     r"block_size must be at least 1, got 0"),
    (lambda: from_deepspeed(torch.ones(0, 4, 4, dtype=torch.int64), 16), ValueError,
     r"layout must have at least one head, got shape \(0, 4, 4\)"),
    (lambda: from_deepspeed(torch.ones(4, 4, dtype=torch.int64), 16, seq_len=100), ValueError,
     r"seq_len must be an int from 49 to 64 \(ceil\(seq_len / 16\) == 4, the layout's blocks\), got 100"),
    (lambda: to_flex(masks.local(256, 128), causal="yes"), TypeError, r"causal must be a bool, got str 'yes'"),
    (lambda: to_flex(torch.ones(2, 2)), TypeError, r"mask must be a sparse_flash.BlockMask, got Tensor"),
], ids=["from-dense-zero-heads", "from-dense-zero-batch", "from-deepspeed-zero-block", "from-deepspeed-zero-heads",
        "from-deepspeed-seq-len-range", "to-flex-causal-str", "to-flex-not-a-mask"])
def test_interop_refuses(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_from_dense_block_larger_than_the_lengths():
    mask = from_dense(torch.eye(5, dtype=torch.bool), 2**40)
    assert mask.shape == (1, 1, 1, 1) and mask.nnz == 1 and (mask.seq_len_q, mask.seq_len_k) == (5, 5)


def test_interop_accepts_numpy_values():
    assert to_deepspeed(masks.local(512, 128), num_heads=np.int64(2)).shape == (2, 4, 4)
    assert from_deepspeed(torch.eye(4, dtype=torch.int64), np.int64(16), seq_len=np.int64(60)).seq_len_q == 60


# ---------------------------------------------------------------- nn layer
@pytest.mark.parametrize("kwargs, error, match", [
    ({"mask": "local", "mask_params": {"window": -1}}, ValueError,
     r"mask_params of pattern 'local' are invalid: window must be at least 0, got -1"),
    ({"mask": "random"}, TypeError, r"mask pattern 'random' needs 'density' in mask_params, got mask_params \{\}"),
    ({"mask": "random", "mask_params": {"density": math.nan}}, ValueError,
     r"mask_params of pattern 'random' are invalid: density must be a float in \[0, 1\], got nan"),
    ({"mask": "longformer", "mask_params": {"global_block_indices": 0}}, TypeError,
     r"mask_params of pattern 'longformer' are invalid: global_block_indices must be a sequence"),
    ({"mask": "local", "mask_params": [("window", 1)]}, TypeError,
     r"mask_params must be a dict of pattern parameters or None, got list"),
    ({"causal": "yes"}, TypeError, r"causal must be a bool, got str 'yes'"),
    ({"bias": "no"}, TypeError, r"bias must be a bool, got str 'no'"),
    ({"dropout": math.nan}, ValueError, r"dropout must be a float in \[0, 1\], got nan"),
    ({"embed_dim": 64.0}, TypeError, r"embed_dim must be an int, got float 64.0"),
], ids=["window-negative", "random-without-density", "density-nan", "indices-int", "params-not-a-dict",
        "causal-str", "bias-str", "dropout-nan", "embed-dim-float"])
def test_layer_refuses_at_construction(kwargs, error, match):
    kwargs = {"embed_dim": 64, "num_heads": 4, "block_size": 16, **kwargs}
    with pytest.raises(error, match=match):
        BlockSparseAttention(**kwargs)


def test_layer_accepts_numpy_values():
    layer = BlockSparseAttention(np.int64(32), np.int64(2), mask="local", mask_params={"window": np.int64(1)},
                                 block_size=np.int64(16), causal=np.bool_(True), dropout=np.float32(0.0),
                                 backend="torch")
    assert layer.causal is True and layer(torch.randn(1, 40, 32)).shape == (1, 40, 32)


def test_layer_grid_parameters_are_checked_per_length():
    """A global block past the end of a short input is refused when that input comes, naming the lengths."""
    layer = BlockSparseAttention(32, 2, mask="longformer", mask_params={"global_block_indices": [0, 5]},
                                 block_size=16, backend="torch")
    assert layer(torch.randn(1, 96, 32)).shape == (1, 96, 32)
    with pytest.raises(ValueError, match=r"cannot build its 'longformer' mask for lengths \(64, 64\): "
                                         r"global_block_indices must name blocks below 4"):
        layer(torch.randn(1, 64, 32))


def test_layer_mask_cache_is_a_bounded_lru():
    layer = BlockSparseAttention(32, 2, mask="local", block_size=16, backend="torch")
    first = layer.prepare(16)
    for n in range(17, 17 + MASK_CACHE_SIZE - 1):
        layer.prepare(n)
    assert layer.prepare(16) is first  # a hit makes it the most recent
    for n in range(100, 100 + MASK_CACHE_SIZE - 1):
        layer.prepare(n)
    assert len(layer._masks) == MASK_CACHE_SIZE
    assert layer.prepare(16) is first and (17, 17, "cpu") not in layer._masks


def _round_trips():
    def saved(layer):
        buffer = io.BytesIO()
        torch.save(layer, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    return [lambda layer: pickle.loads(pickle.dumps(layer)), saved, copy.deepcopy]


@pytest.mark.parametrize("round_trip", _round_trips(), ids=["pickle", "torch-save", "deepcopy"])
@pytest.mark.parametrize("mask, backend", [
    ("local", "torch"), (masks.local(48, 16), "torch"), (masks.local(48, 16), "triton"),
], ids=["pattern", "block-mask", "block-mask-after-triton"])
def test_layer_round_trips_after_a_forward(round_trip, mask, backend):
    device = "cpu"
    if backend == "triton":  # CPU tensors under the interpreter, the GPU's where there is one
        if not triton_usable():
            pytest.skip("triton is not usable here")
        device, mask = DEVICE, mask.to(DEVICE)
    layer = BlockSparseAttention(16, 2, mask=mask, block_size=16, backend=backend, device=device)
    x = torch.randn(1, 48, 16, device=device)
    size = len(pickle.dumps(layer))
    before = layer(x)
    assert len(pickle.dumps(layer)) == size  # caches are rebuilt on demand, never serialised
    copied = round_trip(layer)
    assert not copied._masks
    torch.testing.assert_close(copied(x), before)
    assert len(layer._masks) == (1 if isinstance(mask, str) else 0)  # the original keeps its cache


# ---------------------------------------------------------------- command line
def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, message", [
    (["masks", "show", "local", "--seq-len", "256", "--png", "x.txt"],
     "--png must name a .png file (or a name without a suffix), got 'x.txt'"),
    (["masks", "gallery", "x.jpg"], "OUT must name a .png file (or a name without a suffix), got 'x.jpg'"),
    (["masks", "show", "butterfly", "--param", "n_factors=100"], "n_factors must be at most 31, got 100"),
    (["masks", "show", "local", "--seq-len", str(10**30)], "--seq-len must be at most 9223372036854775807"),
    (["masks", "show", "local", "--seq-len", str(10**12)], "more than the 2147483647"),
    (["masks", "gallery", "g.png", "--seq-len", "0"], "--seq-len must be at least 1, got 0"),
    (["masks", "show", "local", "--block-size", "-4"], "--block-size must be at least 1, got -4"),
    (["masks", "show", "random", "--param", "density=nan"], "density must be a float in [0, 1], got nan"),
    (["masks", "show", "local", "--param", "window=1", "--param", "window=2"],
     "--param window must be given once, got window=1 and window=2"),
    (["masks", "show", "nope"], "unknown mask pattern 'nope'"),
], ids=["png-suffix", "gallery-suffix", "n-factors-100", "seq-len-past-int64", "seq-len-past-int32-lists",
        "gallery-seq-len-0", "block-size-negative", "density-nan", "param-repeated", "pattern-unknown"])
def test_cli_bad_argument_is_one_line_and_exit_2(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, *argv)
    assert (code, err.count("\n")) == (2, 1), err
    assert err.startswith("sparse-flash: error: ") and message in err
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("argv", [
    lambda path: ["masks", "show", "local", "--seq-len", "256", "--png", path],
    lambda path: ["masks", "gallery", path, "--seq-len", "512"],
], ids=["show", "gallery"])
def test_cli_png_without_suffix_writes_the_named_file(capsys, tmp_path, argv):
    pytest.importorskip("matplotlib")
    path = tmp_path / "noext"
    code, out, _ = run(capsys, *argv(str(path)))
    assert code == 0 and f"wrote {path}\n" in out
    assert path.read_bytes().startswith(PNG_MAGIC)
    assert [p.name for p in tmp_path.iterdir()] == ["noext"]

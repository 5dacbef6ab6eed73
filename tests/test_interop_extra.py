"""Element masks and DeepSpeed layouts to and from BlockMask."""

import pytest
import torch

from sparse_flash import BlockMask, masks
from sparse_flash.interop import from_deepspeed, from_dense, to_deepspeed


# ------------------------------------------------------------------------------------------ from_dense
@pytest.mark.parametrize("block_size", [64, (32, 64), (16, 48)], ids=str)
def test_from_dense_of_a_block_mask_gives_it_back(block_size):
    mask = masks.random(1000, block_size, density=0.3, seed=2, num_heads=3) | masks.local(1000, block_size, window=0)
    back = BlockMask.from_dense(mask.to_dense(), block_size)
    assert back == mask
    assert (back.seq_len_q, back.seq_len_k) == (1000, 1000)


def test_from_dense_keeps_a_block_when_any_element_is_allowed():
    allowed = torch.zeros(2, 3, 100, 70, dtype=torch.bool)
    allowed[0, 1, 99, 69] = True  # the last element of a partial corner block
    allowed[1, 2, 0, 40] = True
    mask = from_dense(allowed, 32)
    assert mask.shape == (2, 3, 4, 3)
    assert (mask.seq_len_q, mask.seq_len_k) == (100, 70)
    expected = torch.zeros(2, 3, 4, 3, dtype=torch.bool)
    expected[0, 1, 3, 2] = expected[1, 2, 0, 1] = True
    assert torch.equal(mask.layout, expected)


@pytest.mark.parametrize("n", [256, 300])
def test_from_dense_of_a_band(n):
    i = torch.arange(n)
    band = (i[:, None] - i[None, :]).abs() <= 10
    mask = from_dense(band, 64, name="band")
    assert torch.equal(mask.layout[0, 0], masks.local(n, 64, window=1).layout[0, 0])
    assert mask.name == "band"
    assert mask.to_dense()[0, 0][band].all()  # the block mask covers every allowed pair


@pytest.mark.parametrize(
    "element_mask, error, match",
    [
        (torch.zeros(10, 10), TypeError, r"bool tensor .* got dtype torch.float32; .* `mask == 0`"),
        (torch.zeros(10, dtype=torch.bool), ValueError, r"shape \(Nq, Nk\).* got shape \(10,\)"),
        (torch.zeros(1, 1, 1, 4, 4, dtype=torch.bool), ValueError, r"got shape \(1, 1, 1, 4, 4\)"),
        (torch.zeros(4, 0, dtype=torch.bool), ValueError, r"Nq, Nk >= 1, got shape \(4, 0\)"),
        ([[True]], TypeError, "must be a torch.Tensor, got list"),
    ],
    ids=["float", "1d", "5d", "empty", "list"],
)
def test_from_dense_errors(element_mask, error, match):
    with pytest.raises(error, match=match):
        from_dense(element_mask, 16)


# ------------------------------------------------------------------------------------------ DeepSpeed
@pytest.mark.parametrize("seq_len", [1024, 1000])
def test_deepspeed_round_trip(seq_len):
    mask = masks.bigbird(seq_len, 64, num_heads=4, seed=5)
    layout = to_deepspeed(mask)
    assert layout.dtype == torch.int64 and layout.shape == (4, 16, 16)
    assert set(layout.unique().tolist()) <= {0, 1}
    back = BlockMask.from_deepspeed(layout, 64, seq_len=seq_len)
    assert back == mask
    assert back.shape == (1, 4, 16, 16)


def test_from_deepspeed_defaults_and_inputs():
    layout = torch.eye(4, dtype=torch.int32).expand(2, 4, 4)
    mask = from_deepspeed(layout, 32)
    assert (mask.seq_len_q, mask.seq_len_k, mask.block_size) == (128, 128, (32, 32))
    assert from_deepspeed(layout.tolist(), 32) == mask  # nested lists and numpy arrays work too
    assert from_deepspeed(layout.numpy(), 32) == mask
    assert from_deepspeed(layout[0].bool(), 32).shape == (1, 1, 4, 4)
    assert to_deepspeed(mask).tolist() == layout.tolist()


def test_to_deepspeed_expands_shared_heads():
    mask = masks.local(512, 128)
    assert to_deepspeed(mask).shape == (1, 4, 4)
    expanded = to_deepspeed(mask, num_heads=3)
    assert expanded.shape == (3, 4, 4) and expanded.is_contiguous()
    assert torch.equal(expanded[2], mask.layout[0, 0].long())


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: from_deepspeed(torch.ones(2, 4, 5), 16), ValueError, r"\(H, nb, nb\).* got shape \(2, 4, 5\)"),
        (lambda: from_deepspeed(torch.ones(1, 2, 4, 4), 16), ValueError, r"got shape \(1, 2, 4, 4\)"),
        (lambda: from_deepspeed(torch.full((4, 4), 2), 16), ValueError, "only 0 and 1"),
        (lambda: from_deepspeed(torch.ones(4, 4), 16), TypeError, "bool or integer"),
        (lambda: from_deepspeed(torch.ones(4, 4, dtype=torch.int64), (16, 32)), TypeError, "square blocks"),
        (lambda: from_deepspeed(torch.ones(4, 4, dtype=torch.int64), 16, seq_len=100), ValueError,
         r"seq_len must be an int from 49 to 64 \(ceil\(seq_len / 16\) == 4, .*\), got 100"),
        (lambda: to_deepspeed(masks.local(256, (32, 64))), ValueError, r"square blocks, got block_size \(32, 64\)"),
        (lambda: to_deepspeed(masks.local(256, 32, seq_len_k=128)), ValueError, "got 256 and 128"),
        (lambda: to_deepspeed(BlockMask.from_layout(torch.ones(2, 1, 2, 2, dtype=torch.bool), 16)), ValueError,
         "batch size must be 1, got 2"),
        (lambda: to_deepspeed(masks.random(64, 16, density=0.5, num_heads=2), num_heads=4), ValueError,
         "num_heads=4 does not match the mask's 2 heads"),
        (lambda: to_deepspeed(torch.ones(2, 2)), TypeError, "must be a sparse_flash.BlockMask, got Tensor"),
    ],
    ids=["not-square", "4d", "not-0-1", "float", "pair-block", "seq-len", "to-pair-block", "to-cross", "to-batch",
         "to-heads", "to-tensor"],
)
def test_deepspeed_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()

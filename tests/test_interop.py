"""BlockMask <-> FlexAttention conversions give the same attention."""

import pytest
import torch
from conftest import DEVICE

from sparse_flash import BlockMask, masks
from sparse_flash.reference import attention_reference

flex_attention = pytest.importorskip("torch.nn.attention.flex_attention")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [256, 1000])
def test_to_flex_computes_the_same_attention(causal, n):
    mask = masks.bigbird(n, 64, num_heads=4, device=DEVICE) | masks.random(n, 64, density=0.1, num_heads=4, device=DEVICE)
    q, k, v = (torch.randn(2, 4, n, 32, device=DEVICE) for _ in range(3))
    ours = flex_attention.flex_attention(q, k, v, block_mask=mask.to_flex(causal))
    ref, _ = attention_reference(q, k, v, mask, causal=causal)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_flex_round_trip(causal):
    mask = masks.random(777, (32, 64), density=0.4, seed=3, num_heads=2, device=DEVICE)
    back = BlockMask.from_flex(mask.to_flex(causal))
    expected = mask.layout & masks.causal(777, (32, 64), device=DEVICE).layout if causal else mask.layout
    assert torch.equal(back.layout, expected)
    assert (back.seq_len_q, back.seq_len_k, back.block_size) == (777, 777, (32, 64))


def test_to_flex_owns_its_tensors():
    """The FlexAttention mask's counts are copies: editing them leaves the mask (and its next conversion) alone."""
    mask = masks.local(512, 128, window=1, device=DEVICE)
    before = mask.kernel_index(False).row_full.counts.clone()
    fm = mask.to_flex()
    for t in (fm.kv_num_blocks, fm.full_kv_num_blocks, fm.kv_indices, fm.full_kv_indices):
        t.zero_()
    assert torch.equal(mask.kernel_index(False).row_full.counts, before)
    assert BlockMask.from_flex(mask.to_flex()) == mask


def test_from_flex_of_create_block_mask():
    def sliding(b, h, q, kv):
        return (q - kv).abs() <= 100

    fm = flex_attention.create_block_mask(sliding, None, None, 1024, 1024, device=DEVICE, BLOCK_SIZE=128)
    back = BlockMask.from_flex(fm)
    assert torch.equal(back.layout[0, 0], masks.local(1024, 128, window=1, device=DEVICE).layout[0, 0])

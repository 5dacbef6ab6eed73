"""GPU-only checks: memory at 65,536 tokens (no N^2 buffer anywhere)."""

import gc
import json
import os

import pytest
import torch

import sparse_flash
from sparse_flash import masks

pytestmark = pytest.mark.gpu


def test_peak_memory_at_65536_tokens_stays_near_the_tensors():
    B, H, N, D = 1, 8, 65536, 64
    mask = masks.butterfly(N, 128, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    sparse_flash.block_sparse_attention(q, k, v, mask).backward(do)  # compile the kernels first
    q.grad = k.grad = v.grad = None
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()  # includes whatever earlier tests in this process still hold
    torch.cuda.reset_peak_memory_stats()
    out = sparse_flash.block_sparse_attention(q, k, v, mask)
    torch.cuda.synchronize()
    forward_peak = torch.cuda.max_memory_allocated()
    out.backward(do)
    torch.cuda.synchronize()
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v, do))
    peak = torch.cuda.max_memory_allocated() - before + inputs  # this computation's peak, inputs included
    tensors = inputs + sum(t.numel() * t.element_size() for t in (out, q.grad, k.grad, v.grad))
    record = {"N": N, "B": B, "H": H, "D": D, "dtype": "bfloat16", "mask": "butterfly",
              "peak_bytes": peak, "tensor_bytes": tensors, "ratio": peak / tensors,
              "allocated_before_bytes": before, "forward_peak_bytes": forward_peak,
              "after_backward_bytes": torch.cuda.memory_allocated(),
              "naive_scores_bytes_bf16": B * H * N * N * 2}
    path = os.environ.get("SPARSE_FLASH_MEMORY_LOG")
    if path:
        with open(path, "w") as f:
            json.dump(record, f, indent=2)
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
    assert peak <= 1.1 * tensors, record

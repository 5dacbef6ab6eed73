"""Bad input gets a ValueError or TypeError that names the argument, what was expected and what came."""

import os

import pytest
import torch
from conftest import triton_usable

import sparse_flash
from sparse_flash import masks


def qkv(B=1, Hq=2, Hkv=2, Nq=64, Nk=64, D=16, dtype=torch.float32):
    return tuple(torch.randn(B, H, N, D).to(dtype) for H, N in ((Hq, Nq), (Hkv, Nk), (Hkv, Nk)))


MASK = masks.dense(64, 32)


def call(q, k, v, mask=MASK, **kw):
    return sparse_flash.block_sparse_attention(q, k, v, mask, backend=kw.pop("backend", "torch"), **kw)


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: call(*qkv()[:2], "v"), TypeError, "v must be a torch.Tensor, got str"),
        (lambda: call(torch.randn(2, 64, 16), *qkv()[1:]), ValueError, r"q must have shape \(batch, heads, seq, head_dim\), got shape \(2, 64, 16\)"),
        (lambda: call(*qkv(dtype=torch.int32)), TypeError, "q must be float16, bfloat16, float32 or float64, got torch.int32"),
        (lambda: call(qkv()[0].half(), *qkv()[1:]), TypeError, "share one dtype"),
        (lambda: call(qkv(B=2)[0], *qkv()[1:], mask=MASK), ValueError, "batch size 2, got 1"),
        (lambda: call(qkv(Hq=3)[0], *qkv()[1:]), ValueError, r"q's heads \(3\) must be a multiple of k's and v's heads \(2\)"),
        (lambda: call(qkv()[0], qkv()[1], qkv(Nk=32)[2]), ValueError, "k and v must have the same shape"),
        (lambda: call(qkv(D=32)[0], *qkv()[1:]), ValueError, "head_dim 32, got 16"),
        (lambda: call(*qkv(D=4)), ValueError, "head_dim must be between 8 and 256, got 4"),
        (lambda: call(*qkv(D=320)), ValueError, "head_dim must be between 8 and 256, got 320"),
        (lambda: call(*qkv(), mask=torch.ones(2, 2)), TypeError, "mask must be a sparse_flash.BlockMask, got Tensor"),
        (lambda: call(*qkv(), mask=masks.dense(128, 32)), ValueError, r"mask covers .* \(128, 128\) .* lengths \(64, 64\)"),
        (lambda: call(*qkv(Nk=70), mask=MASK), ValueError, r"lengths \(64, 70\)"),
        (lambda: call(*qkv(), mask=masks.random(64, 32, density=0.5, num_heads=3)), ValueError, "head count must be 1 or q's head count 2, got 3"),
        (lambda: call(*qkv(), causal=1), TypeError, "causal must be a bool, got int"),
        (lambda: call(*qkv(), scale="big"), TypeError, "scale must be a float or None, got str"),
        (lambda: call(*qkv(), backend="cuda"), ValueError, "backend must be one of"),
        (lambda: call(qkv()[0], *(torch.randn(1, 0, 64, 16) for _ in range(2))), ValueError,
         r"q's heads \(2\) must be a multiple of k's and v's heads \(0\)"),
        (lambda: sparse_flash.flash_attention(torch.randn(2, 8), *qkv()[1:]), ValueError, "q must have shape"),
    ],
)
def test_bad_input_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs two devices")
def test_tensors_on_different_devices():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="one device"):
        call(q.cuda(), k, v)


def test_explicit_triton_backend_never_falls_back(monkeypatch):
    q, k, v = qkv()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("CPU tensors are the unusable case here")
    with pytest.raises(RuntimeError, match="backend='triton' was requested but cannot run: .*CUDA"):
        call(q, k, v, backend="triton")
    # auto picks the torch backend instead, and says nothing
    out = call(q, k, v, backend="auto")
    assert out.shape == q.shape


@pytest.mark.parametrize("triton_version,torch_version", [("3.1.0", None), ("3.5.1", None), (None, "2.10.0+cu128")])
def test_an_untested_triton_or_torch_is_a_clear_error_and_builds_masks_without_triton(monkeypatch, triton_version,
                                                                                      torch_version):
    """Older than the tested floors (`checks.TRITON_FLOOR`, `TORCH_FLOOR`; pyproject's requirements): an
    explicit triton backend says which versions it needs and found, auto takes the torch backend, and masks are
    built by the torch operators (no Triton launch)."""
    triton = pytest.importorskip("triton")
    from sparse_flash import checks, mask_index

    monkeypatch.setattr(checks, "_TRITON_PROBLEM", {})  # asked again under the patched versions
    if triton_version is not None:
        monkeypatch.setattr(triton, "__version__", triton_version)
    if torch_version is not None:
        monkeypatch.setattr(torch, "__version__", torch_version)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match=r"backend='triton' was requested but cannot run: the triton kernels need "
                                           r"triton >= 3\.6 and torch >= 2\.11, found triton .* and torch "):
        call(q, k, v, backend="triton")
    assert call(q, k, v, backend="auto").shape == q.shape
    assert mask_index._index_gpu() is None
    monkeypatch.setattr(checks, "_TRITON_PROBLEM", {})  # the floors themselves pass
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(torch, "__version__", "2.11.0")
    assert checks.triton_problem() is None


@pytest.mark.skipif(not triton_usable(), reason="triton is not usable here")
def test_triton_rejects_float64_and_odd_blocks():
    q, k, v = qkv(dtype=torch.float64)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with pytest.raises(TypeError, match="float16, bfloat16 and float32 inputs, got torch.float64"):
        call(q.to(dev), k.to(dev), v.to(dev), backend="triton")
    q, k, v = (t.float().to(dev) for t in (q, k, v))
    with pytest.raises(ValueError, match=r"multiples of 16, got \(24, 24\)"):
        call(q, k, v, mask=masks.dense(64, 24, device=dev), backend="triton")
    with pytest.raises(ValueError, match=r"multiples of 16, got \(24, 24\)"):  # refused for empty inputs too
        call(q[:0], k[:0], v[:0], mask=masks.dense(64, 24, device=dev), backend="triton")


def test_import_needs_torch_alone():
    """`import sparse_flash` must not load triton, matplotlib or hypothesis."""
    import subprocess
    import sys

    code = (
        "import sys, sparse_flash, sparse_flash.masks;"
        "bad = [m for m in ('triton', 'matplotlib', 'hypothesis') if m in sys.modules];"
        "assert not bad, bad"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)

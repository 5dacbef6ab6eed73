"""The two ways the kernels fetch their streamed tiles: TMA tensor descriptors and pointer loads.

The other tests run the library's defaults (under the interpreter, as on a Hopper GPU: descriptors in the
forward everywhere, in the backward at head dims 65-128). Here each path runs alone in every pass on
random problems, against the same reference: pointer loads (older GPUs, misaligned tensors) and
descriptor loads; and the choice between the two is checked tensor by tensor.
"""

import contextlib

import pytest
import torch
from conftest import DEVICE, examples, fresh_plans, triton_usable
from hypothesis import example, given, settings
from strategies import Problem, problems

from sparse_flash.testing import compare_to_reference, make_qkv

pytestmark = pytest.mark.skipif(not triton_usable(), reason="triton is not usable here")


@contextlib.contextmanager
def loads(kind):
    """"pointer": no descriptors anywhere; "descriptor": descriptors in every pass at every head dim
    (the defaults use them only where they measured faster, configs.py)."""
    from sparse_flash.kernels import settings
    from sparse_flash.kernels.triton import bwd, configs, fwd

    with settings.override(tma=kind == "descriptor"), pytest.MonkeyPatch.context() as mp, fresh_plans():
        if kind == "descriptor":
            mp.setattr(fwd, "fwd_config", lambda *a: configs.fwd_config(*a)._replace(tma=True))
            mp.setattr(bwd, "bwd_config", lambda *a: configs.bwd_config(*a)._replace(tma=True))
        yield


@pytest.mark.parametrize("kind", ["pointer", "descriptor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@settings(max_examples=examples(10))  # the way of loading tiles is one switch: fewer draws than the masks need
@given(p=problems())
@example(p=Problem(2, 4, 2, 97, 131, 59, 64, 32, "dense", 1.0, True, 3))
@example(p=Problem(2, 2, 2, 200, 77, 16, 128, 64, "per_batch", 0.5, False, 5))
def test_loads_match_reference(kind, dtype, p):
    q, k, v = make_qkv(p.B, p.Hq, p.Hkv, p.Nq, p.Nk, p.D, dtype=dtype, device=DEVICE, seed=p.seed)
    with loads(kind):
        result = compare_to_reference(q, k, v, p.mask(DEVICE), causal=p.causal, backend="triton")
    assert not result.failures(), f"{p}: {result.failures()}"


def test_descriptor_only_for_aligned_tensors():
    from sparse_flash.kernels import settings
    from sparse_flash.kernels.triton.tma import tile_descriptor

    base = torch.randn(2, 3, 40, 72, dtype=torch.float16, device=DEVICE)
    desc = tile_descriptor(base, 32, 128)
    assert desc is not None and list(desc.block_shape) == [1, 1, 32, 128] and list(desc.shape) == [2, 3, 40, 72]
    # a fused-projection view (B, N, H, D) -> (B, H, N, D): strides permuted, still 16-byte multiples
    assert tile_descriptor(torch.randn(2, 40, 3, 64, device=DEVICE).transpose(1, 2), 16, 64) is not None
    # a size-1 batch whose stride is meaningless gets a valid one
    one = torch.randn(1, 3, 40, 64, device=DEVICE).as_strided((1, 3, 40, 64), (7, 2560, 64, 1))
    assert tile_descriptor(one, 16, 64).strides[0] % 4 == 0
    # rows of 36 fp16 (72 bytes) are not 16-byte multiples; a base one element in is not 16-byte aligned;
    # a broadcast (stride 0) head; a strided head dimension
    assert tile_descriptor(torch.randn(2, 3, 40, 36, dtype=torch.float16, device=DEVICE), 16, 64) is None
    assert tile_descriptor(base[..., 1:65], 16, 64) is None
    assert tile_descriptor(torch.randn(2, 1, 40, 64, device=DEVICE).expand(2, 3, 40, 64), 16, 64) is None
    assert tile_descriptor(torch.randn(2, 3, 40, 128, device=DEVICE)[..., ::2], 16, 64) is None
    with settings.override(tma=False):
        assert tile_descriptor(base, 32, 128) is None


def test_misaligned_inputs_take_pointer_loads():
    """Rows of 36 fp16 values are not 16-byte multiples: the kernels load them through pointers, exactly."""
    p = Problem(1, 2, 1, 100, 90, 36, 32, 32, "random", 0.5, True, 21)
    q, k, v = make_qkv(p.B, p.Hq, p.Hkv, p.Nq, p.Nk, p.D, dtype=torch.float16, device=DEVICE, seed=p.seed)
    result = compare_to_reference(q, k, v, p.mask(DEVICE), causal=p.causal, backend="triton")
    assert not result.failures(), f"{p}: {result.failures()}"


@pytest.mark.parametrize("kind", ["pointer", "descriptor"])
def test_loads_on_fused_projection_layout(kind):
    """q, k, v as (B, N, H, D) views, the layout a fused QKV projection gives: descriptors take the
    permuted strides as they are, in every pass (GQA, sequence tails, head dim below its tile)."""
    p = Problem(2, 4, 2, 150, 131, 48, 64, 32, "random", 0.5, True, 31)
    for dtype in (torch.float32, torch.float16):
        q, k, v = make_qkv(p.B, p.Hq, p.Hkv, p.Nq, p.Nk, p.D, dtype=dtype, device=DEVICE, seed=p.seed,
                           layout="transposed")
        from sparse_flash.kernels.triton.tma import tile_descriptor

        assert all(tile_descriptor(t.detach(), 16, 64) is not None for t in (q, k, v))  # the layout qualifies
        with loads(kind):
            result = compare_to_reference(q, k, v, p.mask(DEVICE), causal=p.causal, backend="triton")
        assert not result.failures(), f"{p} {dtype}: {result.failures()}"

"""Launch plans: built once per call signature and mask, reused with new data, rebuilt when anything they
fix changes; every call still matches the reference."""

import gc

import pytest
import torch
from conftest import DEVICE, triton_usable

from sparse_flash import masks
from sparse_flash.testing import compare_to_reference, make_qkv

pytestmark = pytest.mark.skipif(not triton_usable(), reason="triton is not usable here")


@pytest.fixture
def built(monkeypatch):
    """Counts the forward and backward plans built. The dense path keeps its plans in one dict for the
    process, emptied when it holds PLAN_LIMIT plans: the tests get a fresh one, so that what earlier tests
    left there (hypothesis draws new shapes each run) cannot empty it in the middle of a test."""
    from sparse_flash.kernels import dispatch, launch
    from sparse_flash.kernels.triton import fwd

    monkeypatch.setattr(launch, "_DENSE_PLANS", {})

    counts = {"fwd": 0, "bwd": 0}
    for module, name, kind in ((fwd, "FwdPlan", "fwd"), (dispatch, "_BackwardPlan", "bwd")):
        cls = getattr(module, name)

        def counted(*a, _cls=cls, _kind=kind):
            counts[_kind] += 1
            return _cls(*a)

        monkeypatch.setattr(module, name, counted)
    return counts


@pytest.mark.parametrize("kind", ["bigbird", "dense"])
def test_a_plan_serves_new_data_and_is_rebuilt_when_the_signature_changes(built, kind):
    n = 160
    mask = masks.bigbird(n, 16, seed=1) if kind == "bigbird" else masks.dense(n, 16)
    mask = mask.to(DEVICE)

    def check(seed, **kw):
        q, k, v = make_qkv(1, 2, 2, n, n, 32, dtype=torch.float32, device=DEVICE, seed=seed, **kw)
        result = compare_to_reference(q, k, v, mask, backend="triton")
        assert not result.failures(), result.failures()

    check(0)
    assert built == {"fwd": 1, "bwd": 1}
    check(1)  # new values, same signature: the same plans
    assert built == {"fwd": 1, "bwd": 1}
    check(2, layout="transposed")  # other strides: new plans
    assert built == {"fwd": 2, "bwd": 2}
    check(3)
    assert built == {"fwd": 2, "bwd": 2}


def test_plans_live_with_their_mask(built):
    import sparse_flash

    n = 96
    q, k, v = make_qkv(1, 1, 1, n, n, 16, dtype=torch.float32, device=DEVICE, seed=0, requires_grad=False)
    first, second = (masks.local(n, 16, window=1).to(DEVICE) for _ in range(2))
    for mask in (first, first, second):
        sparse_flash.block_sparse_attention(q, k, v, mask, backend="triton")
    from sparse_flash.kernels import launch

    assert built["fwd"] == 2 and len(launch.mask_plans(first)) == len(launch.mask_plans(second)) == 1
    key = id(second)
    del mask, second
    gc.collect()
    assert key not in launch._MASK_PLANS  # a mask's plans go with it


def _same_descriptor(a, b) -> bool:
    """Two descriptors of one class with equal fields, the base tensor the same object (a dataclass's `==`
    compares tensors element-wise on Python 3.13, which has no truth value)."""
    import dataclasses

    return type(a) is type(b) and all(
        x is y if isinstance(x, torch.Tensor) else x == y
        for x, y in ((getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)))


def test_descriptors_built_directly_equal_checked_ones():
    TensorDescriptor = pytest.importorskip("triton.tools.tensor_descriptor").TensorDescriptor
    from sparse_flash.kernels.triton.tma import descriptor_layout, make_descriptor

    t = torch.randn(2, 1, 40, 64, device=DEVICE)
    layout = descriptor_layout(t, 16, 64)
    assert _same_descriptor(make_descriptor(t, layout), TensorDescriptor(t, *layout))


def test_hopper_row_descriptors_built_directly_equal_checked_ones():
    """The Hopper kernels' descriptors (Gluon's class, with a shared-memory layout) skip the constructor's
    checks on every launch and equal the checked ones, field by field."""
    hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    gl = pytest.importorskip("triton.experimental.gluon.language")
    from sparse_flash.kernels.gluon import pipeline

    layout = gl.NVMMASharedLayout.get_default_for([128, 64], gl.float16)
    t = torch.randn(2, 3, 256, 64, dtype=torch.float16, device=DEVICE)
    built = pipeline.row_descriptor(t, 128, layout)
    assert type(built) is hopper.TensorDescriptor
    assert _same_descriptor(built, hopper.TensorDescriptor(t, [2 * 3 * 256, 64], [64, 1], [128, 64], layout))


def test_the_custom_ops_keep_the_dense_plans(built):
    """torch.compile's calls go through the custom ops (`ops.py`): the dense path's plans are kept there too
    (a dense plan depends on the call's signature only), a mask's are built per call (the op sees the lists,
    not the mask that owns their plans)."""
    from sparse_flash.kernels import ops

    n = 64
    mask = masks.local(n, 16, window=1).to(DEVICE)
    index, geometry = mask._records(False)
    for seed in range(2):
        q, k, v = make_qkv(1, 2, 2, n, n, 16, dtype=torch.float32, device=DEVICE, seed=seed, requires_grad=False)
        out, lse = ops.attn_fwd(q, k, v, None, None, False, 0.25)
        ops.attn_bwd(out, q, k, v, out, lse, None, None, False, 0.25)
    assert built == {"fwd": 1, "bwd": 1}
    for _ in range(2):
        out, lse = ops.attn_fwd(q, k, v, index, geometry, False, 0.25)
    assert built["fwd"] == 3

"""The Hopper (Gluon) kernels' host side, on the CPU: which calls each of the forward, dQ and dK/dV kernels
takes (`shape_supported`). The kernels run on sm_90 GPUs only (tests/test_gpu.py); tests/test_codegen.py
compiles them; their work items are tested in tests/test_schedule.py."""

import pytest
import torch

from sparse_flash import masks
from sparse_flash.kernels import settings

gluon_fwd = pytest.importorskip("sparse_flash.kernels.gluon.fwd", exc_type=ImportError)
gluon_dq = pytest.importorskip("sparse_flash.kernels.gluon.dq", exc_type=ImportError)
gluon_dkdv = pytest.importorskip("sparse_flash.kernels.gluon.dkdv", exc_type=ImportError)
MODULES = {"fwd": gluon_fwd, "dq": gluon_dq, "dkdv": gluon_dkdv}


def call(mask, B=1, Hq=4, Hkv=4, N=1024, D=128, causal=False):
    """shape_supported's arguments for a call with this mask (None: dense)."""
    index = None if mask is None else mask.kernel_index(causal)
    geometry = None if mask is None else mask.kernel_geometry(causal)
    return (B, Hq, N, D), (B, Hkv, N, D), index, geometry


@pytest.mark.parametrize("kernel", ["fwd", "dq", "dkdv"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask", [None, masks.butterfly(1024, 128), masks.local(1024, 256, window=1)],
                         ids=["dense", "butterfly", "block256"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_takes_16_bit_d128_calls_with_whole_blocks(kernel, mask, dtype, causal):
    q_shape, k_shape, index, geometry = call(mask, causal=causal)
    assert MODULES[kernel].shape_supported(q_shape, k_shape, dtype, index, geometry)


@pytest.mark.parametrize("kernel", ["fwd", "dq", "dkdv"])
def test_takes_masks_whose_work_plan_splits_lists(kernel):
    """A global row and column (lists the work plans split): the Hopper kernels walk the plan's chunks as
    items of their own (`schedule.split_items`) and merge them after the kernel."""
    mask = masks.bigbird(16384, 128, seed=0)
    q_shape, k_shape, index, geometry = call(mask, N=16384)
    assert index.row_plan.split.shape[0] > 0 and index.col_plan.split.shape[0] > 0
    assert MODULES[kernel].shape_supported(q_shape, k_shape, torch.bfloat16, index, geometry)


def test_split_lists_switched_off_leave_them_to_triton():
    """`settings.hopper_split` off: masks whose plans split lists go to the Triton kernels, forward and
    backward; masks whose plans split nothing stay on the Hopper kernels."""
    split, whole = call(masks.bigbird(16384, 128, seed=0), N=16384), call(masks.butterfly(16384, 128), N=16384)
    assert whole[2].row_plan.split.shape[0] == 0 and whole[2].col_plan.split.shape[0] == 0
    with settings.override(hopper_split=False):
        for kernel in ("fwd", "dq", "dkdv"):
            assert not MODULES[kernel].shape_supported(*split[:2], torch.bfloat16, *split[2:])
            assert MODULES[kernel].shape_supported(*whole[:2], torch.bfloat16, *whole[2:])


def test_gqa_with_a_shared_mask_and_per_head_masks():
    """The dK/dV kernel walks every group head's list in one item: under GQA it needs a mask shared by the
    heads; the forward and dQ kernels walk one query head at a time and take per-head masks too."""
    shared = call(masks.butterfly(1024, 128), Hq=8, Hkv=2)
    per_head = call(masks.random(1024, 128, density=0.2, seed=0, num_heads=8), Hq=8, Hkv=2)
    for kernel in ("fwd", "dq", "dkdv"):
        assert MODULES[kernel].shape_supported(*shared[:2], torch.bfloat16, *shared[2:])
        assert MODULES[kernel].shape_supported(*per_head[:2], torch.bfloat16, *per_head[2:]) == (kernel != "dkdv")


def _other_call(case):
    """(q_shape, k_shape, dtype, index, geometry) of a call that every Gluon kernel leaves to Triton."""
    mask, kwargs, dtype = masks.butterfly(1024, 128), {}, torch.bfloat16
    if case == "fp32":
        dtype = torch.float32
    elif case == "d64":
        kwargs = dict(D=64)
    elif case == "tail":
        mask, kwargs = masks.butterfly(1000, 128), dict(N=1000)
    elif case == "block64":
        mask = masks.butterfly(1024, 64)
    q_shape, k_shape, index, geometry = call(mask, **kwargs)
    return q_shape, k_shape, dtype, index, geometry


@pytest.mark.parametrize("kernel", ["fwd", "dq", "dkdv"])
def test_head_dim_64_unless_switched_off(kernel):
    args = _other_call("d64")
    assert settings.Settings().hopper_d64  # on by default (tuning log, step 58)
    with settings.override(hopper_d64=True):
        assert MODULES[kernel].shape_supported(*args)
        assert not MODULES[kernel].shape_supported(*_other_call("fp32"))
    with settings.override(hopper_d64=False):
        assert not MODULES[kernel].shape_supported(*args)


@pytest.mark.parametrize("kernel", ["fwd", "dq", "dkdv"])
@pytest.mark.parametrize("case", ["fp32", "d64", "tail", "block64"])
def test_leaves_other_calls_to_the_triton_kernels(kernel, case):
    """No Gluon kernel takes fp32, sequence tails or 64-token blocks, nor D=64 with `hopper_d64` off."""
    with settings.override(hopper_d64=False):
        assert not MODULES[kernel].shape_supported(*_other_call(case))

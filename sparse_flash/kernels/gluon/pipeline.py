"""What the Hopper kernels (`gluon/fwd.py`, `gluon/dq.py`, `gluon/dkdv.py`) share: Gluon names that changed
between Triton versions, device-side helpers (list tiles, K/V loads, buffer releases), which GPUs, tensors and
shapes they run on, and their prepared launches. Their host-side work items are `kernels/schedule.py`'s.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton._C.libtriton import ir
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .. import settings
from ..launch import BoundLaunch, DescriptorSpec
from ...mask_index import MaskGeometry, WorkPlan
from ..schedule import ITEM_WIDTH as _ITEM_FIELDS, ROW_BLOCK
from ..triton.tma import unchecked_descriptor

ITEM_WIDTH = gl.constexpr(_ITEM_FIELDS)  # int32 fields of an item record (`schedule.split_items`)
FIRST_HALF, SECOND_HALF = gl.constexpr(0), gl.constexpr(1)  # which rows of an item a compute warpgroup takes

GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
WARPS = 4  # per compute partition (a warpgroup); the launch's num_warps

# Names that changed after Triton 3.6: a barrier among the warps of one partition, a TMA load and store.
partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@builtin
def _tma_add_3_6(tensor_desc, coord, src, _semantic=None):
    """Triton 3.6's Gluon has no name for a TMA reduction; its IR builder has the operation."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


# A tile of shared memory added into global memory by TMA (the one-pass backward's dQ).
tma_add = getattr(tma, "async_atomic_add", None) or _tma_add_3_6


@gluon.jit
def list_tile_start(Idx, j, SUB: gl.constexpr, MASK_BLOCK: gl.constexpr, BLOCK: gl.constexpr, DENSE: gl.constexpr):
    """First row of tile j of a list: tile j % SUB of mask block Idx[j // SUB], or tile j itself when dense
    (the dense items' lists count tiles)."""
    if DENSE:
        start = j * BLOCK
    else:
        start = gl.load(Idx + j // SUB) * MASK_BLOCK + (j % SUB) * BLOCK
    return start


@gluon.jit
def walk_position(j, rot, n):
    """Step j of an item that walks its n list tiles from tile `rot` on and wraps around: the list tile it
    takes (`schedule.one_pass_walks`)."""
    e = j + rot
    if e >= n:
        e -= n
    return e


@gluon.jit
def walk_tile_start(FullIdx, PartIdx, e, n_full, full_lo, part_lo, SUB: gl.constexpr, MASK_BLOCK: gl.constexpr,
                    BLOCK: gl.constexpr, DENSE: gl.constexpr):
    """First row of list tile e of an item whose list tiles are the full list's n_full from tile full_lo, then
    the partial list's from tile part_lo."""
    if e >= n_full:
        start = list_tile_start(PartIdx, e - n_full + part_lo, SUB, MASK_BLOCK, BLOCK, DENSE)
    else:
        start = list_tile_start(FullIdx, e + full_lo, SUB, MASK_BLOCK, BLOCK, DENSE)
    return start


@gluon.jit
def load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, row, t):
    """K and V rows [row, row + BLOCK_N) into the next buffers of the rings, once those are free."""
    K_STAGES: gl.constexpr = k_smem.type.shape[0]
    V_STAGES: gl.constexpr = v_smem.type.shape[0]
    sk = t % K_STAGES
    # Barriers start with phase 1 complete: the first wait on a free buffer passes at once.
    mbarrier.wait(k_empty.index(sk), ((t // K_STAGES) & 1) ^ 1)
    mbarrier.expect(k_ready.index(sk), k_desc.block_type.nbytes)
    tma_load(k_desc, [row, 0], k_ready.index(sk), k_smem.index(sk))
    sv = t % V_STAGES
    mbarrier.wait(v_empty.index(sv), ((t // V_STAGES) & 1) ^ 1)
    mbarrier.expect(v_ready.index(sv), v_desc.block_type.nbytes)
    tma_load(v_desc, [row, 0], v_ready.index(sv), v_smem.index(sv))


@gluon.jit
def ring_barriers(STAGES: gl.constexpr):
    """`(ready, empty)`: the mbarriers of a ring of STAGES shared buffers. A buffer is ready once its TMA copy
    lands (one arrive, with the bytes expected), and empty once both compute warpgroups release it."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    return ready, empty


@gluon.jit
def release(bar, pred=True):
    """Free a buffer once every warp of this warpgroup is past its last read (the arrive is one thread's)."""
    partition_barrier()
    mbarrier.arrive(bar, count=1, pred=pred)


@gluon.jit
def release_after_store(bar):
    """Free a buffer that this warpgroup's TMA stores read from, once they have read it."""
    tma.store_wait(0)
    release(bar)


_SM90: dict = {}  # device -> whether it is an sm_90 GPU, asked once per device


def runs_on(*tensors) -> bool:
    """Whether the tensors are on an sm_90 GPU (H100, H200), contiguous and 16-byte aligned (TMA)."""
    device = tensors[0].device
    if not tensors[0].is_cuda:
        return False
    sm90 = _SM90.get(device)
    if sm90 is None:
        sm90 = _SM90[device] = torch.cuda.get_device_capability(device) == (9, 0)
    return sm90 and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)


def head_dims() -> tuple[int, ...]:
    """The head dims the Hopper kernels serve: 128, and 64 unless `settings.hopper_d64` is off (at 64 they use
    half their shared memory and beat the Triton kernels on every measured row but the dense non-causal forward,
    0.96-0.98x: tuning log, step 58)."""
    return (64, 128) if settings.current().hopper_d64 else (128, )


def shapes_fit(q_shape, k_shape, dtype, geometry: MaskGeometry | None) -> bool:
    """What every Hopper kernel needs of a call, the GPU aside: 16-bit inputs, a head dim in `head_dims()`,
    both lengths multiples of ROW_BLOCK, int32 row numbers, and for a mask blocks that are multiples of
    ROW_BLOCK and divide the lengths (no block ends in a sequence tail)."""
    B, Hq, Nq, D = q_shape
    Nk = k_shape[2]
    if dtype not in GL_DTYPES or D not in head_dims() or Nq % ROW_BLOCK or Nk % ROW_BLOCK:
        return False
    if B * Hq * Nq >= 2**31 or k_shape[0] * k_shape[1] * Nk >= 2**31:
        return False
    if geometry is not None:  # a mask (None: the dense path)
        block_q, block_k = geometry.block_q, geometry.block_k
        if block_q % ROW_BLOCK or block_k % ROW_BLOCK or Nq % block_q or Nk % block_k:
            return False
    return True


def takes_plan(plan: WorkPlan | None) -> bool:
    """Whether a Hopper kernel takes the lists of this work plan (None: the dense path): a plan that splits
    long lists (global rows or columns: its chunks are items of their own, merged after the kernel,
    `schedule.split_items`) only while `settings.hopper_split` is on."""
    return plan is None or settings.current().hopper_split or plan.split.shape[0] == 0


def row_descriptor(t, rows: int, layout):
    """A TMA descriptor of contiguous t as a (rows of D) matrix, read or written `rows` rows at a time; built
    without the constructor's checks, which `runs_on` has made (`tma.unchecked_descriptor`)."""
    D = t.shape[-1]
    return unchecked_descriptor(TensorDescriptor, base=t, shape=[t.numel() // D, D], strides=[D, 1],
                                block_shape=[rows, D], layout=layout)


def vector_descriptor(t, rows: int, layout):
    """A TMA descriptor of contiguous t as one vector (float32 per row: a log-sum-exp, a delta), read `rows`
    elements at a time; unchecked as `row_descriptor`."""
    return unchecked_descriptor(TensorDescriptor, base=t, shape=[t.numel()], strides=[1], block_shape=[rows],
                                layout=layout)


def tile_descriptor(t, block_shape, layout):
    """A TMA descriptor of contiguous t as a (rows of its last dim) matrix, taken in tiles of `block_shape`
    (fewer columns than a row: the one-pass backward's dQ halves); unchecked as `row_descriptor`."""
    D = t.shape[-1]
    return unchecked_descriptor(TensorDescriptor, base=t, shape=[t.numel() // D, D], strides=[D, 1],
                                block_shape=list(block_shape), layout=layout)


def tile_spec(t, block_shape, layout) -> DescriptorSpec:
    """`tile_descriptor(t, block_shape, layout)` as a launch argument (see `row_spec`)."""
    return DescriptorSpec(t, tile_descriptor, (tuple(block_shape), layout))


def row_spec(t, rows: int, layout) -> DescriptorSpec:
    """`row_descriptor(t, rows, layout)` as a launch argument: built only where the launch needs it built
    (`launch.DescriptorSpec`; an encoded descriptor is kept per data pointer)."""
    return DescriptorSpec(t, row_descriptor, (rows, layout))


def vector_spec(t, rows: int, layout) -> DescriptorSpec:
    """`vector_descriptor(t, rows, layout)` as a launch argument (see `row_spec`)."""
    return DescriptorSpec(t, vector_descriptor, (rows, layout))


def bound_launch(kernel, grid: int, tail: tuple, constexprs: dict, maxnreg: int,
                 cooperative: bool = False) -> BoundLaunch:
    """The prepared launch of a Hopper kernel (`launch.BoundLaunch`): a few microseconds of host time per
    call where `kernel[grid](...)` took tens per kernel, which eager calls of short lists waited on. The
    kernels take num_warps as their last constexpr."""
    return BoundLaunch(kernel, grid, tail, {**constexprs, "num_warps": WARPS}, WARPS, 3, maxnreg, cooperative)


def num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count

"""Tensor descriptors (Hopper's TMA unit) for the tiles the kernels stream from their inner loops.

The forward and dQ passes stream K and V tiles, the dK/dV pass Q and dO tiles.

On an sm_90 or newer GPU, a kernel can fetch a whole tile with one TMA instruction from a host-built
descriptor instead of having every thread compute and issue its own addresses. The descriptor covers a
`(B, H, N, D)` tensor in four dimensions, so a tile that runs past the sequence end or the head dimension
reads zeros and never the next head's rows. `tile_descriptor` returns None where TMA cannot serve: an older
GPU, a Triton without host descriptors, or a tensor whose base or strides are not 16-byte aligned; the
kernels then load through pointers (the same arithmetic).

Under the interpreter (`TRITON_INTERPRET=1`) the descriptor path runs as on a Hopper GPU, so CPU tests
cover it; `settings.override(tma=False)` (or `SPARSE_FLASH_TMA=0`) selects the pointer path everywhere.
"""

from __future__ import annotations

import functools

import torch

from .. import settings
from ..settings import interpreting


_HAS_TMA: dict = {}  # device -> bool, asked once per device


def _device_has_tma(device: torch.device) -> bool:
    if interpreting():
        return True
    has = _HAS_TMA.get(device)
    if has is None:
        has = _HAS_TMA[device] = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return has


@functools.cache
def _descriptor_class():
    """Triton's host TensorDescriptor (imported once), or None for a Triton without host descriptors."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor


def descriptor_layout(t: torch.Tensor, block_rows: int, block_d: int):
    """`(shape, strides, block_shape)` of a descriptor of `t` (B, H, N, D) that loads `(1, 1, block_rows,
    block_d)` tiles, or None where TMA cannot serve (see module). The same for every tensor with t's shape,
    strides, dtype and 16-byte alignment, so launch plans compute it once."""
    if not settings.current().tma or not _device_has_tma(t.device) or _descriptor_class() is None:
        return None
    shape, strides = list(t.shape), list(t.stride())
    for i in range(len(shape) - 2, -1, -1):  # a dimension of size 1 is never stepped: any valid stride will do
        if shape[i] == 1:
            strides[i] = shape[i + 1] * strides[i + 1]
    if strides[-1] != 1 or t.data_ptr() % 16:
        return None
    elt = t.element_size()
    for s in strides[:-1]:
        if s <= 0 or s * elt % 16:
            return None
    return shape, strides, [1, 1, block_rows, block_d]


@functools.cache
def _descriptor_defaults(cls) -> tuple[dict, frozenset] | None:
    """A host descriptor class's field defaults (padding, ...) and the names of its fields without one, or
    None if it cannot be built without its constructor (not a dataclass, slots, other field names)."""
    import dataclasses

    if cls is None or not dataclasses.is_dataclass(cls) or hasattr(cls, "__slots__"):
        return None
    fields = dataclasses.fields(cls)
    if not {"base", "shape", "strides", "block_shape"} <= {f.name for f in fields}:
        return None
    required = frozenset(f.name for f in fields
                         if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    return {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}, required


def unchecked_descriptor(cls, **values):
    """A host descriptor of class `cls` (Triton's, or Gluon's, which also takes `layout`) with `values`, the
    other fields at their defaults, built without the constructor's checks: a microsecond instead of about
    four on the benchmark host, for every descriptor of every launch. The caller has made those checks
    (`descriptor_layout`, or the Hopper kernels' `runs_on`: contiguous, 16-byte aligned, non-empty).
    Where the class is not a plain dataclass with these fields, its constructor builds it."""
    found = _descriptor_defaults(cls)
    if found is None or not found[1] <= values.keys():
        return cls(**values)
    desc = cls.__new__(cls)
    desc.__dict__.update(found[0])
    desc.__dict__.update(values)
    return desc


def make_descriptor(t: torch.Tensor, layout):
    """A descriptor of `t` with a layout from `descriptor_layout` (computed for a tensor like `t`).

    Called for every launch, so it skips the checks of the descriptor's constructor, which
    `descriptor_layout` has done (`unchecked_descriptor`).
    """
    shape, strides, block_shape = layout
    return unchecked_descriptor(_descriptor_class(), base=t, shape=shape, strides=strides, block_shape=block_shape)


def tile_descriptor(t: torch.Tensor, block_rows: int, block_d: int):
    """A descriptor of `t` (B, H, N, D) that loads `(1, 1, block_rows, block_d)` tiles, or None (see module)."""
    layout = descriptor_layout(t, block_rows, block_d)
    return None if layout is None else make_descriptor(t, layout)

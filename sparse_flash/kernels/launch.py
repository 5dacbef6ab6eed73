"""Kernel launches with a per-call host cost of a few microseconds.

`kernel[grid](...)` re-derives Triton's specialisation of every argument on each call (alignment of each
pointer, divisibility and size of each integer), builds a cache key from it and prepares launch-hook
metadata. With 40-odd arguments that costs tens of microseconds per launch, more than the kernels of a
small problem take on the GPU. `launch` keeps the compiled kernel of each exact argument signature (the
value of every integer argument, the dtype and 16-byte alignment of every pointer, the constexprs and the
launch options) and calls it directly; anything new goes through Triton's normal path once, which compiles
or finds the kernel and returns it for the cache. Under the interpreter, and while a Triton launch hook is
installed (profilers), every call takes the normal path.

`BoundLaunch` goes further for launches prepared once and repeated (the Hopper kernels' plans): its TMA
descriptor arguments are encoded once per tensor address and Triton's C launcher is called directly, where
Triton's launcher has a layout this module knows (`_raw_launch`). Every launch first makes the device's CUDA
context current in its thread (`_bind_context`).
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import types
import weakref
from typing import Callable, NamedTuple

import torch

from . import settings

_CACHE: dict = {}
_CACHE_LIMIT = 1024  # exact signatures kept; a training loop uses a handful


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` for the host's launch shapes (0 for 0), without its cost: Triton 3.5 and newer make
    it a constexpr function whose host call takes 2-4 us, and a mask build makes a dozen of them.

    Example:
        >>> [next_power_of_2(n) for n in (0, 1, 3, 512, 513)]
        [0, 1, 4, 512, 1024]
    """
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """`triton.cdiv` on the host (ceil of a / b for ints), without its constexpr-function call.

    Example:
        >>> cdiv(7, 2), cdiv(8, 2)
        (4, 4)
    """
    return -(-a // b)


@functools.cache
def _knobs():
    """Triton's knobs module (looked up once), or None for a Triton without it."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs


def _hooks_installed() -> bool:
    """A launch hook (a profiler) is installed: it must see every launch, so the normal path runs."""
    knobs = _knobs()
    if knobs is None:  # never skip the launch path of a Triton without knobs
        return True
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter)) or bool(getattr(leave, "calls", leave))


def launch(kernel, grid: tuple, args: tuple, constexprs: dict, num_warps: int, num_stages: int, maxnreg: int = 0,
           cooperative: bool = False):
    """Launch `kernel` on a 1-D `grid` with positional runtime `args` followed by `constexprs`.

    `constexprs` must name the kernel's constexpr parameters, which follow its runtime parameters, in
    signature order (their values are passed positionally to the compiled kernel). `maxnreg` caps the
    registers per thread (0: the compiler's choice). `cooperative`: a cooperative launch (the driver starts
    the grid only when all its programs can be resident at once: for programs that wait for each other).

    Returns the compiled kernel that ran, or None where the cached direct launch is off (interpreter,
    launch hooks, `settings.fast_launch` off).
    """
    if settings.current().fast_launch and not settings.interpreting():
        # What Triton specialises a runtime argument on: a tensor's dtype and 16-byte alignment, an int's
        # value (it checks == 1, divisibility by 16 and the 32/64-bit range); floats it does not (`_arg_key`).
        # Most arguments are ints, which are their own key: no call for them.
        device = _current_device()
        _bind_context(device)
        key = (id(kernel), num_warps, num_stages, maxnreg, cooperative, device, *constexprs.values(),
               *[a if a.__class__ is int else _arg_key(a) for a in args])
        compiled = _CACHE.get(key)
        if compiled is not None and not _hooks_installed():
            compiled.run(grid[0], 1, 1, _raw_stream(device), compiled.function, compiled.packed_metadata, None, None,
                         None, *args, *constexprs.values())
            return compiled
        compiled = _compile_and_launch(kernel, grid, args, constexprs, num_warps, num_stages, maxnreg, cooperative)
        if hasattr(compiled, "result"):  # a compile still in flight
            compiled = compiled.result()
        if hasattr(compiled, "packed_metadata"):
            _check_order(kernel, len(args), constexprs)
            if len(_CACHE) >= _CACHE_LIMIT:
                _CACHE.clear()
            _CACHE[key] = compiled
            return None if _hooks_installed() else compiled
        return None
    if settings.interpreting():  # the CPU tests check the order that the direct call relies on
        _check_order(kernel, len(args), constexprs)
    else:
        _bind_context(_current_device())
    _compile_and_launch(kernel, grid, args, constexprs, num_warps, num_stages, maxnreg, cooperative)
    return None


def _compile_and_launch(kernel, grid: tuple, args: tuple, constexprs: dict, num_warps: int, num_stages: int,
                        maxnreg: int, cooperative: bool = False):
    """Triton's normal launch path. The tile settings are tuned on an H200 (228 KB of shared memory per
    SM); on a GPU with less, a kernel whose pipeline does not fit runs with fewer stages (each stage holds
    one set of streamed tiles), down to one, the only setting that changes: results are the same. If one
    stage does not fit either, Triton's error says how much shared memory the kernel needs."""
    while True:
        try:
            # a constexpr may also be a launch option (Gluon kernels take num_warps as their last parameter)
            return kernel[grid](*args, **{**_options(num_warps, num_stages, maxnreg, cooperative), **constexprs})
        except Exception as error:
            if num_stages <= 1 or getattr(error, "name", None) != "shared memory":  # Triton's OutOfResources
                raise
            num_stages -= 1


def _options(num_warps: int, num_stages: int, maxnreg: int, cooperative: bool = False) -> dict:
    """Triton's launch options; the register cap and the cooperative launch only where set."""
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg:
        options["maxnreg"] = maxnreg
    if cooperative:
        options["launch_cooperative_grid"] = True
    return options


class DescriptorSpec(NamedTuple):
    """A TMA descriptor argument of a `BoundLaunch`, given by what makes it: `make(tensor, *params)` builds the
    descriptor. A launch that encodes descriptors itself (`_RawLaunch`) keeps the encoded form per data
    pointer and builds the descriptor only the first time it meets that pointer; any other launch builds it
    on every call."""

    tensor: torch.Tensor
    make: Callable
    params: tuple

    def build(self):
        return self.make(self.tensor, *self.params)


def _built(a):
    """A launch argument as Triton takes it: a `DescriptorSpec` becomes its descriptor."""
    return a.build() if a.__class__ is DescriptorSpec else a


class BoundLaunch:
    """A launch prepared once: kernel, grid, trailing arguments, constexprs and options are fixed, and each
    call passes only the leading arguments, the tensors that change from call to call (descriptors as
    `DescriptorSpec`s or built).

    Whoever keeps a BoundLaunch for reuse must key it on everything Triton specialises the leading tensors
    on (dtype, 16-byte alignment, a descriptor's shape and strides) and on the current device: the compiled
    kernel that the first call finds then serves every later call directly, with no per-argument key.

    The trailing tensors (a mask's index lists, placeholders) are constant: the direct call passes their
    addresses as ints, which Triton's launcher takes as pointers without asking the tensor (a Python call)
    and the driver (a pointer-attribute query) again on every launch. This object holds the tensors, so
    the addresses stay valid.

    Where Triton's launcher is one this module knows (`_raw_launch`), the direct call goes below its Python
    wrapper: descriptors are encoded once per data pointer instead of built and encoded on every call.
    """

    __slots__ = ("kernel", "grid", "tail", "constexprs", "num_warps", "num_stages", "maxnreg", "cooperative",
                 "_compiled", "_rest", "_raw")

    def __init__(self, kernel, grid: int, tail: tuple, constexprs: dict, num_warps: int, num_stages: int,
                 maxnreg: int = 0, cooperative: bool = False):
        self.kernel, self.grid, self.tail, self.constexprs = kernel, grid, tail, constexprs
        self.num_warps, self.num_stages, self.maxnreg, self.cooperative = num_warps, num_stages, maxnreg, cooperative
        addresses = (a.data_ptr() if isinstance(a, torch.Tensor) else a for a in tail)
        self._compiled, self._rest, self._raw = None, (*addresses, *constexprs.values()), None

    def __call__(self, *head) -> None:
        compiled = self._compiled
        if compiled is not None and settings.current().fast_launch and not _hooks_installed():
            device = _current_device()
            _bind_context(device)
            if self._raw is not None:
                self._raw(self.grid, _raw_stream(device), head, self._rest)
                return
            compiled.run(self.grid, 1, 1, _raw_stream(device), compiled.function, compiled.packed_metadata,
                         None, None, None, *[_built(a) for a in head], *self._rest)
            return
        self._compiled = launch(self.kernel, (self.grid,), (*[_built(a) for a in head], *self.tail),
                                self.constexprs, self.num_warps, self.num_stages, self.maxnreg, self.cooperative)
        self._raw = None if self._compiled is None else _raw_launch(self._compiled, len(head))


class _RawLaunch:
    """Triton's CUDA launcher (the 3.6 layout) called below its Python wrapper, with each descriptor argument
    encoded once per data pointer by Triton's own encoder (`make_tensordesc_arg`) and kept.

    An encoded descriptor depends on its tensor's address, shape and strides and on the kernel's fixed
    block shape and swizzle; a `BoundLaunch` has fixed shapes and strides (its contract), so the address
    (with the element count, as a check) keys it. The kept encodings hold no tensor: a freed tensor's
    address reused by a new tensor of the same shape has the same encoding.
    """

    LIMIT = 64  # encodings kept per launch and argument position (a training loop reuses a few addresses)

    def __init__(self, c_launch, compiled, runner, metas: dict, encode):
        self.c_launch, self.encode, self.metas = c_launch, encode, metas  # metas: {head position: Triton's meta}
        self.function, self.packed = compiled.function, compiled.packed_metadata
        self.cooperative, self.pdl = runner.launch_cooperative_grid, runner.launch_pdl
        self.kept: dict = {}

    def __call__(self, grid: int, stream: int, head: tuple, rest: tuple) -> None:
        args = []
        metas, kept = self.metas, self.kept
        for i, a in enumerate(head):
            meta = metas.get(i)
            if meta is None:
                args.append(a)
                continue
            t = a.tensor if a.__class__ is DescriptorSpec else a.base
            key = (i, t.data_ptr(), t.numel())
            encoded = kept.get(key)
            if encoded is None:
                if len(kept) >= self.LIMIT * len(metas):
                    kept.clear()
                encoded = kept[key] = self.encode(_built(a), meta)
            args += encoded
        self.c_launch(grid, 1, 1, stream, self.function, self.cooperative, self.pdl, None, None, self.packed, None,
                      None, None, *args, *rest)


def _raw_launch(compiled, n_head: int) -> _RawLaunch | None:
    """The raw launch of `compiled` (see `_RawLaunch`), or None where Triton's launcher is not the known
    layout (another Triton version, a kernel that needs scratch memory or several CTAs, descriptors among
    the trailing arguments or without encoding metadata): those calls take Triton's launcher."""
    try:
        runner = compiled.run
        module = sys.modules.get(type(runner).__module__)
        if (type(runner).__name__ != "CudaLauncher" or getattr(module, "_BASE_ARGS_FORMAT_LEN", None) != 13
                or runner.global_scratch_size or runner.profile_scratch_size or getattr(runner, "num_ctas", 1) != 1):
            return None
        wrapper = runner.launch
        if isinstance(wrapper, types.BuiltinFunctionType):  # a kernel without descriptors: the C launcher itself
            return _RawLaunch(wrapper, compiled, runner, {}, None)
        cells = dict(zip(wrapper.__code__.co_freevars, (c.cell_contents for c in wrapper.__closure__)))
        encode = getattr(module, "make_tensordesc_arg", None)
        positions, metas = cells.get("tensordesc_indices"), cells.get("tensordesc_meta")
        if (not callable(cells.get("launcher")) or positions is None or not metas or any(m is None for m in metas)
                or encode is None or len(inspect.signature(encode).parameters) != 2
                or len(metas) != len(positions) or max(positions) >= n_head):
            return None
        return _RawLaunch(cells["launcher"], compiled, runner, dict(zip(sorted(positions), metas)), encode)
    except Exception:  # noqa: BLE001 - an unknown launcher layout is only a slower path
        return None


_THREAD = threading.local()


def _bind_context(device: int) -> None:
    """Make `device`'s CUDA context current in this thread (once per thread and device).

    Triton encodes TMA descriptors through the driver before its launcher binds a context, so in a thread
    where nothing has touched the GPU yet (autograd's device thread running a backward first, a thread of
    `nn.DataParallel`), with the kernel loaded in another thread, the encoding failed with "invalid device
    context". Any runtime call binds the device's primary context; a stream query is the cheapest, and a
    stream capturing a CUDA graph (which a query would end) was begun by a runtime call already."""
    bound = _THREAD.__dict__.get("devices")
    if bound is None:
        bound = _THREAD.devices = set()
    if device not in bound:
        with torch.cuda.device(device):
            if not torch.cuda.is_current_stream_capturing():
                torch.cuda.current_stream().query()
        bound.add(device)


def _arg_key(a):
    """What Triton specialises one runtime argument on (a descriptor: conservatively, all of it but its data).

    Called for every argument of every launch, so the common types are tested first, by exact type.
    """
    kind = type(a)
    if kind is int or kind is bool:
        return a
    if kind is float:
        return float
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() & 15
    if hasattr(a, "block_shape"):  # a TMA tensor descriptor (tma.py)
        return (a.base.dtype, a.base.data_ptr() & 15, tuple(a.shape), tuple(a.strides), tuple(a.block_shape),
                a.padding, getattr(a, "layout", None))  # a Gluon descriptor's shared-memory layout too
    return a


def _check_order(kernel, n_args: int, constexprs: dict) -> None:
    """The direct call passes every parameter positionally: the constexprs must follow the runtime ones."""
    names = list(kernel.arg_names)
    if names[n_args:] != list(constexprs):
        raise TypeError(f"{kernel.__name__}: constexprs must be its last parameters in order {names[n_args:]}, "
                        f"got {list(constexprs)}")


def _current_device() -> int:
    return torch.cuda.current_device()


def _raw_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)  # what Triton's launcher uses


PLAN_LIMIT = 64  # launch plans kept per cache (one per call signature: shapes, strides, dtype, flags)
_GENERATION = [0]


def forget_plans() -> None:
    """Make every kept launch plan stale: code that changes the tile settings (tests, tuning tools) calls
    this, since plans fix their tiles when they are built."""
    _GENERATION[0] += 1


def plan_key(tensors, *flags) -> tuple:
    """The key of a launch plan: the launching device, `flags`, and the shape, strides, dtype and 16-byte
    alignment of each tensor (everything the plan's launch arguments and Triton's specialisation follow)."""
    device = -1 if settings.interpreting() else _current_device()
    flags = (*flags, settings.current())  # a plan is built under the settings in force
    return (device, _GENERATION[0], *flags, *[(t.shape, t.stride(), t.dtype, t.data_ptr() & 15) for t in tensors])


_MASK_PLANS: dict[int, dict] = {}  # launch plans per live mask, by the mask's id
_DENSE_PLANS: dict = {}  # launch plans of the dense path, which takes no mask index


def dense_plans() -> dict:
    """The launch plans of the dense path (a dict for `cached_plan`), kept for the process: eager calls and the
    custom ops that torch.compile runs both take them (a dense plan depends on the call's signature only)."""
    return _DENSE_PLANS


def mask_plans(mask) -> dict:
    """The launch plans kept for `mask` (a dict for `cached_plan`), created on first use and dropped when the
    mask is collected. Owned here, not by the mask: a mask is a value, and pickling it never meets a plan."""
    key = id(mask)
    plans = _MASK_PLANS.get(key)
    if plans is None:
        plans = _MASK_PLANS[key] = {}
        weakref.finalize(mask, _MASK_PLANS.pop, key, None)
    return plans


def cached_plan(cache: dict | None, key: tuple, build):
    """`cache[key]`, built by `build()` on a miss; `cache=None` builds a plan for this call only."""
    plan = None if cache is None else cache.get(key)
    if plan is None:
        plan = build()
        if cache is not None:
            if len(cache) >= PLAN_LIMIT:
                cache.clear()
            cache[key] = plan
    return plan

"""Every switch of the kernels, in one place: one typed `Settings` value.

The environment is read here and nowhere else, once, when the settings are first read (a kernel's first use),
so a bad value never stops `import sparse_flash`; an empty value counts as unset:

| field | environment variable | default | what it switches |
|---|---|---|---|
| `hopper_forward` | `SPARSE_FLASH_HOPPER_FWD` | on | the warp-specialised Gluon forward where it serves a call (`gluon/fwd.py`) |
| `hopper_backward` | `SPARSE_FLASH_HOPPER_BWD` | on | the Gluon dQ and dK/dV kernels where they serve a call (`gluon/dq.py`, `gluon/dkdv.py`) |
| `deterministic` | `SPARSE_FLASH_DETERMINISTIC` | on | gradients bit-identical from run to run; off (and `torch.use_deterministic_algorithms` off) the one-pass backward adds dQ in any order |
| `hopper_one_pass_dense` | `SPARSE_FLASH_HOPPER_ONE_PASS_DENSE` | on | the dense non-causal backward takes the one-pass Gluon kernel, faster than the two Gluon passes (H200, backward only, in a fixed order): D = 128 0.99-1.16x (run to run), D = 64 1.04-1.07x (`gluon/bwd.py`; tuning log, steps 83 and 85) |
| `hopper_one_pass` | `SPARSE_FLASH_HOPPER_ONE_PASS` | off | the one-pass Gluon backward wherever it serves a call (in a fixed order while `deterministic`), in place of the two Gluon passes: 0.53-1.16x their speed in a fixed order, 0.64-1.2x in any order (step 83). In a fixed order its programs wait for each other; the launch is cooperative (the driver starts it only when all its programs can be resident) |
| `hopper_split` | `SPARSE_FLASH_HOPPER_SPLIT` | on | the Gluon kernels also take masks whose work plan splits long lists |
| `hopper_balance` | `SPARSE_FLASH_HOPPER_BALANCE` | on | Gluon work items placed on programs by load (off: in turn) |
| `hopper_d64` | `SPARSE_FLASH_HOPPER_D64` | on | the Gluon kernels also at head dim 64 (off: 128 only); measured against the Triton kernels at 64: forward 0.96-1.76x, backward 1.12-1.34x (tuning log, step 58) |
| `tma` | `SPARSE_FLASH_TMA` | on | the Triton kernels read K, V (and Q, dO) through tensor descriptors where the GPU allows |
| `fast_launch` | `SPARSE_FLASH_FAST_LAUNCH` | on | launches bound once per plan, skipping Triton's per-call dispatch (`launch.py`) |
| `gpu_index` | `SPARSE_FLASH_GPU_INDEX` | on | a CUDA mask's index lists and work plans built by a few Triton launches (`sparse_flash/index_gpu.py`, the same values) instead of many torch operators (off: torch operators, also without Triton; read outside torch.compile only: inside it a top-k mask's builders launch on every CUDA device); `from_topk` at 32,768-65,536 tokens measured 2-7x faster eagerly, 3-4x replayed in a CUDA graph (tuning log, step 61) |
| `poison` | - | off | every kernel output starts as NaN, so that an unwritten tile shows (tests) |

A variable takes `1`/`0` (or `true`/`false`, `on`/`off`); anything else is a ValueError naming it.
`configure(**changes)` sets fields for every thread and returns every thread's settings before it;
`override(**changes)` sets them for a `with` block in this thread or task only. Launch plans key on the settings
they were built under, so a change takes effect on the next call. A call's backward runs under the settings of its forward (autograd may
run it in another thread); under torch.compile, under the settings where the compiled backward runs.

`interpreting()` is the one reader of `TRITON_INTERPRET` (kernels run on the CPU through the interpreter).

Example:
    >>> from sparse_flash.kernels import settings
    >>> q = k = v = torch.randn(1, 2, 256, 32)
    >>> with settings.override(hopper_forward=False):   # the Triton forward for every call in the block
    ...     out = sparse_flash.block_sparse_attention(q, k, v, sparse_flash.masks.local(256, 64))
    >>> settings.current().hopper_forward  # outside the block: as before
    True
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import sys

from ..checks import as_bool

__all__ = ["Settings", "applied", "configure", "current", "interpreting", "override"]


@dataclasses.dataclass(frozen=True)
class Settings:
    hopper_forward: bool = True
    hopper_backward: bool = True
    deterministic: bool = True
    hopper_one_pass: bool = False
    hopper_one_pass_dense: bool = True
    hopper_split: bool = True
    hopper_balance: bool = True
    hopper_d64: bool = True
    tma: bool = True
    fast_launch: bool = True
    gpu_index: bool = True
    poison: bool = False

    def __post_init__(self):
        for field in dataclasses.fields(self):  # Python or NumPy bools, kept as Python bools
            object.__setattr__(self, field.name, as_bool(getattr(self, field.name), f"kernel setting {field.name}"))


ENVIRONMENT = {  # field: the variable that sets it
    "hopper_forward": "SPARSE_FLASH_HOPPER_FWD",
    "hopper_backward": "SPARSE_FLASH_HOPPER_BWD",
    "deterministic": "SPARSE_FLASH_DETERMINISTIC",
    "hopper_one_pass": "SPARSE_FLASH_HOPPER_ONE_PASS",
    "hopper_one_pass_dense": "SPARSE_FLASH_HOPPER_ONE_PASS_DENSE",
    "hopper_split": "SPARSE_FLASH_HOPPER_SPLIT",
    "hopper_balance": "SPARSE_FLASH_HOPPER_BALANCE",
    "hopper_d64": "SPARSE_FLASH_HOPPER_D64",
    "tma": "SPARSE_FLASH_TMA",
    "fast_launch": "SPARSE_FLASH_FAST_LAUNCH",
    "gpu_index": "SPARSE_FLASH_GPU_INDEX",
}
_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


class EnvironmentSettingError(ValueError):
    """A `SPARSE_FLASH_*` variable with a value that is not a switch (the command line reports it in one line)."""


def _parse(variable: str, text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise EnvironmentSettingError(f"{variable} must be 1 or 0 (true/false, on/off), got {text!r}")


def from_environment(environ=os.environ) -> Settings:
    """The defaults, with every variable of `ENVIRONMENT` that is set applied (an empty value counts as unset)."""
    return Settings(**{field: _parse(var, environ[var]) for field, var in ENVIRONMENT.items()
                       if environ.get(var, "").strip()})


_BASE: list = [None]  # the settings of every thread: the environment's (read on first use), then `configure`'s


class _Block:
    """The `override` blocks open in one thread or task, innermost first: each its fields (merged with the
    blocks around it) and the settings they give on the base they were applied to (cached: `current()` stays a
    lookup)."""

    __slots__ = ("changes", "outer", "base", "result")

    def __init__(self, changes: dict, outer: "_Block | None", base: Settings):
        self.changes, self.outer = changes, outer
        self.base, self.result = base, dataclasses.replace(base, **changes)


_OVERRIDE: contextvars.ContextVar = contextvars.ContextVar("sparse_flash_settings_override", default=None)


def _base() -> Settings:
    if _BASE[0] is None:
        _BASE[0] = from_environment()
    return _BASE[0]


def current() -> Settings:
    """The settings in force here: `configure`'s (the environment's at first), with the fields of the `override`
    blocks open in this thread or task."""
    base, block = _base(), _OVERRIDE.get()
    if block is None:
        return base
    if block.base is not base:  # `configure` ran inside the block: its fields on the new base
        block.base, block.result = base, dataclasses.replace(base, **block.changes)
    return block.result


def _checked(changes: dict) -> dict:
    names = {f.name for f in dataclasses.fields(Settings)}
    for name, value in changes.items():
        if name not in names:
            raise TypeError(f"unknown kernel setting {name!r}; the settings are {sorted(names)}")
    return {name: as_bool(value, f"kernel setting {name}") for name, value in changes.items()}


def configure(**changes) -> Settings:
    """Set the given fields (bools) for every thread, from now on; returns the settings every thread had before
    (without any `override` block's fields: `configure(**dataclasses.asdict(previous))` puts back exactly what
    this call changed, and never makes a block's fields global). Inside an `override` block the block's own
    fields still win until it closes.

    Raises:
        TypeError: an unknown field, or a value that is not a bool.
    """
    _checked(changes)
    previous = _base()
    _BASE[0] = dataclasses.replace(_base(), **changes)
    return previous


@contextlib.contextmanager
def override(**changes):
    """The given fields for the duration of a `with` block, in this thread (or asyncio task) only; blocks nest,
    and closing one restores exactly what it set (a `configure` inside it stays). Blocks closed out of order
    leave nothing behind once all are closed."""
    outer = _OVERRIDE.get()
    block = _Block({**(outer.changes if outer else {}), **_checked(changes)}, outer, _base())
    _OVERRIDE.set(block)
    try:
        yield current()
    finally:
        innermost = _OVERRIDE.get()
        open_blocks = []
        while innermost is not None:
            open_blocks.append(innermost)
            innermost = innermost.outer
        if block in open_blocks:  # still open here: close it with every block opened inside it
            _OVERRIDE.set(block.outer)


@contextlib.contextmanager
def applied(chosen: Settings):
    """`chosen` in force for a `with` block, in this thread or task only (`override` with all its fields).

    The kernels' backward runs under the settings of its forward: autograd may run it in a thread of its own
    (on CUDA it does), where the forward's `override` blocks are not open.
    """
    if not isinstance(chosen, Settings):
        raise TypeError(f"settings.applied takes a Settings, got {type(chosen).__name__}")
    now = current()
    if now is chosen or now == chosen:
        yield chosen
        return
    with override(**{f.name: getattr(chosen, f.name) for f in dataclasses.fields(Settings)}) as inside:
        yield inside


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels run on the CPU through the Triton interpreter)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def interpreter_mismatch() -> str | None:
    """Why the Triton kernels cannot follow TRITON_INTERPRET as it is now, or None: Triton reads it once, when it
    is imported (each `@triton.jit` function is made interpreted or compiled then), so a value set or cleared
    after that import holds for this library (`interpreting`) but not for Triton's functions. Nothing to say
    before Triton is imported."""
    language = sys.modules.get("triton.language")
    if language is None or not hasattr(language, "cdiv"):
        return None
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(language.cdiv, InterpretedFunction) == interpreting():
        return None
    now = "set" if interpreting() else "unset"
    return (f"TRITON_INTERPRET is {now} now but was not when Triton was imported (building a mask imports it), "
            "and Triton reads it only then: set it before the first import, e.g. in the shell")

"""Every switch of the kernels, in one place: one typed `Settings` value.

The environment is read here and nowhere else, once, when the kernels are first used:

| field | environment variable | default | what it switches |
|---|---|---|---|
| `hopper_forward` | `SPARSE_FLASH_HOPPER_FWD` | on | the warp-specialised Gluon forward where it serves a call (`gluon/fwd.py`) |
| `hopper_backward` | `SPARSE_FLASH_HOPPER_BWD` | on | the Gluon dQ and dK/dV kernels where they serve a call (`gluon/dq.py`, `gluon/dkdv.py`) |
| `hopper_split` | `SPARSE_FLASH_HOPPER_SPLIT` | on | the Gluon kernels also take masks whose work plan splits long lists |
| `hopper_balance` | `SPARSE_FLASH_HOPPER_BALANCE` | on | Gluon work items placed on programs by load (off: in turn) |
| `hopper_d64` | `SPARSE_FLASH_HOPPER_D64` | off | the Gluon kernels also at head dim 64 (off: 128 only; the forward measured 0.91-1.01x the Triton one at 64 before its TMA store, tuning log, step 41) |
| `tma` | `SPARSE_FLASH_TMA` | on | the Triton kernels read K, V (and Q, dO) through tensor descriptors where the GPU allows |
| `fast_launch` | `SPARSE_FLASH_FAST_LAUNCH` | on | launches bound once per plan, skipping Triton's per-call dispatch (`launch.py`) |
| `gpu_index` | `SPARSE_FLASH_GPU_INDEX` | off | a CUDA mask's index lists and work plans built by a few Triton launches (`sparse_flash/index_gpu.py`, the same values) instead of many torch operators; off until measured and verified on a GPU (tuning log, step 53) |
| `poison` | - | off | every kernel output starts as NaN, so that an unwritten tile shows (tests) |

A variable takes `1`/`0` (or `true`/`false`, `on`/`off`); anything else is a ValueError naming it.
`configure(**changes)` sets fields and returns the previous value; `override(**changes)` does so for a `with`
block. Launch plans key on the settings they were built under, so a change takes effect on the next call.

`interpreting()` is the one reader of `TRITON_INTERPRET` (kernels run on the CPU through the interpreter).

Example:
    >>> from sparse_flash.kernels import settings
    >>> with settings.override(hopper_forward=False):   # the Triton forward for every call in the block
    ...     out = sparse_flash.block_sparse_attention(q, k, v, mask)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

__all__ = ["Settings", "configure", "current", "interpreting", "override"]


@dataclasses.dataclass(frozen=True)
class Settings:
    hopper_forward: bool = True
    hopper_backward: bool = True
    hopper_split: bool = True
    hopper_balance: bool = True
    hopper_d64: bool = False
    tma: bool = True
    fast_launch: bool = True
    gpu_index: bool = False
    poison: bool = False


ENVIRONMENT = {  # field: the variable that sets it
    "hopper_forward": "SPARSE_FLASH_HOPPER_FWD",
    "hopper_backward": "SPARSE_FLASH_HOPPER_BWD",
    "hopper_split": "SPARSE_FLASH_HOPPER_SPLIT",
    "hopper_balance": "SPARSE_FLASH_HOPPER_BALANCE",
    "hopper_d64": "SPARSE_FLASH_HOPPER_D64",
    "tma": "SPARSE_FLASH_TMA",
    "fast_launch": "SPARSE_FLASH_FAST_LAUNCH",
    "gpu_index": "SPARSE_FLASH_GPU_INDEX",
}
_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def _parse(variable: str, text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ValueError(f"{variable} must be 1 or 0 (true/false, on/off), got {text!r}")


def from_environment(environ=os.environ) -> Settings:
    """The defaults, with every variable of `ENVIRONMENT` that is set applied."""
    return Settings(**{field: _parse(var, environ[var]) for field, var in ENVIRONMENT.items() if var in environ})


_CURRENT = [from_environment()]


def current() -> Settings:
    """The settings in force."""
    return _CURRENT[0]


def configure(**changes) -> Settings:
    """Set the given fields (bools); returns the settings before the change.

    Raises:
        TypeError: an unknown field, or a value that is not a bool.
    """
    names = {f.name for f in dataclasses.fields(Settings)}
    for name, value in changes.items():
        if name not in names:
            raise TypeError(f"unknown kernel setting {name!r}; the settings are {sorted(names)}")
        if not isinstance(value, bool):
            raise TypeError(f"kernel setting {name} must be a bool, got {type(value).__name__} {value!r}")
    previous = _CURRENT[0]
    _CURRENT[0] = dataclasses.replace(previous, **changes)
    return previous


@contextlib.contextmanager
def override(**changes):
    """`configure(**changes)` for the duration of a `with` block; the previous settings come back after it."""
    previous = configure(**changes)
    try:
        yield current()
    finally:
        _CURRENT[0] = previous


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels run on the CPU through the Triton interpreter)."""
    return os.environ.get("TRITON_INTERPRET") == "1"

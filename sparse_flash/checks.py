"""Argument checks shared by the whole package: one kind of value is refused in one way everywhere.

Ints may be Python or NumPy ints but never bools; bools may be Python or NumPy bools; every message names the
argument, what was expected and what came. `BlockMask`, the mask constructors, `nn`, `cli` and `interop` check
their arguments with these (torch only, no import of the rest of the package).
"""

from __future__ import annotations

import io
import numbers
import os
import sys
from pathlib import Path

import torch

MAX_INT = 2**63 - 1  # every int argument: it must fit the int64 arithmetic the layouts are built with
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range


def is_bool(value) -> bool:
    """True for Python and NumPy bools (NumPy is not imported for it)."""
    numpy = sys.modules.get("numpy")
    return isinstance(value, bool) or (numpy is not None and isinstance(value, numpy.bool_))


def as_bool(value, name: str) -> bool:
    if not is_bool(value):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def finite_float(value, name: str, what: str = "a finite float") -> float:
    """`value` as a float: a real number (Python, NumPy or a 0-d tensor's `item()`), never a bool, TypeError
    otherwise; finite, ValueError otherwise (an int past every float included, never OverflowError)."""
    if is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {_shown(value)}")
    try:
        as_float = float(value)
    except OverflowError:  # an int or a Fraction past every float
        return _not_finite(value, name, what)
    # comparisons rather than math.isfinite: traceable where torch.compile makes the value symbolic (a guard
    # on its finiteness, not a graph break)
    if as_float == as_float and abs(as_float) <= sys.float_info.max:
        return as_float
    return _not_finite(value, name, what)


def _not_finite(value, name: str, what: str):
    raise ValueError(f"{name} must be finite, got {_shown(value)}")


def _shown(value) -> str:
    """`value` for an error message: a tensor by its shape and dtype (its values are not readable inside
    torch.compile, where the message must still be built), anything else by its repr, cut short."""
    if isinstance(value, torch.Tensor):
        return f"of shape {tuple(value.shape)} and dtype {value.dtype}"
    return repr(value)[:40]


def check_device(device, name: str = "device"):
    """`device` as a `torch.device` a mask can live on (None stays None: the default device): TypeError for
    another type, ValueError for a name torch does not know, the meta device, or CUDA where there is none."""
    if device is None:
        return None
    if is_bool(device) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"{name} must be a torch.device, a str or an int, got {type(device).__name__} {device!r}")
    try:
        device = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"{name} must name a torch device (such as 'cpu' or 'cuda:0'), got {device!r}") from None
    if device.type == "meta":
        raise ValueError(f"{name}: a mask needs real values, it cannot live on the meta device")
    # Inside torch.compile devices come from real tensors (and device_count cannot be traced): no check there.
    if device.type == "cuda" and not torch.compiler.is_compiling() and (
            not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"{name}={str(device)!r}: no such CUDA device here")
    return device


def positive_int(value, name: str, minimum: int = 1, maximum: int = MAX_INT) -> int:
    """`value` as an int in `[minimum, maximum]`: Python or NumPy ints, never bools or floats."""
    if is_bool(value) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    if value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value}")
    return value


def optional_heads(num_heads) -> int:
    return 1 if num_heads is None else positive_int(num_heads, "num_heads")


def probability(value, name: str) -> float:
    """A float in [0, 1] (NaN and infinities refused)."""
    if is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1], got {type(value).__name__} {value!r}")
    value = float(value)
    if not 0.0 <= value <= 1.0:  # also false for NaN
        raise ValueError(f"{name} must be a float in [0, 1], got {value}")
    return value


def odd_int(value, name: str) -> int:
    value = positive_int(value, name)
    if value % 2 == 0:
        raise ValueError(f"{name} must be odd (a window centred on the diagonal: 3 means +-1), got {value}")
    return value


def block_indices(values, name: str, *, distinct: bool = True) -> list[int]:
    """A sequence of block indices (ints >= 0, `distinct` ones unless told): lists, tuples, NumPy arrays and
    int tensors."""
    if isinstance(values, (str, bytes, dict, set, frozenset)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence of block indices such as (0, 16), got {type(values).__name__} "
                        f"{values!r}")  # a dict would give its keys, a set no defined order
    if hasattr(values, "tolist"):  # NumPy arrays and tensors hold their ints as 0-d objects
        values = values.tolist()
    indices = [positive_int(v, f"{name}[{k}]", minimum=0) for k, v in enumerate(values)]
    if distinct and len(set(indices)) != len(indices):
        raise ValueError(f"{name} must not repeat a block, got {indices}")
    return indices


def seed_value(seed) -> int | torch.Generator:
    if isinstance(seed, torch.Generator):
        return seed
    expected = "seed must be an int in [0, 2**64 - 1] or a torch.Generator, got"
    if is_bool(seed) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"{expected} {type(seed).__name__} {seed!r}")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{expected} {seed}")
    return int(seed)


def is_int(value) -> bool:
    """A Python or NumPy integer, never a bool."""
    return isinstance(value, numbers.Integral) and not is_bool(value)


def as_pair(block_size, name: str = "block_size") -> tuple[int, int]:
    """`block_size` (an int or a pair of ints, Python or NumPy) as `(block_q, block_k)`, each at least 1."""
    if is_int(block_size):
        pair = (int(block_size), int(block_size))
    elif isinstance(block_size, (tuple, list)) and len(block_size) == 2 and all(is_int(b) for b in block_size):
        pair = (int(block_size[0]), int(block_size[1]))
    else:
        raise TypeError(f"{name} must be an int or a pair of ints (block_q, block_k), got {block_size!r}")
    if min(pair) < 1:
        raise ValueError(f"{name} must be positive, got {block_size!r}")
    return pair


def triton_blocks(block_size: tuple[int, int], name: str = "mask block sizes") -> None:
    """Refuse block sizes `(block_q, block_k)` that the triton backend cannot tile (each a multiple of 16)."""
    if block_size[0] % 16 or block_size[1] % 16:
        raise ValueError(f"the triton backend needs {name} that are multiples of 16, got {tuple(block_size)}")


def block_pair(block_size) -> tuple[int, int]:
    """`block_size` as `(block_q, block_k)`, each an int in [1, MAX_INT]."""
    bq, bk = as_pair(block_size)
    return positive_int(bq, "block_size"), positive_int(bk, "block_size")


def picture_path(path):
    """`path` for a picture to write: None, a file name or path whose folder exists, or a binary file object
    open for writing; checked before any drawing, so a bad name costs no work.

    Example:
        >>> picture_path("/no/such/folder/masks.png")
        Traceback (most recent call last):
        ...
        ValueError: path: the folder '/no/such/folder' of '/no/such/folder/masks.png' does not exist
    """
    if path is None:
        return path
    if hasattr(path, "write"):
        if isinstance(path, io.TextIOBase) or "b" not in getattr(path, "mode", "b"):
            raise TypeError(f"path must be a binary file object (open(..., 'wb')), got the text file {path!r}")
        writable = getattr(path, "writable", None)
        if writable is not None and not writable():
            raise ValueError(f"path must be a file object open for writing, got {path!r}")
        return path
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a file name, a path or a binary file object, got {type(path).__name__}")
    name = os.fspath(path)
    if not name:
        raise ValueError("path must name a file, got an empty string")
    if os.path.isdir(name):
        raise ValueError(f"path must name a file, got the folder {name!r}")
    folder = os.path.dirname(name) or "."
    if not os.path.isdir(folder):
        raise ValueError(f"path: the folder {folder!r} of {name!r} does not exist")
    return path


TRITON_FLOOR, TORCH_FLOOR = (3, 6), (2, 11)  # the oldest versions the triton backend is tested on (docs/testing.md)
_TRITON_PROBLEM = {}  # {"reason": str | None}, filled by the first `triton_problem()` outside torch.compile


def output_folder(path, name: str) -> Path:
    """`path` (`~` expanded) as a folder that exists or can be made: not a file, no file on its way, and its
    nearest existing folder writable; checked before any work, so a run never fails at its end on its output.

    Example:
        >>> output_folder("/proc/version/runs", "--out")
        Traceback (most recent call last):
        ...
        ValueError: --out: '/proc/version' is a file, so '/proc/version/runs' cannot be a folder
    """
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"{name} must name a folder, got {path!r}")
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{name} must name a folder, got the file {os.fspath(path)!r}")
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{name}: {os.fspath(existing)!r} is a file, so {os.fspath(folder)!r} cannot be a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{name}: cannot write in {os.fspath(existing)!r} (for {os.fspath(folder)!r})")
    return folder


def _major_minor(version: str) -> tuple[int, int]:
    """`(major, minor)` of a version string such as "3.6.0" or "2.11.0+cu130".

    Example:
        >>> _major_minor("2.11.0+cu130")
        (2, 11)
    """
    major, minor = (version.split("+")[0].split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def triton_problem() -> str | None:
    """Why the triton backend cannot run anywhere (Triton missing, or Triton or torch older than the tested
    floors `TRITON_FLOOR`, `TORCH_FLOOR`), or None; asked once (a failed import searches the path again on every
    call). Inside torch.compile the function runs as it is and its answer is a constant of the graph (marked
    below): no guard on the cache, so a first call made compiled and the eager calls that fill the cache after
    it share one graph. The cache is written outside torch.compile only (a write in a trace is a side effect,
    which Dynamo refuses inside `torch.utils.checkpoint`), for a Dynamo that would trace the function after all."""
    if "reason" in _TRITON_PROBLEM:
        return _TRITON_PROBLEM["reason"]
    try:
        import triton
    except ImportError:
        reason = "triton is not installed (pip install sparse-flash[triton])"
    else:
        found = (_major_minor(triton.__version__), _major_minor(torch.__version__))
        reason = None
        if found[0] < TRITON_FLOOR or found[1] < TORCH_FLOOR:
            reason = (f"the triton kernels need triton >= {'.'.join(map(str, TRITON_FLOOR))} and torch >= "
                      f"{'.'.join(map(str, TORCH_FLOOR))}, found triton {triton.__version__} and torch "
                      f"{torch.__version__} (pip install -U torch triton)")
    if not torch.compiler.is_compiling():
        _TRITON_PROBLEM["reason"] = reason
    return reason


# What `torch.compiler.assume_constant_result` sets; calling it here would import Dynamo, and Triton with it, on
# `import sparse_flash`.
triton_problem._dynamo_marked_constant = True

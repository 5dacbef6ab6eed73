"""Output allocation for the launchers, with an optional NaN poison for tests.

With poisoning on (`sparse_flash.testing.poison_outputs()`), every kernel output starts as NaN, so a tile
that a kernel forgets to write shows up as NaN instead of as stale memory that happens to look right.
"""

from __future__ import annotations

import torch

_POISON = [False]


def set_poison(enabled: bool) -> bool:
    """Turn NaN poisoning of new outputs on or off; returns the previous setting."""
    previous = _POISON[0]
    _POISON[0] = bool(enabled)
    return previous


def new_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised output tensor, filled with NaN when poisoning is on."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if _POISON[0]:
        out.fill_(float("nan"))
    return out

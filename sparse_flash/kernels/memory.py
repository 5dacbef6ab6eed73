"""Output allocation for the launchers, with an optional NaN poison for tests.

With poisoning on (`settings.poison`, or `sparse_flash.testing.poison_outputs()`), every kernel output starts as NaN, so a tile
that a kernel forgets to write shows up as NaN instead of as stale memory that happens to look right.
"""

from __future__ import annotations

import torch

from . import settings


def new_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised output tensor, filled with NaN when poisoning is on."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if settings.current().poison:
        out.fill_(float("nan"))
    return out

"""Output allocation for the launchers, with an optional poison for tests.

With poisoning on (`settings.poison`, or `sparse_flash.testing.poison_outputs()`), every kernel output starts as NaN, so a tile
that a kernel forgets to write shows up as NaN instead of as stale memory that happens to look right. Integer and
bool outputs and scratch (index lists, work plans, their tables) start as `INT_POISON` (True): a valid-looking
list number, count or flag, so that a slot read before it is written makes a wrong result, not a lucky one
(tuning log, step 94: a rank without a work item read a slot of another head's row).
"""

from __future__ import annotations

import torch

from . import settings


INT_POISON = 1  # what integer outputs hold before the kernels write them, when poisoning is on


def new_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised output tensor; when poisoning is on, filled with NaN (floating dtypes), INT_POISON
    (integers) or True (bool). Not while torch.compile traces (the settings live in a context variable that
    it cannot read); the custom ops' own allocations run eagerly and are poisoned."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if not torch.compiler.is_compiling() and settings.current().poison:  # traced code reads no settings
        out.fill_(float("nan") if dtype.is_floating_point else INT_POISON)
    return out


def new_outputs(shapes: list, dtype: torch.dtype, device) -> list[torch.Tensor]:
    """`new_output` of each shape, the settings read once (a build allocates a dozen or more)."""
    outs = [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
    if not torch.compiler.is_compiling() and settings.current().poison:
        for out in outs:
            out.fill_(float("nan") if dtype.is_floating_point else INT_POISON)
    return outs

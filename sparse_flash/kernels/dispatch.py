"""Which kernel family runs each pass of a call: the one place that decides.

Two families serve the passes. The Triton kernels (`triton/`) serve every call the kernels take. The
warp-specialised Gluon kernels (`gluon/`) serve the calls they were written for on Hopper GPUs (H100,
H200: 16-bit inputs, D = 64 or 128, lengths and mask blocks multiples of 128; each module's `supported` says
exactly), where they are faster, unless switched off (`settings.hopper_forward`, `settings.hopper_backward`).
The forward, the dQ pass and the dK/dV pass are chosen separately; the dQ pass stores delta = rowsum(dO * O)
for the dK/dV pass whichever families run them, and between two Gluon passes also the log-sum-exp in log2 units
(`lse2`), which the dK/dV pass then reads without converting it on every tile. The one-pass Gluon backward (`gluon/bwd.py`: both passes in one
launch, family "gluon-one-pass") serves the dense non-causal calls, where it is faster
(`settings.hopper_one_pass_dense`), at D = 64 and 128, in a fixed order while `deterministic()`; and every
call it serves with `settings.hopper_one_pass` (tuning log, steps 82-85).

A choice is made once per launch plan (the plan's key holds the shapes, strides, alignment and settings
that the choice depends on), so repeated calls pay nothing for it.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import NamedTuple

import torch

from ..mask_index import KernelIndex, MaskGeometry
from . import settings
from .launch import cached_plan, plan_key
from .memory import new_output
from .triton import bwd as triton_bwd
from .triton import fwd as triton_fwd

__all__ = ["Families", "attn_bwd", "attn_fwd", "deterministic", "families"]

ONE_PASS = "gluon-one-pass"


class Families(NamedTuple):
    """The family ("gluon" or "triton"; "gluon-one-pass": both backward passes in one launch) of each pass of
    one call."""

    forward: str
    dq: str
    dkdv: str


@functools.cache
def gluon_modules():
    """The Gluon kernels' modules, or None where this Triton has no Gluon (or one older than their names)."""
    try:
        from .gluon import bwd, dkdv, dq, fwd
    except (ImportError, AttributeError):
        return None
    return SimpleNamespace(fwd=fwd, dq=dq, dkdv=dkdv, bwd=bwd)


def _gluon():
    """The Gluon modules where they may run at all: never under the interpreter (Gluon kernels do not run
    there), and only with a Triton that has them."""
    return None if settings.interpreting() else gluon_modules()


def deterministic() -> bool:
    """Whether the backward must give bit-identical gradients from run to run: `settings.deterministic`, or
    PyTorch's own switch (`torch.use_deterministic_algorithms(True)`), which outranks the setting."""
    return settings.current().deterministic or torch.are_deterministic_algorithms_enabled()


def families(q, k, v, index: KernelIndex | None, geometry: MaskGeometry | None, out=None, do=None,
             causal: bool = False) -> Families:
    """The family of each pass for a call with these tensors and mask (`index` and `geometry` None: the dense
    path); `out` and `do` (like q) decide the backward passes, which read them. A gradient of the log-sum-exp
    does not change the choice: every family folds it into delta where it forms it (the dQ pass for the dK/dV
    pass, the one-pass kernel's prepare launch)."""
    gluon, switches = _gluon(), settings.current()
    forward = dq = dkdv = "triton"
    if gluon is not None:
        if switches.hopper_forward and gluon.fwd.supported(q, k, v, index, geometry):
            forward = "gluon"
        if switches.hopper_backward and out is not None and do is not None:
            wanted = switches.hopper_one_pass or (switches.hopper_one_pass_dense and index is None and not causal)
            if wanted and gluon.bwd.supported(do, q, k, v, index, geometry):
                return Families(forward, ONE_PASS, ONE_PASS)
            if gluon.dq.supported(do, q, k, v, out, index, geometry):
                dq = "gluon"
            if gluon.dkdv.supported(do, q, k, v, index, geometry):
                dkdv = "gluon"
    return Families(forward, dq, dkdv)


def _forward_plan(q, k, v, index, geometry, causal: bool, scale: float):
    if families(q, k, v, index, geometry).forward == "gluon":
        return gluon_modules().fwd.FwdPlan(q, k, v, index, geometry, causal, scale)
    return triton_fwd.FwdPlan(q, k, v, index, geometry, causal, scale)


def attn_fwd(q, k, v, index: KernelIndex | None, geometry: MaskGeometry | None, causal: bool, scale: float,
             plans: dict | None = None):
    """The forward of one call, by the family that serves it.

    Args:
        q: `(B, Hq, Nq, D)`; k, v: `(B, Hkv, Nk, D)`; last dimension contiguous.
        index: the mask's `KernelIndex` for this call's causal flag, or None for the dense path.
        geometry: the mask's `MaskGeometry` (None for the dense path).
        causal, scale: as in `block_sparse_attention` (scale > 0).
        plans: where to keep this call's launch plan for the next call with the same signature: one dict per
            mask (`launch.mask_plans`), or None to build one for this call only.

    Returns:
        `(out, lse)`: out like q, lse float32 `(B, Hq, Nq)` natural log.
    """
    key = plan_key((q, k, v), "fwd", causal, scale)
    plan = cached_plan(plans, key, lambda: _forward_plan(q, k, v, index, geometry, causal, scale))
    return plan(q, k, v)


class _BackwardPlan:
    """The two backward passes of one call signature, each by the family that serves it."""

    def __init__(self, do, q, k, v, out, index, geometry, causal: bool, scale: float, dlse: bool):
        chosen, gluon = families(q, k, v, index, geometry, out, do, causal), gluon_modules()
        self.families = chosen
        if chosen.dq == ONE_PASS:
            self.one_pass = gluon.bwd.BwdPlan(q, k, index, geometry, causal, scale, deterministic(), dlse)
            return
        self.one_pass = None
        # Between two Gluon passes the dQ pass also stores the log-sum-exp in log2 units, which the dK/dV pass
        # then reads without converting it on every tile (tuning log, step 97).
        self.lse2 = chosen.dq == chosen.dkdv == "gluon"
        self.dq = (gluon.dq.DqPlan(q, k, index, geometry, causal, scale, self.lse2, dlse) if chosen.dq == "gluon" else
                   triton_bwd.DqPlan(do, q, k, v, out, index, geometry, causal, scale, dlse))
        self.dkdv = (gluon.dkdv.DkdvPlan(q, k, index, geometry, causal, scale, self.lse2) if chosen.dkdv == "gluon"
                     else triton_bwd.DkdvPlan(do, q, k, v, index, geometry, causal, scale))
        self.delta_shape, self.device = q.shape[:3], q.device

    def __call__(self, do, q, k, v, out, lse, dlse=None):
        if self.one_pass is not None:
            return self.one_pass(q, k, v, out, do, lse, dlse)
        delta = new_output(self.delta_shape, torch.float32, self.device)  # written by the dQ pass, read by dK/dV
        if self.lse2:
            lse2 = new_output(self.delta_shape, torch.float32, self.device)  # likewise
            dq = self.dq(q, k, v, out, do, lse, delta, lse2, dlse=dlse)
            dk, dv = self.dkdv(q, k, v, do, lse2, delta)
        else:
            dq = self.dq(q, k, v, out, do, lse, delta, dlse=dlse)
            dk, dv = self.dkdv(q, k, v, do, lse, delta)
        return dq, dk, dv


def attn_bwd(do, q, k, v, out, lse, index: KernelIndex | None, geometry: MaskGeometry | None, causal: bool,
             scale: float, plans: dict | None = None, dlse: torch.Tensor | None = None):
    """The backward of one call: `(dq, dk, dv)` shaped and typed like q, k and v.

    Args:
        do, q, out: `(B, Hq, Nq, D)`; k, v: `(B, Hkv, Nk, D)`; last dimension contiguous.
        lse: float32 `(B, Hq, Nq)` from the forward.
        index, geometry, causal, scale, plans: as in `attn_fwd`.
        dlse: the gradient of lse (float32 `(B, Hq, Nq)`, contiguous), or None where nothing depends on lse.
            With it, dS = P (dP - delta + dlse): d lse_i / d s_ij = P_ij.
    """
    tensors = (do, q, k, v, out, lse) if dlse is None else (do, q, k, v, out, lse, dlse)
    key = plan_key(tensors, "bwd", causal, scale, torch.are_deterministic_algorithms_enabled(), dlse is not None)
    plan = cached_plan(plans, key, lambda: _BackwardPlan(do, q, k, v, out, index, geometry, causal, scale,
                                                         dlse is not None))
    return plan(do, q, k, v, out, lse, dlse)

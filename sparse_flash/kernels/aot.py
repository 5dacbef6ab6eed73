"""Compile a kernel for a Hopper GPU ahead of time, on any machine: no GPU needed.

The compile checks (`tests/test_codegen.py`) and the resource report (`benchmarks/kernel_resources.py`)
build each kernel's signature from its argument names: index lists int32, scratch and statistics fp32,
tensors bf16, the streamed inputs as tensor descriptors of (1, 1, rows, BLOCK_D) tiles.
"""

from __future__ import annotations

import inspect

INTS = {"N", "Nq", "Nk", "Hq", "Hkv", "BH"}
FP32_POINTERS = {"Lse", "OutPart", "LsePart", "Delta", "DQPart", "DKPart", "DVPart", "Part", "DstLse"}
FLOATS = {"qk_scale", "sm_scale"}


def signature(kernel, constexprs: dict, descriptors=()) -> dict:
    """Triton types for `kernel`'s parameters; `descriptors` names the inputs streamed through TMA
    descriptors (Q and DO: BLOCK_M rows per tile; K and V: BLOCK_N)."""
    params = inspect.signature(kernel.fn).parameters
    unset = [n for n, p in params.items() if "constexpr" in str(p.annotation) and n not in constexprs]
    if unset:
        raise ValueError(f"compile-time arguments without a value: {unset}")
    sig = {}
    for name in params:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in descriptors:
            rows = constexprs["BLOCK_M" if name in ("Q", "DO") else "BLOCK_N"]
            sig[name] = f"tensordesc<bf16[1,1,{rows},{constexprs['BLOCK_D']}]>"
        elif name in FP32_POINTERS:
            sig[name] = "*fp32"
        elif name.startswith(("Row", "Col")) or name in ("Split", "Chunks", "Slots"):
            sig[name] = "*i32"
        elif name[0].isupper() and name not in INTS:
            sig[name] = "*bf16"
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    return sig


class AheadOfTimeUnsupported(RuntimeError):
    """This Triton spells the ahead-of-time compile API differently."""


def compile_sm90(kernel, constexprs: dict, descriptors=(), num_warps: int = 4, num_stages: int = 3,
                 aligned: bool = False):
    """`kernel` compiled for sm_90a. `aligned`: pointers, strides and lengths declared multiples of 16, as
    Triton specialises them at run time for the usual shapes. Raises AheadOfTimeUnsupported where this
    Triton's ahead-of-time API differs; a kernel that does not compile raises Triton's own error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = signature(kernel, constexprs, descriptors)
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n.startswith("stride") or n in ("Nq", "Nk", "BH", "Hq")} if aligned else None
    try:
        src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                        attrs=attrs)
    except TypeError as e:
        raise AheadOfTimeUnsupported(str(e)) from e
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})

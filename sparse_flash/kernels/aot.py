"""Compile a kernel for a Hopper GPU ahead of time, on any machine: no GPU needed.

The compile checks (`tests/test_codegen.py`) and the resource report (`benchmarks/kernel_resources.py`)
build each kernel's signature from its argument names: index lists int32, scratch and statistics fp32,
int64 run costs and owners, tensors bf16, the streamed inputs as tensor descriptors of (1, 1, rows, BLOCK_D) tiles.
"""

from __future__ import annotations

import inspect

INTS = {"N", "Nq", "Nk", "Hq", "Hkv", "BH"}
FP32_POINTERS = {"Lse", "DLse", "OutPart", "LsePart", "Delta", "DQPart", "DKPart", "DVPart", "Part", "DstLse"}
FLOATS = {"qk_scale", "sm_scale", "heavy_above"}
INT64_POINTERS = {"Costs", "Owners"}  # `schedule.deal_runs`


def signature(kernel, constexprs: dict, descriptors=(), types: dict | None = None) -> dict:
    """Triton types for `kernel`'s parameters; `descriptors` names the inputs streamed through TMA
    descriptors (Q and DO: BLOCK_M rows per tile; K and V: BLOCK_N); `types` gives others by name."""
    params = inspect.signature(kernel.fn).parameters
    unset = [n for n, p in params.items() if "constexpr" in str(p.annotation) and n not in constexprs]
    if unset:
        raise ValueError(f"compile-time arguments without a value: {unset}")
    sig = {}
    for name in params:
        if types and name in types:
            sig[name] = types[name]
        elif name in constexprs:
            sig[name] = "constexpr"
        elif name in descriptors:
            rows = constexprs["BLOCK_M" if name in ("Q", "DO") else "BLOCK_N"]
            sig[name] = f"tensordesc<bf16[1,1,{rows},{constexprs['BLOCK_D']}]>"
        elif name in FP32_POINTERS:
            sig[name] = "*fp32"
        elif name in INT64_POINTERS:
            sig[name] = "*i64"
        elif name.startswith(("Row", "Col", "Full", "Part")) or name in ("Split", "Chunks", "Slots", "Counts", "Items",
                                                                          "Lead"):
            sig[name] = "*i32"
        elif name[0].isupper() and name not in INTS:
            sig[name] = "*bf16"
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    return sig


class AheadOfTimeUnsupported(RuntimeError):
    """This Triton spells the ahead-of-time compile API differently."""


def compile_sm90(kernel, constexprs: dict, descriptors=(), num_warps: int = 4, num_stages: int = 3,
                 aligned: bool = False, maxnreg: int = 0, types: dict | None = None):
    """`kernel` compiled for sm_90a. `aligned`: pointers, strides and lengths declared multiples of 16, as
    Triton specialises them at run time for the usual shapes; `maxnreg`: registers per thread at most (0:
    no cap); `types`: Triton types of parameters named otherwise than the convention. Raises AheadOfTimeUnsupported where this Triton's ahead-of-time API differs; a kernel that does
    not compile raises Triton's own error."""
    import triton
    from triton.backends.compiler import GPUTarget

    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg:
        options["maxnreg"] = maxnreg
    return triton.compile(source_sm90(kernel, constexprs, descriptors, aligned, types),
                          target=GPUTarget("cuda", 90, 32), options=options)


def source_sm90(kernel, constexprs: dict, descriptors=(), aligned: bool = False, types: dict | None = None):
    """The source that `compile_sm90` compiles (Triton's `ASTSource`; cheap, nothing compiled), or
    AheadOfTimeUnsupported where this Triton spells it differently."""
    from triton.compiler import ASTSource

    sig = signature(kernel, constexprs, descriptors, types)
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n.startswith("stride") or n in ("Nq", "Nk", "BH", "Hq")} if aligned else None
    try:
        return ASTSource(fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                         attrs=attrs)
    except TypeError as e:
        raise AheadOfTimeUnsupported(str(e)) from e


def compile_gluon_sm90(kernel, signature: dict, constexprs: dict, maxnreg: int, num_warps: int = 4):
    """A Gluon kernel compiled for sm_90a (no GPU needed): `signature` gives each runtime argument's type in
    order (`"*fp32"`, `"i32"`, a `descriptor_type`), `constexprs` the constexprs' values (num_warps included
    where the kernel takes it)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {**signature, **{n: "constexpr" for n in constexprs}}
    names = list(sig)
    src = GluonASTSource(kernel, sig, {(names.index(n), ): v for n, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, maxnreg=maxnreg))


def descriptor_type(dtype: str, block_shape, layout) -> str:
    """The signature type of a Gluon TMA descriptor: `dtype` as Triton spells it (`"bf16"`), its block shape
    and shared layout."""
    return f"tensordesc<{dtype}[{','.join(str(n) for n in block_shape)}],{layout!r}>"


def launch_record(kernel, args: tuple, constexprs: dict, num_warps: int, num_stages: int, maxnreg: int = 0) -> dict:
    """A launch written down as plain data (JSON), enough to compile it again elsewhere as Triton's JIT
    would on the GPU: each runtime argument's kind, and its value where Triton specialises on it."""
    spec = []
    for name, a in zip(kernel.arg_names, args):
        if hasattr(a, "data_ptr"):
            spec.append([name, "ptr", str(a.dtype).replace("torch.", ""), a.data_ptr() % 16 == 0])
        elif hasattr(a, "block_shape"):  # a host tensor descriptor
            spec.append([name, "desc", str(a.base.dtype).replace("torch.", ""), list(a.block_shape)])
        elif isinstance(a, float):
            spec.append([name, "float"])
        else:
            spec.append([name, "int", int(a)])
    fn = getattr(kernel, "fn", kernel)
    return dict(module=fn.__module__, kernel=fn.__name__, args=spec, constexprs=dict(constexprs), num_warps=num_warps,
                num_stages=num_stages, maxnreg=maxnreg)


_TRITON_TYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "int32": "i32", "int64": "i64"}


def compile_recorded(record: dict):
    """Compile a `launch_record` for sm_90a with the specialisation Triton's JIT gives it on the GPU: an int
    equal to 1 becomes a constant and one divisible by 16 is declared so (unless the kernel names it in
    `do_not_specialize`), and so is a 16-byte aligned pointer."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(record["module"]), record["kernel"])
    names = list(kernel.arg_names)
    fixed = {names[i] if isinstance(i, int) else i for i in (kernel.do_not_specialize or ())}
    sig, constants, attrs = {}, dict(record["constexprs"]), {}
    for name, kind, *value in record["args"]:
        i = names.index(name)
        if kind == "ptr":
            sig[name] = "*" + _TRITON_TYPES[value[0]]
            if value[1]:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif kind == "desc":
            sig[name] = f"tensordesc<{_TRITON_TYPES[value[0]]}[{','.join(map(str, value[1]))}]>"
        elif kind == "float":
            sig[name] = "fp32"
        elif value[0] == 1 and name not in fixed:
            sig[name], constants[name] = "constexpr", 1
        else:
            sig[name] = "i32" if -2**31 <= value[0] < 2**31 else "i64"
            if value[0] % 16 == 0 and name not in fixed:
                attrs[(i,)] = [["tt.divisibility", 16]]
    for name in record["constexprs"]:
        sig[name] = "constexpr"
    sig = {name: sig[name] for name in names}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in constants.items()},
                    attrs=attrs)
    options = {"num_warps": record["num_warps"], "num_stages": record["num_stages"]}
    if record["maxnreg"]:
        options["maxnreg"] = record["maxnreg"]
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)

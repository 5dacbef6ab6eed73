"""Registers, spills, shared memory and programs per SM of each kernel's default launch, without a GPU.

Every Triton kernel is compiled for sm_90a (H100/H200) at the tile settings `kernels/triton/configs.py` picks
for a benchmark row, then assembled with Triton's own ptxas. A program's share of an SM's 64K registers,
228 KB of shared memory and 2,048 threads says how many programs an SM holds at once: more of them hide each
other's prologue and epilogue (docs/tuning-log.md, steps 25 and 26).

    python benchmarks/kernel_resources.py            # needs triton with its CUDA backend; no GPU
    python benchmarks/kernel_resources.py --dkdv     # the dK/dV kernel at candidate tiles, both load paths
    python benchmarks/kernel_resources.py --hopper   # the Hopper (Gluon) forward, dQ and dK/dV kernels

The Hopper kernels hold one program per SM and cap their registers at launch (each warpgroup then sets its
own share), so their report is the spills, the fences ptxas injects into their tensor-core pipelines
("warpgroup.arrive is injected", ptxas info C7519: a product then waits for the warpgroup's earlier ones;
tuning log, step 80), and their tile loop in SASS: instructions and register moves per exponential
(`tile_loop`; tuning log, steps 96-97). Compile with the Triton the GPU machine runs (its ptxas decides), e.g. a wheel
unpacked ahead on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from functools import partial

import torch
import triton

from sparse_flash.kernels.aot import compile_sm90
from sparse_flash.kernels.triton import bwd, fwd
from sparse_flash.kernels.triton.configs import block_d, bwd_config, fwd_config

SM_REGISTERS, SM_SHARED, SM_THREADS = 65536, 228 * 1024, 2048  # per SM on Hopper
BLOCK_SHARED_RESERVED = 1024  # shared memory the driver reserves per program


def ptxas_path() -> str:
    """The ptxas that Triton itself runs for sm_90 (Triton 3.9 runs its newer `ptxas-blackwell` there, whose
    PTX version the older `ptxas` beside it rejects)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(90).path
    except (ImportError, TypeError):  # a Triton without that choice: its one ptxas
        return os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")


def ptxas_report(ptx: str) -> dict:
    """`ptxas -v` for sm_90a on PTX text: registers, spill-store bytes and injected warpgroup fences."""
    folder = tempfile.mkdtemp()
    with open(f"{folder}/k.ptx", "w") as f:
        f.write(ptx)
    run = subprocess.run([ptxas_path(), "-v", "-arch=sm_90a", f"{folder}/k.ptx", "-o", f"{folder}/k.cubin"],
                         capture_output=True, text=True)
    return parse_ptxas((run.stderr + run.stdout).splitlines())


def parse_ptxas(lines: list[str]) -> dict:
    """Registers, spill-store bytes and injected warpgroup fences (C7519) from `ptxas -v`'s lines."""
    regs = int(next(line for line in lines if "Used" in line).split("Used")[1].split("registers")[0])
    spills = int(next(line for line in lines if "spill stores" in line).split(",")[1].split("bytes")[0])
    fences = sum("warpgroup.arrive is injected" in line for line in lines)
    return {"registers": regs, "spill_bytes": spills, "injected_fences": fences}


def compile_report(kernel, constexprs: dict, warps: int, stages: int, descriptors=(), maxnreg: int = 0) -> dict:
    """Compile for sm_90a; registers and spills from ptxas, shared memory from Triton, programs per SM."""
    compiled = compile_sm90(kernel, constexprs, descriptors, warps, stages, aligned=True, maxnreg=maxnreg)
    report = ptxas_report(compiled.asm["ptx"])
    regs, spills = report["registers"], report["spill_bytes"]
    shared = compiled.metadata.shared
    threads = 32 * warps
    fits = min(SM_REGISTERS // (max(regs, 1) * threads), SM_SHARED // (shared + BLOCK_SHARED_RESERVED),
               SM_THREADS // threads)
    return {"registers": regs, "spill_bytes": spills, "shared_kb": round(shared / 1024, 1), "programs_per_sm": fits}


def forward_rows(D: int):
    """(label, kernel, constexprs, warps, stages, descriptors) of the forward for sparse, dense and causal rows."""
    for label, dense, causal, long_lists in (("sparse", False, False, False), ("sparse long", False, False, True),
                                             ("dense", True, False, False), ("dense causal", True, True, False)):
        block = None if dense else 128
        cfg = fwd_config(D, torch.bfloat16, block, block, causal, 65536, long_lists)
        cx = dict(HEAD_DIM=D, BLOCK_D=block_d(D), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  MASK_BLOCK_Q=block or cfg.block_m, MASK_BLOCK_K=block or cfg.block_n, CAUSAL=causal, DENSE=dense,
                  DOT_PRECISION="tf32", TMA=cfg.tma)
        descs = ("K", "V") if cfg.tma else ()
        cap = f" <={cfg.maxnreg} regs" if cfg.maxnreg else ""
        yield (f"fwd D={D} {label} {tuple(cfg)[:4]}{cap}", fwd._attn_fwd_kernel, cx, cfg.num_warps, cfg.num_stages,
               descs, cfg.maxnreg)


def backward_rows(D: int):
    """The dQ and dK/dV launches of sparse (short and long lists) and dense rows, causal or not."""
    for label, dense, long_lists, causal in (("sparse", False, False, False), ("sparse long", False, True, False),
                                             ("dense", True, False, False), ("sparse causal", False, False, True),
                                             ("dense causal", True, False, True)):
        block = None if dense else 128
        cfg = bwd_config(D, torch.bfloat16, block, block, causal, long_lists)
        common = dict(HEAD_DIM=D, BLOCK_D=block_d(D), CAUSAL=causal, DENSE=dense, DOT_PRECISION="tf32", TMA=cfg.tma)
        dq = dict(common, BLOCK_M=cfg.q_block_m, BLOCK_N=cfg.q_block_n, MASK_BLOCK_Q=block or cfg.q_block_m,
                  MASK_BLOCK_K=block or cfg.q_block_n, HAS_DLSE=False)
        descs = ("K", "V") if cfg.tma else ()
        yield (f"dQ D={D} {label} {(cfg.q_block_m, cfg.q_block_n)}", bwd._attn_bwd_dq_kernel, dq,
               cfg.dq_warps or cfg.num_warps, cfg.dq_stages or cfg.num_stages, descs, cfg.dq_maxnreg)
        dkdv = dict(common, BLOCK_M=cfg.kv_block_m, BLOCK_N=cfg.kv_block_n, MASK_BLOCK_Q=block or cfg.kv_block_m,
                    MASK_BLOCK_K=block or cfg.kv_block_n)
        descs = ("Q", "DO") if cfg.tma else ()
        yield (f"dK/dV D={D} {label} {(cfg.kv_block_m, cfg.kv_block_n)}", bwd._attn_bwd_dkdv_kernel, dkdv,
               cfg.num_warps, cfg.num_stages, descs, cfg.maxnreg)


# dK/dV candidates (kv_block_m, kv_block_n, warps, stages): the default tiles register-spill at D=128
DKDV_CANDIDATES = [(64, 64, 4, 2), (64, 64, 8, 2), (64, 64, 8, 3), (32, 64, 4, 2), (32, 64, 4, 3), (64, 32, 4, 2),
                   (128, 64, 8, 2), (64, 128, 8, 2), (32, 128, 8, 2)]


def dkdv_candidate_rows(D: int):
    for kv_m, kv_n, warps, stages in DKDV_CANDIDATES:
        for tma in (False, True):
            cx = dict(HEAD_DIM=D, BLOCK_D=block_d(D), BLOCK_M=kv_m, BLOCK_N=kv_n, MASK_BLOCK_Q=128, MASK_BLOCK_K=128,
                      CAUSAL=False, DENSE=False, DOT_PRECISION="tf32", TMA=tma)
            yield (f"dK/dV D={D} sparse {(kv_m, kv_n)}{' tma' if tma else ''}", bwd._attn_bwd_dkdv_kernel, cx, warps,
                   stages, ("Q", "DO") if tma else (), 0)


def hopper_rows(D: int):
    """(label, compile) of the Hopper forward, dQ, dK/dV and one-pass backward kernels for sparse and dense rows,
    causal or not (block 128, bf16), as their launchers compile them."""
    from sparse_flash.kernels import dispatch

    gluon = dispatch.gluon_modules()
    for label, dense, causal in (("sparse", False, False), ("dense", True, False), ("sparse causal", False, True),
                                 ("dense causal", True, True)):
        yield f"hopper fwd D={D} {label}", partial(gluon.fwd.compile_sm90, torch.bfloat16, dense, causal, head_dim=D)
        yield f"hopper dQ D={D} {label}", partial(gluon.dq.compile_sm90, torch.bfloat16, dense, causal, head_dim=D)
        yield f"hopper dK/dV D={D} {label}", partial(gluon.dkdv.compile_sm90, torch.bfloat16, dense, causal, head_dim=D)
        yield f"hopper one-pass D={D} {label}", partial(gluon.bwd.compile_sm90, torch.bfloat16, dense, causal,
                                                        head_dim=D)


def tile_loop(cubin: bytes) -> dict:
    """The hot loop of a Hopper kernel's SASS (`hot_loop`): its instructions (a static count: both sides of a
    branch inside it), exponentials and register moves (MOV, IMAD.MOV), or {} where none."""
    folder = tempfile.mkdtemp()
    with open(f"{folder}/k.cubin", "wb") as f:
        f.write(cubin)
    tool = os.path.join(os.path.dirname(ptxas_path()), "cuobjdump")
    sass = subprocess.run([tool, "-sass", f"{folder}/k.cubin"], capture_output=True, text=True).stdout
    lines = [(int(a, 16), op, rest, bool(guard)) for a, guard, op, rest in
             (m.groups() for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][\w.]*)([^;]*);", sass))]
    span = hot_loop(lines)
    if span is None:
        return {}
    ops = [op for _, op, _, _ in lines[span[0]:span[1] + 1]]
    return dict(instructions=len(ops), exps=ops.count("MUFU.EX2"), moves=ops.count("MOV") + ops.count("IMAD.MOV.U32"))


def hot_loop(lines: list[tuple[int, str, str, bool]]) -> tuple[int, int] | None:
    """`(first, last)` positions in `lines` (each `(address, opcode, operands, guarded)` of one SASS
    instruction, in address order) of the hot loop: of the innermost loops that hold tensor-core products
    (HGMMA) and exponentials (MUFU.EX2), the one with the most exponentials (a loop over two tiles beats its
    one-tile rest); None where there is none. A loop closes on a guarded branch back (the unguarded ones are
    the barrier waits' retry paths, placed after the code)."""
    at = {address: i for i, (address, _, _, _) in enumerate(lines)}
    loops = []
    for i, (_, op, rest, guarded) in enumerate(lines):
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" and guarded else None
        start = at.get(int(target.group(1), 16)) if target else None
        ops = [] if start is None or start >= i else [o for _, o, _, _ in lines[start:i + 1]]
        if "MUFU.EX2" in ops and any(o.startswith("HGMMA") for o in ops):
            loops.append((start, i))
    inner = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    if not inner:
        return None
    return max(inner, key=lambda ab: ([o for _, o, _, _ in lines[ab[0]:ab[1] + 1]].count("MUFU.EX2"), ab[0] - ab[1]))


def hopper_report():
    print(f"triton {triton.__version__}, sm_90a, bf16, one program per SM; tile loop per exponential")
    print(f"{'kernel':34} {'regs cap':>8} {'spill B':>7} {'fences':>6} {'smem KB':>7} {'instr':>6} {'moves':>6}")
    for D in (64, 128):
        for label, build in hopper_rows(D):
            compiled = build()
            r = ptxas_report(compiled.asm["ptx"])
            loop = tile_loop(compiled.asm["cubin"])
            per_exp = (f"{loop['instructions'] / loop['exps']:6.2f} {loop['moves'] / loop['exps']:6.2f}" if loop
                       else f"{'-':>6} {'-':>6}")
            print(f"{label:34} {r['registers']:8d} {r['spill_bytes']:7d} {r['injected_fences']:6d} "
                  f"{compiled.metadata.shared / 1024:7.1f} {per_exp}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dkdv", action="store_true", help="the dK/dV candidates instead of the defaults")
    parser.add_argument("--hopper", action="store_true", help="the Hopper kernels instead of the Triton ones")
    args = parser.parse_args()
    if args.hopper:
        return hopper_report()
    print(f"triton {triton.__version__}, sm_90a, bf16; limits per SM: {SM_REGISTERS} registers, "
          f"{SM_SHARED // 1024} KB shared memory, {SM_THREADS} threads")
    print(f"{'kernel and tiles':42} {'warps':>5} {'stages':>6} {'regs':>5} {'spill B':>7} {'smem KB':>7} {'per SM':>6}")
    for D in (64, 128):
        launches = list(dkdv_candidate_rows(D)) if args.dkdv else [*forward_rows(D), *backward_rows(D)]
        for label, kernel, cx, warps, stages, descs, maxnreg in launches:
            r = compile_report(kernel, cx, warps, stages, descs, maxnreg)
            print(f"{label:42} {warps:5d} {stages:6d} {r['registers']:5d} {r['spill_bytes']:7d} {r['shared_kb']:7.1f} "
                  f"{r['programs_per_sm']:6d}", flush=True)


if __name__ == "__main__":
    main()

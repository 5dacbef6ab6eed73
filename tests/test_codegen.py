"""Every kernel compiles for Hopper (sm_90) on this machine, GPU or not.

The interpreter runs kernels as Python, so it cannot catch code that the Triton compiler rejects (a
variable defined in only one branch of a runtime `if`, a type mismatch between branches). Compiling each
kernel ahead of time for an H100/H200 target catches those before a GPU run does. The compilation runs in
a subprocess without TRITON_INTERPRET, so the kernels are real JIT functions there.
"""

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

# (Hq, Hkv, Nq, Nk, D, mask kind, causal) of calls whose launches compile with the lengths as Triton's JIT
# specialises them: a length of 1 becomes a constant (Triton 3.6's ptxas crashed on the backward of the
# first two; tuning log, step 32), on the dense causal path and the sparse one.
EDGE_CALLS = [(1, 1, 1, 130, 128, "dense", True), (1, 1, 130, 1, 72, "dense", True),
              (2, 1, 1, 130, 128, "random", False)]

# (dense, causal, tma) of the attention kernels' cases: every pair of the three flags' values in four compiles
# (a whole grid of eight took a minute of CI's 2 cores; the GPU suite compiles the rest where it runs them)
PAIRWISE_FLAGS = ((False, False, False), (False, True, True), (True, False, True), (True, True, False))

STREAMED = {"fwd": ("K", "V"), "dq": ("K", "V"), "dkdv": ("Q", "DO")}  # TMA descriptors when TMA=True


def cases():
    """(name, kernel, constexprs, descriptors, options) for every kernel and path, and the forward at the
    library's own dense D=64 settings (a register cap) and long-list D=128 settings (the dense tiles)."""
    import torch

    from sparse_flash.kernels import dispatch
    from sparse_flash.kernels.triton import bwd, fwd
    from sparse_flash.kernels.triton.configs import fwd_config

    tiles = {"fwd": (fwd._attn_fwd_kernel, dict(BLOCK_M=64, BLOCK_N=64)),
             "dq": (bwd._attn_bwd_dq_kernel, dict(BLOCK_M=64, BLOCK_N=32)),
             "dkdv": (bwd._attn_bwd_dkdv_kernel, dict(BLOCK_M=32, BLOCK_N=64))}
    for name, (fn, t) in tiles.items():
        for dense, causal, tma in PAIRWISE_FLAGS:
            yield (f"{name} dense={dense} causal={causal} tma={tma}", fn,
                   dict(HEAD_DIM=72, BLOCK_D=128, MASK_BLOCK_Q=128, MASK_BLOCK_K=128, CAUSAL=causal,
                        DENSE=dense, DOT_PRECISION="tf32", TMA=tma, **t,
                        **({"HAS_DLSE": not tma} if name == "dq" else {})),  # lse's gradient: both ways
                   STREAMED[name] if tma else (), dict(num_warps=4, num_stages=3))
    cfg = fwd_config(64, torch.bfloat16, None, None)
    yield (f"fwd dense D=64 {tuple(cfg)}", fwd._attn_fwd_kernel,
           dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, MASK_BLOCK_Q=cfg.block_m,
                MASK_BLOCK_K=cfg.block_n, CAUSAL=False, DENSE=True, DOT_PRECISION="tf32", TMA=True),
           STREAMED["fwd"], dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg))
    from sparse_flash.kernels import schedule

    from sparse_flash import index_gpu

    yield ("schedule.deal_runs", schedule._deal_runs_kernel, dict(PROGRAMS=256), (), dict(num_warps=4))
    for longest in (True, False):
        for balance in (True, False):
            yield (f"schedule.placed_items order longest={longest} balance={balance}", schedule._order_items_kernel,
                   dict(LONGEST=longest, BALANCE=balance, TILE=128, ITEMS=schedule.ORDER_ITEMS,
                        CHUNK=schedule.ORDER_CHUNK, PROGRAMS=256),
                   (), dict(num_warps=4, types={n: "*i32" for n in ("Scratch", "Placed", "Starts")}
                            | {"heavy_factor": "fp32"}))
    yield ("schedule.placed_items deal", schedule._deal_items_kernel,  # a small size: its sorts take long to compile
           dict(ITEM_COST=schedule.ITEM_COST, BLOCK=1024, RUNS=1024, PROGRAMS=256),
           (), dict(num_warps=4, types={n: "*i32" for n in ("Scratch", "Placed", "Starts")}))
    if dispatch.gluon_modules() is not None:
        from sparse_flash.kernels.gluon import merge

        yield ("merge.ChunkSum", merge._sum_chunks, dict(HEAD_D=128, TILE=128, ROWS=merge.ROWS), (),
               dict(num_warps=4, num_stages=1, types={"Out": "*bf16", "Part": "*fp32", "Merges": "*i32"}))
        from sparse_flash.kernels.gluon import bwd as gluon_bwd

        yield ("one-pass prepare", gluon_bwd._prepare_kernel, dict(D=64, ROWS=64, HAS_DLSE=True), (),
               dict(num_warps=4, num_stages=1, types={"Lse": "*fp32", "Delta": "*fp32", "Lse2": "*fp32",
                                                      "DLse": "*fp32", "Acc": "*fp32", "Sem": "*i32",
                                                      "semaphores": "i32"}))
    plan_args = {f"{name}{n}": "*i32" for name in ("FO", "FI", "PO", "PI", "I", "K") for n in range(4)} \
        | {f"heavy{n}": "fp32" for n in range(4)} | {f"M{n}": "i32" for n in range(4)} | {"Leads": "*i32"}
    for block, chunk in ((8192, 1), (512, 16)):
        yield (f"index_gpu.unsplit_plans {chunk}x{block}", index_gpu._unsplit_plans_kernel,
               {**{f"{what}{n}": value for n in range(4) for what, value in (("BLOCK", block), ("CHUNK", chunk))},
                "FIELDS": index_gpu.FIELDS, "ALIGN": index_gpu.ALIGN}, (), dict(num_warps=4, types=plan_args))
    plan_ints = {n: "*i64" for n in ("N", "Firsts")}
    yield ("index_gpu.plan_sizes", index_gpu._plan_sizes_kernel, dict(BLOCK=8192), (),
           dict(num_warps=4, types={"Counts": "*i32", "N": "*i64", "Sizes": "*i32"}))
    split_args = {f"{name}{n}": "*i32" for name in ("FO", "FI", "PO", "PI", "I", "K", "S", "SP", "SL", "SC", "L")
                  for n in range(4)} | {f"heavy{n}": "fp32" for n in range(4)} | {f"M{n}": "i32" for n in range(4)}
    yield ("index_gpu.split_plans", index_gpu._split_plans_kernel,
           dict(BLOCK=8192, WIDTH=2048, FIELDS=index_gpu.FIELDS), (), dict(num_warps=8, types=plan_ints | split_args))
    yield ("index_gpu.topk_lists: rows", index_gpu._topk_rows_kernel, dict(BLOCK=512, ROWS=32, WIDTH=32, GROUPS=16),
           (), dict(num_warps=4, types={**{n: "*i64" for n in ("Selected", "Counts", "Partial", "PerGroup")},
                                       "Kind": "*i8", **{n: "i32" for n in ("H", "Mq", "Mk", "W")}}))
    yield ("index_gpu.topk_lists: column counts", index_gpu._topk_col_counts_kernel, dict(BLOCK=8192), (),
           dict(num_warps=4, types={"Kind": "*i8", "PerCol": "*i32", "Mq": "i32"}))
    yield ("index_gpu.topk_lists: columns", index_gpu._topk_col_write_kernel, dict(BLOCK=512, COLS=512, CHUNK=16, GROUPS=16),
           (), dict(num_warps=4, types={"Kind": "*i8", "PerCol": "*i32", "PerGroup": "*i64", "Mq": "i32",
                                        "Mk": "i32", "H": "i32"}))
    ints = {n: "i32" for n in ("Mq", "Mk")}
    for causal, block, warps in ((False, index_gpu.MAX_CHOOSE, 4), (True, index_gpu.MAX_CHOOSE, 4), (True, 512, 1)):
        yield (f"index_gpu.choose_topk causal={causal} {block}", index_gpu._choose_topk_kernel,
               dict(CAUSAL=causal, BLOCK=block),
               (), dict(num_warps=warps, types={"Scores": "*fp32", "Counts": "*i64", "Cand": "*i64", "Selected": "*i64",
                                            "Layout": "*i1", "H": "i32", **ints}))
    sides = {f"{side}{n}": "*i32" for side in "RC" for n in range(6)}  # both sides' entries of each kind
    yield ("index_gpu.layout_lists: counts", index_gpu._layout_counts_kernel,
           dict(BLOCK0=8192, BLOCK1=8192, SUMMARY=index_gpu.SUMMARY), (),
           dict(num_warps=4, types={"Layout": "*i1", "Kinds": "*i32", "Summary": "*i32", **ints}))
    yield ("index_gpu.layout_lists: lists", index_gpu._layout_write_kernel,
           dict(BLOCK0=8192, BLOCK1=8192, ALIGN=index_gpu.ALIGN), (),
           dict(num_warps=4, types={"Layout": "*i1", "Kinds": "*i32", "Ends": "*i32", "Shared": "*i32", "row_kind": "i32",
                                    "col_kind": "i32", **ints, **sides}))
    yield ("index_gpu.runs_layout", index_gpu._runs_layout_kernel,
           dict(RUNS=index_gpu.RUNS_TILE, STEP=index_gpu.RUN_STEP), (),
           dict(num_warps=4, types={"Runs": "*i64", "Layout": "*i1", "n": "i32", "Mk": "i32"}))
    yield ("index_gpu.fixed_layout", index_gpu._fixed_layout_kernel,
           dict(CAUSAL=False, HORIZONTAL=True, TILE=index_gpu.FIXED_TILE), (),
           dict(num_warps=4, types={"Layout": "*i1", **{n: "i32" for n in ("M", "local", "width", "patterns")}}))
    for uniform in (False, True):
        yield (f"index_gpu.hash_into uniform={uniform}", index_gpu._hash_kernel,
               dict(UNIFORM=uniform, BLOCK=index_gpu.HASH_BLOCK), (),
               dict(num_warps=4, types={"Out": "*fp32" if uniform else "*i64", "n": "i32", "first": "i32", "second": "i32"}))
    cfg = fwd_config(128, torch.bfloat16, 128, 128, False, 16384, long_lists=True)
    yield (f"fwd sparse long lists D=128 {tuple(cfg)}", fwd._attn_fwd_kernel,
           dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, MASK_BLOCK_Q=128,
                MASK_BLOCK_K=128, CAUSAL=False, DENSE=False, DOT_PRECISION="tf32", TMA=True),
           STREAMED["fwd"], dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg))


def gluon_cases():
    """(dtype, dense, causal, mask block, split lists, head dim, the items' mean K/V tiles) of the warp-specialised
    Hopper forward (Gluon), or none where this Triton has no Gluon."""
    import torch

    from sparse_flash.kernels import dispatch

    if dispatch.gluon_modules() is None:
        return []
    long, short = math.inf, 4.0  # items' mean K/V tiles: two per turn of the loop where D allows, or one
    return [(torch.bfloat16, False, False, 128, False, 128, long), (torch.float16, True, False, 128, False, 128, long),
            (torch.bfloat16, True, True, 128, False, 128, long), (torch.float16, False, True, 256, False, 128, long),
            (torch.bfloat16, False, False, 128, True, 128, long), (torch.bfloat16, False, True, 256, True, 128, long),
            (torch.bfloat16, False, True, 128, False, 64, long), (torch.bfloat16, False, False, 128, True, 64, long),
            (torch.bfloat16, False, False, 128, True, 128, short), (torch.bfloat16, False, False, 128, False, 64, short)]


def gluon_bwd_cases():
    """(dtype, dense, causal, mask block_q, query heads per KV head, head dim, lse in log2 units as the Gluon dQ
    pass stores it) of the warp-specialised Hopper dK/dV kernel (Gluon), or none where this Triton has no Gluon."""
    import torch

    from sparse_flash.kernels import dispatch

    if dispatch.gluon_modules() is None:
        return []
    return [(torch.bfloat16, False, False, 128, 1, 128, True), (torch.float16, True, False, 128, 1, 128, False),
            (torch.bfloat16, True, True, 128, 1, 128, True), (torch.float16, False, True, 256, 1, 128, True),
            (torch.bfloat16, False, False, 128, 4, 128, False), (torch.bfloat16, False, True, 128, 1, 64, True)]


def gluon_one_pass_cases():
    """(dtype, dense, causal, mask block_q, query heads per KV head, head dim, ordered) of the one-pass Hopper
    backward (Gluon), or none where this Triton has no Gluon."""
    import torch

    from sparse_flash.kernels import dispatch

    if dispatch.gluon_modules() is None:
        return []
    return [(torch.bfloat16, True, False, 128, 1, 128, True), (torch.bfloat16, False, True, 256, 1, 128, True),
            (torch.float16, False, True, 128, 4, 64, False)]


def gluon_dq_cases():
    """(dtype, dense, causal, mask block_k, head dim, stores the lse in log2 units for the Gluon dK/dV pass) of
    the warp-specialised Hopper dQ kernel (Gluon), or none where this Triton has no Gluon."""
    import torch

    from sparse_flash.kernels import dispatch

    if dispatch.gluon_modules() is None:
        return []
    return [(torch.bfloat16, False, False, 128, 128, True), (torch.float16, True, False, 128, 128, False),
            (torch.bfloat16, True, True, 128, 128, True), (torch.float16, False, True, 256, 128, True),
            (torch.bfloat16, False, True, 128, 64, True)]


FAMILIES = ("triton-attention", "triton-other", "hopper-fwd", "hopper-dkdv", "hopper-one-pass", "hopper-dq")  # one
# subprocess each
ATTENTION = ("fwd ", "dq ", "dkdv ", "one-pass ")  # the names of the Triton attention kernels' cases


def family_cases(family: str) -> list:
    """The cases of one family of `FAMILIES` (`cases` split into the attention kernels and the rest,
    `gluon_cases`, ...)."""
    if family.startswith("triton-"):
        return [case for case in cases() if case[0].startswith(ATTENTION) == (family == "triton-attention")]
    return {"hopper-fwd": gluon_cases, "hopper-dkdv": gluon_bwd_cases, "hopper-one-pass": gluon_one_pass_cases,
            "hopper-dq": gluon_dq_cases}[family]()


def _compile_case(family: str, case) -> tuple[str, int | None]:
    """Compile one case of `family` for sm_90a: `(its name, the shared memory it uses in bytes, or None)`."""
    from sparse_flash.kernels import dispatch
    from sparse_flash.kernels.aot import compile_sm90

    if family.startswith("triton-"):
        name, fn, constexprs, descriptors, options = case
        compile_sm90(fn, constexprs, descriptors, **options)
        return name, None
    gluon = dispatch.gluon_modules()
    if family == "hopper-fwd":
        from sparse_flash.kernels.gluon import merge

        dtype, dense, causal, block, split, head_dim, mean_tiles = case
        shared = gluon.fwd.compile_sm90(dtype, dense, causal, block, split, head_dim=head_dim,
                                        mean_tiles=mean_tiles).metadata.shared
        if split:  # and the launch that merges the chunks
            compile_sm90(merge._merge_split_rows_kernel, dict(HEAD_D=128, MASK_BLOCK_Q=block, BLOCK_M=128))
        return (f"hopper fwd {dtype} dense={dense} causal={causal} block={block} split={split} D={head_dim} "
                f"mean_tiles={mean_tiles}"), shared
    if family == "hopper-dkdv":
        dtype, dense, causal, block_q, groups, head_dim, lse2 = case
        return (f"hopper dkdv {dtype} dense={dense} causal={causal} block_q={block_q} groups={groups} D={head_dim} "
                f"lse_log2={lse2}"), gluon.dkdv.compile_sm90(dtype, dense, causal, block_q, groups, head_dim=head_dim,
                                                             lse_log2=lse2).metadata.shared
    if family == "hopper-one-pass":
        dtype, dense, causal, block_q, groups, head_dim, ordered = case
        return (f"hopper one-pass {dtype} dense={dense} causal={causal} block_q={block_q} groups={groups} "
                f"D={head_dim} ordered={ordered}"), gluon.bwd.compile_sm90(dtype, dense, causal, block_q, groups,
                                                                           head_dim, ordered).metadata.shared
    dtype, dense, causal, block_k, head_dim, lse2 = case
    dlse = causal and not dense  # the log-sum-exp's gradient: compiled both ways
    return (f"hopper dq {dtype} dense={dense} causal={causal} block_k={block_k} D={head_dim} store_lse2={lse2} "
            f"dlse={dlse}"), gluon.dq.compile_sm90(dtype, dense, causal, block_k, head_dim=head_dim, store_lse2=lse2,
                                                  dlse=dlse).metadata.shared


def main(families=FAMILIES) -> int:
    """Compile every case of `families` for sm_90a, one line each ("ok ..." or "FAIL ..."); "SKIP ..." alone
    where this Triton spells the ahead-of-time API differently. 1 if any case failed."""
    from sparse_flash.kernels.aot import AheadOfTimeUnsupported, source_sm90

    name, fn, constexprs, descriptors, options = next(iter(cases()))
    try:  # every family is skipped alike: the Gluon ones need this Triton's API too
        source_sm90(fn, constexprs, descriptors)
    except AheadOfTimeUnsupported as e:
        print(f"SKIP this triton's ASTSource API differs: {e}")
        return 0
    failed = 0
    for family in families:
        for case in family_cases(family):
            try:
                name, shared = _compile_case(family, case)
                assert shared is None or shared <= 227 * 1024, f"{shared} bytes of shared memory"
                print(f"ok {name}" + ("" if shared is None else f" ({shared} bytes of shared memory)"))
            except Exception as e:
                failed += 1
                print(f"FAIL {family} {case}: {type(e).__name__}: {str(e)[:2000]}")
    return 1 if failed else 0


def recorded_launches() -> list[dict]:
    """The launches of the forward and backward of EDGE_CALLS (fp16), written down instead of run."""
    import torch
    from conftest import DEVICE  # not at the top: conftest turns the interpreter on, and main() compiles

    import sparse_flash
    from sparse_flash import masks
    from sparse_flash.kernels import launch as launch_module
    from sparse_flash.kernels.aot import launch_record
    from sparse_flash.testing import make_qkv

    from sparse_flash.mask_index import _index_gpu

    _index_gpu()  # imported before the patch: a module imported under it would keep the stub (tuning log, step 94)
    records, attention = [], {"_attn_fwd_kernel", "_attn_bwd_dq_kernel", "_attn_bwd_dkdv_kernel"}
    real = launch_module.launch

    def record(kernel, grid, args, constexprs, num_warps, num_stages, maxnreg=0, cooperative=False):
        """The attention kernels written down, not run; every other launch (the GPU's index lists and plans,
        which later calls read) runs."""
        if getattr(kernel, "fn", kernel).__name__ not in attention:
            return real(kernel, grid, args, constexprs, num_warps, num_stages, maxnreg, cooperative)
        records.append(launch_record(kernel, args, constexprs, num_warps, num_stages, maxnreg))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch_module, "launch", record)
        for Hq, Hkv, Nq, Nk, D, kind, causal in EDGE_CALLS:
            mask = (masks.dense(Nq, 64, seq_len_k=Nk) if kind == "dense" else
                    masks.random(Nq, 64, density=0.5, seed=1, seq_len_k=Nk)).to(DEVICE)
            q, k, v = make_qkv(1, Hq, Hkv, Nq, Nk, D, dtype=torch.float16, device=DEVICE)
            sparse_flash.block_sparse_attention(q, k, v, mask, causal=causal, backend="triton").sum().backward()
    return list({json.dumps(r, sort_keys=True): r for r in records}.values())


def compile_records() -> int:
    """Compile the launch records read from stdin; one line per record."""
    from sparse_flash.kernels.aot import compile_recorded

    failed = 0
    for r in json.load(sys.stdin):
        name = f"{r['kernel']} {r['num_warps']} warps {r['num_stages']} stages"
        try:
            compile_recorded(r)
            print(f"ok {name}")
        except Exception as e:
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}")
    return 1 if failed else 0


def test_edge_launches_compile_as_the_gpu_specialises_them():
    from conftest import triton_usable

    if not triton_usable():
        pytest.skip("triton is not usable here")
    records = recorded_launches()
    assert {r["kernel"] for r in records} == {"_attn_fwd_kernel", "_attn_bwd_dq_kernel", "_attn_bwd_dkdv_kernel"}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__, "--records"], input=json.dumps(records), env=env,
                         capture_output=True, text=True, timeout=900)
    if "SKIP" in run.stdout:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert run.stdout.count("ok ") == len(records)


def test_resource_report_reads_registers_spills_and_injected_fences_from_ptxas():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
    from kernel_resources import parse_ptxas

    lines = ["ptxas info    : (C7519) warpgroup.arrive is injected in around line 2022 by compiler to allow use of "
             "registers in GMMA in function 'k'",
             "ptxas info    : (C7519) warpgroup.arrive is injected in around line 4347 by compiler to allow use of "
             "registers in GMMA in function 'k'",
             "ptxas info    : Function properties for k",
             "    40 bytes stack frame, 68 bytes spill stores, 68 bytes spill loads",
             "ptxas info    : Used 168 registers, used 3 barriers, 40 bytes cumulative stack size"]
    assert parse_ptxas(lines) == {"registers": 168, "spill_bytes": 68, "injected_fences": 2}
    assert parse_ptxas(lines[2:])["injected_fences"] == 0


def test_the_hopper_forward_pairs_tiles_only_for_long_items():
    """Two score tiles per turn where the items walk `PAIRED_MIN_TILES` K/V tiles or more on average (and D and
    the causal flag allow it); the mean is the row lists' blocks over their number, in 128-key tiles."""
    from sparse_flash import masks
    from sparse_flash.kernels import dispatch

    if dispatch.gluon_modules() is None:
        pytest.skip("this Triton has no Gluon")
    fwd = dispatch.gluon_modules().fwd
    for mask, causal in ((masks.longformer(16384, 128), False), (masks.butterfly(16384, 128), False),
                         (masks.butterfly(8192, 256), False), (masks.butterfly(16384, 128), True)):
        index, geometry = mask.kernel_records(causal)
        mean = fwd._mean_tiles(index, geometry)
        counts = mask.row_index(causal).counts.double()
        assert mean == pytest.approx(counts.mean().item() * (mask.block_size[1] // fwd.BLOCK))
        for head_dim in (64, 128):
            expected = mean >= fwd.PAIRED_MIN_TILES and (head_dim == 64 or (not causal and mask.block_size[1] == 128))
            assert fwd._constexprs(mask.block_size[1], False, causal, False, mask.block_size[0], head_dim,
                                   mean)["PAIRED"] == expected
    assert fwd._mean_tiles(*masks.longformer(16384, 128).kernel_records(False)) < fwd.PAIRED_MIN_TILES  # 4-5 tiles
    assert fwd._mean_tiles(*masks.butterfly(16384, 128).kernel_records(False)) >= fwd.PAIRED_MIN_TILES  # 8
    assert fwd._constexprs(128, True, False, False, 128, 64)["PAIRED"]  # dense: every item walks all keys


@pytest.mark.parametrize("family", FAMILIES)
def test_kernels_compile_for_sm90(family):
    """Every case of the family compiles (a subprocess per family, so that test workers share the compiles)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__, family], env=env, capture_output=True, text=True, timeout=600)
    if "SKIP" in run.stdout:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert run.stdout.count("ok ") == len(family_cases(family))  # every kernel and path of the family compiled


if __name__ == "__main__":
    sys.exit(compile_records() if sys.argv[1:] == ["--records"] else main(sys.argv[1:] or FAMILIES))

"""Sweep the kernels' tile shapes, warps and pipeline depth on this GPU; print the best per head dim.

The candidates are the Triton kernels' tiles (`sparse_flash/kernels/triton/configs.py`), so the Hopper (Gluon)
kernels are switched off while they are timed. The winners go into `configs.py` by hand (with the measurement
in docs/tuning-log.md), so users get tuned kernels without autotuning at run time.

    python benchmarks/tune_kernels.py --out results.json               # tile defaults, B=4 H=16 N=4096
    python benchmarks/tune_kernels.py --set rows --out results.json    # the benchmark's rows, best per row
    python benchmarks/tune_kernels.py --set bwd-passes --out r.json    # dQ and dK/dV pass settings, each alone
    python benchmarks/tune_kernels.py --set order --out r.json         # heads scheduled together, then tiles

Candidates compile in parallel worker processes first (they share Triton's on-disk cache), then the main
process times each one with `triton.testing.do_bench` on the same inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from concurrent.futures import ProcessPoolExecutor

import torch

FWD = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3),
       (128, 64, 4, 4), (128, 128, 4, 3), (64, 128, 4, 3)]
# (kv_block_m, kv_block_n, q_block_m, q_block_n, warps, stages)
BWD = [(32, 128, 128, 32, 4, 3), (64, 128, 128, 64, 8, 2), (32, 64, 64, 32, 4, 3), (64, 64, 64, 64, 4, 2),
       (32, 128, 128, 32, 8, 2), (16, 128, 128, 16, 4, 3), (64, 128, 128, 64, 8, 3), (32, 128, 128, 32, 4, 2),
       (64, 64, 128, 32, 4, 3)]
PROBLEMS = [("dense", False), ("dense", True), ("butterfly", False), ("bigbird", False)]
HEAD_DIMS = (64, 128)
# --set rows: (B, H, N, D, mask, causal) rows of bench_attention.py, each reported on its own
ROWS = [(4, 16, 4096, 64, m, False) for m in ("butterfly", "random", "longformer")] + [
    (4, 16, 4096, 128, m, False) for m in ("butterfly", "random", "bigbird")] + [
    (4, 16, 4096, 128, "dense", True)] + [
    (1, 16, 16384, 128, m, False) for m in ("butterfly", "random", "local", "bigbird", "longformer")] + [
    (1, 16, 16384, 128, "dense", True), (1, 16, 16384, 128, "dense", False)] + [
    (1, 8, 65536, 64, m, False) for m in ("butterfly", "random", "local")] + [
    (B, H, N, 64, "dense", causal) for B, H, N in ((4, 16, 4096), (1, 8, 65536)) for causal in (True, False)]
ROW_FWD = [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 3), (64, 128, 4, 3),
           (128, 64, 8, 4),
           # shallower pipelines and narrower key tiles: less shared memory per program, more programs per SM
           (64, 64, 4, 2), (64, 64, 4, 4), (64, 32, 4, 2), (64, 32, 4, 3), (64, 128, 4, 2), (128, 64, 8, 2)]
ROW_BWD = [(32, 64, 64, 32, 4, 3), (64, 128, 128, 64, 8, 3), (64, 64, 64, 64, 4, 2), (32, 128, 128, 32, 4, 3),
           (64, 128, 128, 64, 8, 2), (64, 64, 64, 64, 4, 3),
           # 64-row programs with wide inner steps and two stages, as the D=64 forward won with (tuning log, step 26)
           (32, 64, 64, 32, 4, 2), (64, 64, 64, 128, 4, 2), (128, 64, 64, 64, 4, 2), (128, 64, 64, 128, 4, 2),
           # dK/dV tiles that do not spill registers at D=128 (kernel_resources.py --dkdv; tuning log, step 28)
           (32, 64, 64, 64, 4, 2), (32, 64, 64, 64, 4, 3), (64, 64, 64, 64, 8, 2),
           # three programs per SM at D=64 (tuning log, step 34): dK/dV held to 168 registers, one stage, or the
           # long lists' dQ held to 168 (a seventh and eighth number cap the dK/dV and dQ passes)
           (32, 64, 64, 32, 4, 3, 168, 0), (32, 64, 64, 32, 4, 1), (32, 128, 128, 32, 4, 3, 0, 168)]


def _mask(name, N):
    """The benchmark's mask of that name ("dense" is the all-ones mask, for either causal flag)."""
    from bench_attention import build_mask

    return build_mask(name, N, "cuda")[0]


def _problem(name, causal, D, N=4096, B=4, H=16, Hkv=None):
    import sparse_flash  # noqa: F401

    mask = _mask(name, N)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, Hkv or H, N, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    return mask, q, k, v, do


def _patch(kind, cfg, group=None):
    """Fix the Triton launchers' tile settings to `cfg`, and the heads scheduled together to `group` (None:
    the library's rule). The settings are the Triton kernels', so the Hopper kernels are turned off."""
    from sparse_flash.kernels import settings
    from sparse_flash.kernels.triton import bwd, configs, fwd

    settings.configure(hopper_forward=False, hopper_backward=False)
    if kind == "fwd":
        fwd.fwd_config = lambda *a: configs.FwdConfig(*cfg)
    else:
        bwd.bwd_config = lambda *a: configs.BwdConfig(*cfg)
    for module in (fwd, bwd):
        module.schedule_heads = configs.schedule_heads if group is None else (lambda nbytes, heads: min(group, heads))


def _run_once(kind, cfg, name, causal, D, shape=None, group=None):
    from sparse_flash.kernels.dispatch import attn_bwd, attn_fwd

    _patch(kind, cfg, group)
    mask, q, k, v, do = _problem(name, causal, D, **(shape or {}))
    index, geometry = mask._records(causal)  # the lists themselves, as the kernels get them
    scale = D**-0.5
    plans = {}  # kept across the timed calls, as the library keeps them per mask (tuning log, step 40)
    if kind == "fwd":
        return lambda: attn_fwd(q, k, v, index, geometry, causal, scale, plans)
    out, lse = attn_fwd(q, k, v, index, geometry, causal, scale, plans)
    return lambda: attn_bwd(do, q, k, v, out, lse, index, geometry, causal, scale, plans)


def _warm(job):
    """Compile one candidate in a worker (fills the shared Triton cache); returns an error or None."""
    try:
        _run_once(*job)()
        torch.cuda.synchronize()
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="tune.json")
    parser.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    parser.add_argument("--set", choices=("defaults", "rows", "bwd-passes", "order"), default="defaults")
    parser.add_argument("--no-tiles", action="store_true", help="--set order: the head-group sweep only")
    parser.add_argument("--masks", help="--set rows: only rows of these masks (comma-separated)")
    parser.add_argument("--rows", help="--set rows: only rows whose (B, H, N, D, mask, causal) text contains this "
                        "(or one of several, separated by '|')")
    parser.add_argument("--kind", choices=("fwd", "bwd"), help="--set rows: only this pass")
    parser.add_argument("--cands", help="--set rows: these candidates instead of ROW_FWD / ROW_BWD, as tuples "
                        "separated by ';' (with --kind), e.g. '32,64,64,64,4,2;64,64,64,64,8,2'")
    args = parser.parse_args()
    if args.cands and not args.kind:
        parser.error("--cands needs --kind (the numbers of forward and backward candidates differ)")
    if args.set == "order":
        return tune_order(args)
    if args.set == "rows":
        return tune_rows(args)
    if args.set == "bwd-passes":
        return tune_bwd_passes(args)
    jobs = [(kind, cfg, name, causal, D) for kind, cands in (("fwd", FWD), ("bwd", BWD)) for cfg in cands
            for name, causal in PROBLEMS for D in HEAD_DIMS]
    results = [{"kind": kind, "cfg": cfg, "mask": name, "causal": causal, "D": D, **t}
               for (kind, cfg, name, causal, D), t in zip(jobs, _compile_and_time(jobs, args.workers))]
    best = {}
    for kind in ("fwd", "bwd"):
        for D in HEAD_DIMS:
            scores = {}
            for r in results:
                if r["kind"] == kind and r["D"] == D:
                    scores.setdefault(tuple(r["cfg"]), []).append(r.get("ms", float("inf")))
            base = {p: min(r.get("ms", float("inf")) for r in results
                           if r["kind"] == kind and r["D"] == D and (r["mask"], r["causal"]) == p) for p in PROBLEMS}
            # geometric mean of time relative to the best candidate on each problem
            rel = {cfg: statistics.geometric_mean([t / base[p] for t, p in zip(ts, PROBLEMS)]) for cfg, ts in scores.items()}
            ranked = sorted(rel.items(), key=lambda kv: kv[1])
            best[f"{kind} D={D}"] = [{"cfg": list(c), "rel": round(v, 3)} for c, v in ranked[:4]]
    with open(args.out, "w") as f:
        json.dump({"results": results, "best": best}, f, indent=2)
    for r in results:
        print(r["kind"], r["D"], r["mask"], "causal" if r["causal"] else "", r["cfg"], f"{r['ms']:.3f}" if "ms" in r else r["error"])
    print(json.dumps(best, indent=1))


def _compile_and_time(jobs, workers) -> list[dict]:
    """Compile every job in worker processes (they share Triton's cache), then time each here: {"ms"} or
    {"error"} per job."""
    from triton.testing import do_bench

    with ProcessPoolExecutor(workers, mp_context=torch.multiprocessing.get_context("spawn")) as pool:
        errors = list(pool.map(_warm, jobs))
    timed = []
    for job, err in zip(jobs, errors):
        try:
            timed.append({"error": err} if err else
                         {"ms": do_bench(_run_once(*job), warmup=10, rep=50, return_mode="median")})
        except Exception as e:
            timed.append({"error": f"{type(e).__name__}: {e}"[:200]})
        print("timed", job[:2], job[2:], timed[-1], flush=True)  # a run cut short keeps what it measured
    return timed


def _print_best(results, label, groups, kinds, name_of) -> None:
    """Per (kind, problem): the default's time and the best three candidates."""
    print(f"{label:4} {'B,H,N,D':16} {'mask':10} {'default ms':>10}  best three ({name_of}, ms)")
    for kind in kinds:
        for B, H, N, D, name, causal in groups:
            rs = [r for r in results if r[label] == kind and (r["B"], r["H"], r["N"], r["D"], r["mask"], r["causal"])
                  == (B, H, N, D, name, causal) and "ms" in r]
            base = next((r["ms"] for r in rs if r["default"]), float("nan"))
            top = sorted(rs, key=lambda r: r["ms"])[:3]
            print(f"{kind:4} {f'{B},{H},{N},{D}':16} {name + (' causal' if causal else ''):10} {base:10.3f}  "
                  + "  ".join(f"{tuple(r[name_of])} {r['ms']:.3f}" for r in top), flush=True)


def tune_rows(args):
    """Every candidate on every benchmark row; prints the best three per row against the current default."""
    from sparse_flash.kernels.triton import bwd, configs, fwd

    current = {"fwd": fwd.fwd_config, "bwd": bwd.bwd_config}
    rows = [r for r in ROWS if (args.masks is None or r[4] in args.masks.split(","))
            and (args.rows is None or any(part in str(r) for part in args.rows.split("|")))]
    kinds = (args.kind,) if args.kind else ("fwd", "bwd")
    jobs = []
    for B, H, N, D, name, causal in rows:
        shape = {"B": B, "H": H, "N": N}
        mask = _mask(name, N)
        block = None if name == "dense" else 128
        long_lists = mask.has_long_lists(causal)
        defaults = {"fwd": tuple(current["fwd"](D, torch.bfloat16, block, block, causal, N, long_lists)),
                    "bwd": tuple(current["bwd"](D, torch.bfloat16, block, block, causal, long_lists))}
        # candidates with TMA descriptor loads; the backward also with pointer loads (their default at D = 64)
        chosen = [tuple(int(x) for x in c.split(",")) for c in args.cands.split(";")] if args.cands else None
        # a fifth number of a forward candidate caps its registers per thread (FwdConfig.maxnreg)
        # (--cands names candidates of one --kind only: each kind is built only when it is timed)
        build = {"fwd": lambda: [tuple(configs.FwdConfig(*c[:4], True, *c[4:])) for c in chosen or ROW_FWD],
                 # a seventh and eighth number of a backward candidate cap the dK/dV and dQ passes' registers
                 "bwd": lambda: [tuple(configs.BwdConfig(*c[:6], 0, 0, tma, *c[6:])) for c in chosen or ROW_BWD
                                 for tma in (True, False)]}
        cands = {kind: build[kind]() for kind in kinds}
        for kind in kinds:
            for cfg in dict.fromkeys([defaults[kind], *cands[kind]]):
                jobs.append(((kind, cfg, name, causal, D, shape), cfg == defaults[kind], mask.density))
    timed = _compile_and_time([j for j, _, _ in jobs], args.workers)
    results = []
    for (job, is_default, density), t in zip(jobs, timed):
        kind, cfg, name, causal, D, shape = job
        results.append({"kind": kind, "cfg": list(cfg), "default": is_default, "mask": name, "causal": causal,
                        "D": D, **shape, "density": density, **t})
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    _print_best(results, "kind", rows, kinds, "cfg")


# --set bwd-passes: the dQ pass (q_block_m, q_block_n, warps, stages) and the dK/dV pass (kv_block_m,
# kv_block_n, warps, stages) varied one at a time, the other pass held at its default
PASS_ROWS = [(4, 16, 4096, 128, m, False) for m in ("butterfly", "random", "local")] + [
    (1, 16, 16384, 128, m, False) for m in ("butterfly", "random")] + [
    (4, 16, 4096, 64, m, False) for m in ("butterfly", "random")] + [(1, 8, 65536, 64, "butterfly", False)]
DQ_PASS = [(128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3), (128, 32, 8, 3), (64, 32, 4, 3), (64, 64, 4, 2),
           (128, 32, 4, 3)]
DKDV_PASS = [(64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 2), (32, 128, 4, 3),
             (64, 128, 4, 3)]


def tune_bwd_passes(args):
    """Each backward pass's settings alone; prints the best three per pass and row against the default."""
    from sparse_flash.kernels.triton import bwd

    current = bwd.bwd_config
    jobs = []
    for B, H, N, D, name, causal in PASS_ROWS:
        shape = {"B": B, "H": H, "N": N}
        mask = _mask(name, N)
        kv_m, kv_n, q_m, q_n, warps, stages, *_ = current(D, torch.bfloat16, 128, 128, causal,
                                                          mask.has_long_lists(causal))
        for q_pass in dict.fromkeys([(q_m, q_n, warps, stages), *DQ_PASS]):
            cfg = (kv_m, kv_n, q_pass[0], q_pass[1], warps, stages, q_pass[2], q_pass[3])
            jobs.append((("bwd", cfg, name, causal, D, shape), "dq", q_pass, q_pass == (q_m, q_n, warps, stages)))
        for kv_pass in dict.fromkeys([(kv_m, kv_n, warps, stages), *DKDV_PASS]):
            cfg = (kv_pass[0], kv_pass[1], q_m, q_n, kv_pass[2], kv_pass[3], warps, stages)
            jobs.append((("bwd", cfg, name, causal, D, shape), "dkdv", kv_pass, kv_pass == (kv_m, kv_n, warps, stages)))
    timed = _compile_and_time([j for j, *_ in jobs], args.workers)
    results = []
    for (job, which, setting, is_default), t in zip(jobs, timed):
        _, cfg, name, causal, D, shape = job
        results.append({"pass": which, "setting": list(setting), "cfg": list(cfg), "default": is_default,
                        "mask": name, "causal": causal, "D": D, **shape, **t})
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    _print_best(results, "pass", PASS_ROWS, ("dq", "dkdv"), "setting")


# --set order: (B, Hq, Hkv, N, D, mask) sparse rows of bench_attention.py; each is timed with the (batch,
# head) pairs scheduled in groups of 1, 2, 4, ... up to all of them (the old order), then, for the rows below
# FlexAttention, every tile candidate with one head at a time.
ORDER_ROWS = [(4, 16, 16, 4096, 64, m) for m in ("local", "butterfly", "random", "bigbird", "longformer")] + [
    (4, 16, 16, 4096, 128, m) for m in ("local", "butterfly", "random", "bigbird")] + [
    (4, 32, 8, 4096, 128, m) for m in ("butterfly", "random")] + [
    (1, 16, 16, 16384, 128, m) for m in ("local", "butterfly", "random", "bigbird", "longformer")] + [
    (1, 8, 8, 65536, 64, m) for m in ("local", "butterfly", "random", "bigbird")]
ORDER_TILE_ROWS = [r for r in ORDER_ROWS if r[5] in ("local", "butterfly", "random") and (r[4] == 128 or r[3] == 65536)]


def _default_cfgs(D, N, mask):
    from sparse_flash.kernels.triton import configs

    return {"fwd": tuple(configs.fwd_config(D, torch.bfloat16, 128, 128, False, N, mask.has_long_lists(False))),
            "bwd": tuple(configs.bwd_config(D, torch.bfloat16, 128, 128, False, mask.has_long_lists(False)))[:6]}


def tune_order(args):
    """Heads scheduled together at the default tiles; then tiles with one head at a time."""
    jobs = []
    for B, H, Hkv, N, D, name in ORDER_ROWS:
        mask = _mask(name, N)
        defaults = _default_cfgs(D, N, mask)
        shape = {"B": B, "H": H, "N": N, "Hkv": Hkv}
        groups = sorted({min(g, B * Hkv) for g in (1, 2, 4, 8, 16)} | {B * H})
        for kind in ("fwd", "bwd"):
            for g in [*groups, None]:  # None: the library's rule
                jobs.append(((kind, defaults[kind], name, False, D, shape, g), "group", g, g == B * H))
        if (B, H, Hkv, N, D, name) in ORDER_TILE_ROWS and not args.no_tiles:
            for kind, cands in (("fwd", ROW_FWD), ("bwd", ROW_BWD)):
                for cfg in dict.fromkeys([defaults[kind], *cands]):
                    jobs.append(((kind, cfg, name, False, D, shape, 1), "tiles", cfg, cfg == defaults[kind]))
    timed = _compile_and_time([j for j, *_ in jobs], args.workers)
    results = []
    for (job, what, setting, is_default), t in zip(jobs, timed):
        kind, cfg, name, causal, D, shape, g = job
        results.append({"kind": kind, "sweep": what, "setting": setting, "cfg": list(cfg), "group": g,
                        "default": is_default, "mask": name, "D": D, **shape, **t})
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"{'kind':4} {'B,Hq,Hkv,N,D':20} {'mask':10} old order ms -> ms per group size")
    for kind in ("fwd", "bwd"):
        for B, H, Hkv, N, D, name in ORDER_ROWS:
            rs = [r for r in results if r["kind"] == kind and r["sweep"] == "group" and "ms" in r
                  and (r["B"], r["H"], r["Hkv"], r["N"], r["D"], r["mask"]) == (B, H, Hkv, N, D, name)]
            old = next((r["ms"] for r in rs if r["default"]), float("nan"))
            print(f"{kind:4} {f'{B},{H},{Hkv},{N},{D}':20} {name:10} {old:.3f} -> "
                  + " ".join(f"{r['group'] or 'rule'}:{r['ms']:.3f}({old / r['ms']:.2f}x)" for r in rs), flush=True)
    print("tiles with one head at a time: default ms, best three")
    for kind in ("fwd", "bwd"):
        for B, H, Hkv, N, D, name in ORDER_TILE_ROWS:
            rs = [r for r in results if r["kind"] == kind and r["sweep"] == "tiles" and "ms" in r
                  and (r["B"], r["H"], r["Hkv"], r["N"], r["D"], r["mask"]) == (B, H, Hkv, N, D, name)]
            base = next((r["ms"] for r in rs if r["default"]), float("nan"))
            top = sorted(rs, key=lambda r: r["ms"])[:3]
            print(f"{kind:4} {f'{B},{H},{Hkv},{N},{D}':20} {name:10} {base:.3f}  "
                  + "  ".join(f"{tuple(r['cfg'])} {r['ms']:.3f}" for r in top), flush=True)


if __name__ == "__main__":
    main()

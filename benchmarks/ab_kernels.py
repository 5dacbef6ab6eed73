"""A/B timing of kernel variants in one process, on the benchmark's rows and the same inputs.

Before a kernel change is kept, both versions run interleaved (base, new, new, base; `--repeats` rounds,
after one round thrown away) and each keeps its fastest `do_bench` median and the median of its runs; the
ratios base/new are the change's gain. Three ways to name the versions:

    # a saved copy of the forward launcher against the current one (forward only)
    git show HEAD:sparse_flash/kernels/fwd.py > benchmarks/_fwd_base.py
    python benchmarks/ab_kernels.py --base benchmarks/_fwd_base.py --out ab.json
    # pointer loads (base) against TMA descriptor loads (new), forward and backward
    python benchmarks/ab_kernels.py --switch tma --out ab.json
    # the Triton forward (base) against the Hopper forward (new) where it serves; or, for masks with split
    # lists, fwd.py (base) against the Hopper forward's split-list path (new)
    python benchmarks/ab_kernels.py --switch hopper --out ab.json
    python benchmarks/ab_kernels.py --switch hopper-split --rows "bigbird|longformer" --out ab.json
    # the Hopper forward's items taken in turn by its programs (base) against balanced by load (new)
    python benchmarks/ab_kernels.py --switch hopper-balance --out ab.json
    # the Triton backward kernels (base) against the Hopper dQ and dK/dV kernels (new), backward only
    python benchmarks/ab_kernels.py --switch hopper-bwd --rows "128" --out ab.json

Each version keeps its launch plans per row, as the library keeps them per mask, so the timings are those
of repeated calls (no plan built inside the timed call).
    # a saved copy of the whole package (kernels and the mask's index lists) against the current one,
    # forward and backward
    mkdir -p /tmp/base && git archive HEAD sparse_flash | tar -x -C /tmp/base
    python benchmarks/ab_kernels.py --base-package /tmp/base/sparse_flash --out ab.json
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import sys
import types

import torch

from bench_attention import build_mask  # the benchmark's masks (run from benchmarks/)

# (B, Hq, Hkv, N, D, mask, causal); "dense" is the all-ones mask (dense path)
ROWS = [(4, 16, 16, 4096, 128, m, False) for m in ("dense", "local", "butterfly", "random", "bigbird")] + [
    (4, 16, 16, 4096, 128, "dense", True), (4, 32, 8, 4096, 128, "butterfly", False)] + [
    (1, 16, 16, 16384, 128, m, False) for m in ("dense", "local", "butterfly", "random", "bigbird", "longformer")] + [
    (1, 8, 8, 65536, 64, m, False) for m in ("dense", "local", "butterfly", "random", "bigbird", "longformer")] + [
    (4, 16, 16, 4096, 64, m, False) for m in ("butterfly", "random")] + [
    (1, 16, 16, 16384, 128, "local16", False)]  # long lists at D=128: 31 blocks per row (NOTES step 39)


def row_mask(name: str, N: int):
    """The benchmark's mask of that name, or for `local<w>` a local mask of window w (block 128)."""
    if name.startswith("local") and name[5:].isdigit():
        from sparse_flash import masks

        return masks.local(N, 128, window=int(name[5:]), device="cuda")
    return build_mask(name, N, "cuda")[0]


def load_base(path: str):
    """The saved launcher module, loaded inside `sparse_flash.kernels` so that its relative imports resolve."""
    spec = importlib.util.spec_from_file_location("sparse_flash.kernels._fwd_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_base_package(path: str):
    """The kernel launchers and BlockMask of a saved package copy, imported as `sparse_flash_base` without
    running its package `__init__` files (those would register the library's custom ops a second time)."""
    for name, folder in (("sparse_flash_base", path), ("sparse_flash_base.kernels", os.path.join(path, "kernels"))):
        package = types.ModuleType(name)
        package.__path__ = [folder]
        sys.modules[name] = package
    names = ("kernels.fwd", "kernels.bwd", "layout")
    return tuple(importlib.import_module(f"sparse_flash_base.{name}") for name in names)


def set_hopper_split(enabled: bool) -> bool:
    """Allow the Hopper forward's split-list path (`fwd_hopper.SPLIT_LISTS`); returns the previous setting."""
    from sparse_flash.kernels import fwd_hopper

    previous, fwd_hopper.SPLIT_LISTS = fwd_hopper.SPLIT_LISTS, bool(enabled)
    return previous


def set_hopper_balance(enabled: bool) -> bool:
    """Balance the Hopper kernels' items over their programs by load (`hopper.BALANCE`); returns the
    previous setting."""
    from sparse_flash.kernels import hopper

    previous, hopper.BALANCE = hopper.BALANCE, bool(enabled)
    return previous


def kernel_args(mask, causal):
    """(forward index, backward index, geometry) that the launchers take for `mask`."""
    idx = mask.kernel_index(causal)
    rows = [] if mask.is_dense or (causal and mask.covers_causal) else idx.rows()
    geom = [*mask.shape, *mask.block_size, int(mask.has_long_lists(causal))]
    return rows, [] if not rows else idx.rows() + idx.cols(), geom


def time_versions(calls: dict, repeats: int, do_bench) -> dict:
    """`do_bench` medians (ms) of each version's call, in rounds of (base, new, new, base). One round before
    them is thrown away: the GPU runs its first timing after an idle spell at higher clocks."""
    times = {tag: [] for tag in calls}
    for i, tag in enumerate(("base", "new") + ("base", "new", "new", "base") * repeats):
        ms = do_bench(calls[tag], warmup=25, rep=100, return_mode="median")
        if i >= 2:
            times[tag].append(ms)
    return times


def ab_record(row, dtype, pass_, times, max_diff) -> dict:
    """One result: each version's fastest and median timing, and the gains base/new of both."""
    r = {"row": row, "dtype": dtype, "pass": pass_, "base_ms": min(times["base"]), "new_ms": min(times["new"]),
         "runs_ms": times, "max_diff": max_diff}
    r["gain"] = r["base_ms"] / r["new_ms"]
    r["median_gain"] = statistics.median(times["base"]) / statistics.median(times["new"])
    print(r, flush=True)
    return r


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="a saved copy of sparse_flash/kernels/fwd.py")
    parser.add_argument("--base-package", help="a saved copy of the sparse_flash package folder")
    parser.add_argument("--switch", choices=["tma", "hopper", "hopper-split", "hopper-balance", "hopper-bwd"],
                        help="time the library with a setting off (base) and on (new)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--rows", help="only rows whose (B, Hq, Hkv, N, D, mask, causal) text contains one of these "
                        "('|'-separated)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of (base, new, new, base) timings per row")
    parser.add_argument("--out", default="ab.json")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if sum(a is not None for a in (args.base, args.base_package, args.switch)) != 1:
        parser.error("give exactly one of --base, --base-package and --switch")
    from triton.testing import do_bench

    from sparse_flash.kernels import bwd, configs, fwd, tma

    same_mask = lambda mask: mask  # noqa: E731
    masks = {"base": same_mask, "new": same_mask}  # the mask each version walks
    if args.base:
        versions = {"base": load_base(args.base).attn_fwd, "new": fwd.attn_fwd}
        backward = None
    elif args.base_package:
        base_fwd, base_bwd, base_layout = load_base_package(args.base_package)
        versions = {"base": base_fwd.attn_fwd, "new": fwd.attn_fwd}
        backward = {"base": base_bwd.attn_bwd, "new": bwd.attn_bwd}
        masks["base"] = lambda mask: base_layout.BlockMask.from_layout(
            mask.layout, mask.block_size, seq_len_q=mask.seq_len_q, seq_len_k=mask.seq_len_k)
    else:
        setter = {"tma": tma.set_tma, "hopper": configs.set_hopper_forward, "hopper-split": set_hopper_split,
                  "hopper-balance": set_hopper_balance, "hopper-bwd": configs.set_hopper_backward}[args.switch]

        def switched(f, value):
            def call(*a, **kw):
                previous = setter(value)
                try:
                    return f(*a, **kw)
                finally:
                    setter(previous)
            return call

        versions = {"base": switched(fwd.attn_fwd, False), "new": switched(fwd.attn_fwd, True)}
        backward = None
        if args.switch in ("tma", "hopper-bwd"):
            backward = {"base": switched(bwd.attn_bwd, False), "new": switched(bwd.attn_bwd, True)}
    results = []
    chosen = [r for r in ROWS if args.rows is None or any(part in str(r) for part in args.rows.split("|"))]
    for B, Hq, Hkv, N, D, name, causal in chosen:
        mask = row_mask(name, N)
        margs = {tag: kernel_args(masks[tag](mask), causal) for tag in versions}  # (rows, index, geometry)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype, generator=gen)
        k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
        row = [B, Hq, Hkv, N, D, name, causal]
        plans = {tag: {} for tag in versions}  # each version's launch plans for this row
        calls = {tag: (lambda f=f, a=margs[tag], p=plans[tag]: f(q, k, v, a[0], a[2], causal, D**-0.5, p))
                 for tag, f in versions.items()}
        if args.switch != "hopper-bwd":  # that switch leaves the forward as it is: nothing to compare
            outs = {tag: call()[0] for tag, call in calls.items()}
            diff = float((outs["base"].float() - outs["new"].float()).abs().max())
            results.append(ab_record(row, args.dtype, "fwd", time_versions(calls, args.repeats, do_bench), diff))
        if backward is None:
            continue
        rows, _, geom = margs["new"]
        out, lse = fwd.attn_fwd(q, k, v, rows, geom, causal, D**-0.5)
        do = torch.randn_like(q)
        calls = {tag: (lambda f=f, a=margs[tag], p=plans[tag]: f(do, q, k, v, out, lse, a[1], a[2], causal,
                                                                   D**-0.5, p))
                 for tag, f in backward.items()}
        grads = {tag: call() for tag, call in calls.items()}
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(grads["base"], grads["new"]))
        results.append(ab_record(row, args.dtype, "bwd", time_versions(calls, args.repeats, do_bench), diff))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"{'row':44} {'pass':4} {'base ms':>8} {'new ms':>8} {'gain':>6} {'median gain':>11} {'max diff':>9}")
    for r in results:
        print(f"{str(r['row']):44} {r['pass']:4} {r['base_ms']:8.3f} {r['new_ms']:8.3f} {r['gain']:6.3f} "
              f"{r['median_gain']:11.3f} {r['max_diff']:9.2e}")


if __name__ == "__main__":
    main()

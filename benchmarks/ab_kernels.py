"""A/B timing of kernel variants in one process, on the benchmark's rows and the same inputs.

Before a kernel change is kept, both versions run interleaved (base, new, new, base) and each keeps its
faster `do_bench` median; the ratio base/new is the change's gain. Two ways to name the versions:

    # a saved copy of the forward launcher against the current one (forward only)
    git show HEAD:sparse_flash/kernels/fwd.py > benchmarks/_fwd_base.py
    python benchmarks/ab_kernels.py --base benchmarks/_fwd_base.py --out ab.json
    # pointer loads (base) against TMA descriptor loads (new), forward and backward
    python benchmarks/ab_kernels.py --switch tma --out ab.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json

import torch

from bench_attention import build_mask  # the benchmark's masks (run from benchmarks/)

# (B, Hq, Hkv, N, D, mask, causal); "dense" is the all-ones mask (dense path)
ROWS = [(4, 16, 16, 4096, 128, m, False) for m in ("dense", "local", "butterfly", "random", "bigbird")] + [
    (4, 16, 16, 4096, 128, "dense", True), (4, 32, 8, 4096, 128, "butterfly", False)] + [
    (1, 16, 16, 16384, 128, m, False) for m in ("dense", "local", "butterfly", "random")] + [
    (1, 8, 8, 65536, 64, m, False) for m in ("dense", "local", "butterfly", "random")] + [
    (4, 16, 16, 4096, 64, m, False) for m in ("butterfly", "random")]


def load_base(path: str):
    """The saved launcher module, loaded inside `sparse_flash.kernels` so that its relative imports resolve."""
    spec = importlib.util.spec_from_file_location("sparse_flash.kernels._fwd_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="a saved copy of sparse_flash/kernels/fwd.py")
    parser.add_argument("--switch", choices=["tma"], help="time the library with a setting off (base) and on (new)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--rows", help="only rows whose (B, Hq, Hkv, N, D, mask, causal) text contains this")
    parser.add_argument("--out", default="ab.json")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if (args.base is None) == (args.switch is None):
        parser.error("give exactly one of --base and --switch")
    from triton.testing import do_bench

    from sparse_flash.kernels import bwd, fwd, tma

    if args.base:
        versions = {"base": load_base(args.base).attn_fwd, "new": fwd.attn_fwd}
        backward = None
    else:
        def switched(f, on):
            def call(*a):
                previous = tma.set_tma(on)
                try:
                    return f(*a)
                finally:
                    tma.set_tma(previous)
            return call

        versions = {"base": switched(fwd.attn_fwd, False), "new": switched(fwd.attn_fwd, True)}
        backward = {"base": switched(bwd.attn_bwd, False), "new": switched(bwd.attn_bwd, True)}
    results = []
    for B, Hq, Hkv, N, D, name, causal in [r for r in ROWS if args.rows is None or args.rows in str(r)]:
        mask = build_mask(name, N, "cuda")[0]
        idx = mask.kernel_index(causal)
        rows = [] if mask.is_dense or (causal and mask.covers_causal) else idx.rows()
        geom = [*mask.shape, *mask.block_size, int(mask.has_long_lists(causal))]
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype, generator=gen)
        k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
        outs = {tag: f(q, k, v, rows, geom, causal, D**-0.5)[0] for tag, f in versions.items()}
        times = {tag: [] for tag in versions}
        for tag in ("base", "new", "new", "base"):
            f = versions[tag]
            times[tag].append(do_bench(lambda: f(q, k, v, rows, geom, causal, D**-0.5), warmup=25, rep=100,
                                       return_mode="median"))
        r = {"row": [B, Hq, Hkv, N, D, name, causal], "dtype": args.dtype, "pass": "fwd", "base_ms": min(times["base"]),
             "new_ms": min(times["new"]), "runs_ms": times,
             "max_diff": float((outs["base"].float() - outs["new"].float()).abs().max())}
        r["gain"] = r["base_ms"] / r["new_ms"]
        results.append(r)
        print(r, flush=True)
        if backward is None:
            continue
        out, lse = fwd.attn_fwd(q, k, v, rows, geom, causal, D**-0.5)
        do = torch.randn_like(q)
        index = [] if not rows else idx.rows() + idx.cols()
        grads = {tag: f(do, q, k, v, out, lse, index, geom, causal, D**-0.5) for tag, f in backward.items()}
        times = {tag: [] for tag in backward}
        for tag in ("base", "new", "new", "base"):
            f = backward[tag]
            times[tag].append(do_bench(lambda: f(do, q, k, v, out, lse, index, geom, causal, D**-0.5), warmup=25,
                                       rep=100, return_mode="median"))
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(grads["base"], grads["new"]))
        r = {"row": [B, Hq, Hkv, N, D, name, causal], "dtype": args.dtype, "pass": "bwd", "base_ms": min(times["base"]),
             "new_ms": min(times["new"]), "runs_ms": times, "max_diff": diff}
        r["gain"] = r["base_ms"] / r["new_ms"]
        results.append(r)
        print(r, flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"{'row':44} {'pass':4} {'base ms':>8} {'new ms':>8} {'gain':>6} {'max diff':>9}")
    for r in results:
        print(f"{str(r['row']):44} {r['pass']:4} {r['base_ms']:8.3f} {r['new_ms']:8.3f} {r['gain']:6.3f} "
              f"{r['max_diff']:9.2e}")


if __name__ == "__main__":
    main()

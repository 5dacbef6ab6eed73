"""Fit the sparse forward's time to blocks walked and a fixed part, on local masks of growing window.

    python benchmarks/density_fit.py --out fit.json          # needs a CUDA GPU; about two minutes

Local masks give every query block away from the ends the same list length (1, 3, 5, ... 65 blocks), so
the forward's time is `a x (128x128 blocks) + c`, with the number of programs fixed by the length. `a`
against the dense kernel's time per block says how fast the inner loop runs; `c` is what every call pays
whatever its lists (loading Q, storing O, first reads of K and V, program starts). The density rule of the
benchmark (time against the dense kernel at most 1.15 x density + 0.01) holds for a window when `a` and `c`
leave room.
Times are `do_bench` medians, the benchmark's method (it clears L2 before every call), or with `--timing
graph` CUDA-graph replays (`do_bench_cudagraph`: calls back to back, no clearing). The two differ by up to
12% on short lists at D=128 (docs/tuning-log.md, step 38).

    python benchmarks/density_fit.py --head-dims 128 --fwd-configs "64,64,4,3;128,128,8,3"

fits each tile setting of the Triton forward (block_m, block_n, warps, stages: `FwdConfig`) instead of the
library's rule, with the Hopper forward switched off, against the dense kernel at its own; where the lines
cross says from which list length a setting wins.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from triton.testing import do_bench, do_bench_cudagraph

import sparse_flash
from sparse_flash import masks
from sparse_flash.kernels import settings
from sparse_flash.kernels.triton import configs, fwd


TIMING = {"eager": lambda fn: do_bench(fn, warmup=50, rep=300), "graph": lambda fn: do_bench_cudagraph(fn, rep=300)}


def gpu_ms(fn, timing: str = "eager") -> float:
    """The fastest of three medians of `fn` (no grad), timed as `timing` says (see the module)."""
    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        return min(TIMING[timing](fn) for _ in range(3))


def fit(seq_len: int, batch: int, heads: int, head_dim: int, windows, fwd_config=None, timing="eager") -> dict:
    """Time the dense kernel (as the library runs it), then the local masks (at `fwd_config`, a `FwdConfig`
    tuple of the Triton forward, which then serves them instead of the Hopper forward; or as the library
    runs them), and fit the masks' times."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq_len, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    dense = masks.dense(seq_len, 128).to("cuda")
    dense_ms = gpu_ms(lambda: sparse_flash.block_sparse_attention(q, k, v, dense), timing)
    grid_blocks = (seq_len // 128) ** 2 * batch * heads
    rows = []
    rule = fwd.fwd_config
    switches = {} if fwd_config is None else {"hopper_forward": False}
    if fwd_config is not None:  # new masks, so launch plans are built with it
        fwd.fwd_config = lambda *a: configs.FwdConfig(*fwd_config)
    try:
        with settings.override(**switches):
            for w in windows:
                mask = masks.local(seq_len, 128, window=w).to("cuda")
                ms = gpu_ms(lambda: sparse_flash.block_sparse_attention(q, k, v, mask), timing)
                rows.append({"window": w, "density": mask.density, "ms": ms,
                             "limit_ms": (1.15 * mask.density + 0.01) * dense_ms})
    finally:
        fwd.fwd_config = rule
    blocks = np.array([r["density"] * grid_blocks for r in rows])
    a, c = np.polyfit(blocks, np.array([r["ms"] for r in rows]), 1)
    for r, nb in zip(rows, blocks):
        r["fit_ms"] = float(a * nb + c)
    return {"seq_len": seq_len, "batch": batch, "heads": heads, "head_dim": head_dim, "fwd_config": fwd_config,
            "timing": timing, "dense_ms": dense_ms,
            "dense_ns_per_block": dense_ms / grid_blocks * 1e6, "a_ns_per_block": float(a * 1e6),
            "c_us": float(c * 1e3), "rows": rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--windows", default="0,1,2,4,8,16,32")
    parser.add_argument("--fwd-configs", help="forward tile settings to fit, ';'-separated, each "
                        "block_m,block_n,warps,stages (default: the library's rule)")
    parser.add_argument("--timing", choices=sorted(TIMING), default="eager")
    parser.add_argument("--out", default="density_fit.json")
    args = parser.parse_args()
    try:
        windows = [int(w) for w in args.windows.split(",")]
        head_dims = [int(d) for d in args.head_dims.split(",")]
        cfgs = [None] if not args.fwd_configs else [
            (*(int(x) for x in c.split(",")[:4]), True, *(int(x) for x in c.split(",")[4:]))
            for c in args.fwd_configs.split(";")]
    except ValueError as error:
        parser.error(f"--windows, --head-dims and --fwd-configs take comma-separated integers: {error}")
    for flag, value in (("--seq-len", args.seq_len), ("--batch", args.batch), ("--heads", args.heads)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if min(windows) < 0:
        parser.error(f"--windows must be at least 0, got {args.windows}")
    if not torch.cuda.is_available():
        parser.error("density_fit times the kernels on a CUDA GPU; none here")
    results = []
    for d in head_dims:
        for cfg in cfgs:  # each fit is printed and saved when done, so a run cut short keeps what it measured
            r = fit(args.seq_len, args.batch, args.heads, int(d), windows, cfg, args.timing)
            results.append(r)
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "triton": __import__("triton").__version__, "fits": results}, f, indent=1)
            print(f"D={r['head_dim']} tiles {r['fwd_config'] or 'by the rule'}: dense {r['dense_ms']:.3f} ms "
                  f"({r['dense_ns_per_block']:.1f} ns/block); a = {r['a_ns_per_block']:.1f} ns/block, "
                  f"c = {r['c_us']:.1f} us")
            print(f"  {'window':>6} {'blocks/row':>10} {'ms':>8} {'fit ms':>8} {'limit ms':>8}")
            for row in r["rows"]:
                print(f"  {row['window']:6d} {row['density'] * args.seq_len / 128:10.1f} {row['ms']:8.4f} "
                      f"{row['fit_ms']:8.4f} {row['limit_ms']:8.4f}", flush=True)


if __name__ == "__main__":
    main()

"""Where the time of a benchmark row goes: GPU kernel time against wall time per call.

For each row and competitor (causal where the benchmark's row is) it reports the `do_bench` median (what
bench_attention.py reports), the summed GPU kernel time of one call from the profiler (in all and per kernel;
also with the L2 cache flushed before each call, as `do_bench` flushes it), and the host time per call, so a
row that is bound by Python and launch overhead rather than by its kernels shows as wall >> kernel time. A
`do_bench` time above the flushed kernel time is either idle time between launches (a fixed amount per call) or
kernels running slower under `do_bench`'s longer load (growing with the kernel: tuning log, step 140), which
the `sustained` times show: the first 10 of 200 back-to-back calls after a second idle against the last 100.

    python benchmarks/profile_rows.py --out rows.json [--rows d128]
    python benchmarks/profile_rows.py --out rows.json --rows slowest   # the lowest rows vs flex, per kernel
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench_attention import Competitors, build_mask  # the benchmark's masks and competitors (from the repo root)

ROWS = {  # (B, H, N, D, mask[, Hkv])
    "host": [(4, 16, 4096, 64, "butterfly"), (4, 16, 4096, 64, "random"), (4, 16, 4096, 64, "local"),
             (4, 16, 4096, 128, "butterfly"), (4, 16, 4096, 128, "random"), (1, 16, 16384, 128, "bigbird")],
    "fp16": [(4, 16, 4096, 128, "butterfly"), (4, 16, 4096, 128, "random")],
    "d128": [(4, 16, 4096, 128, "random"), (1, 16, 16384, 128, "random"), (1, 16, 16384, 128, "butterfly"),
             (4, 32, 4096, 128, "butterfly", 8), (4, 32, 4096, 128, "random", 8)],
    "density": [(1, 16, 16384, 128, m) for m in ("dense", "local", "butterfly", "bigbird", "longformer")],
    # the lowest forward+backward rows against FlexAttention in the latest run that host load does not explain
    # (D=128 causal and sparse: the two backward passes; step 125), beside dense rows of their shapes
    "slowest": [(4, 16, 4096, 128, "causal"), (1, 16, 16384, 128, "causal"), (1, 16, 16384, 128, "random"),
                (1, 8, 65536, 64, "random"), (4, 16, 4096, 128, "dense"), (1, 16, 16384, 128, "dense")],
}


def kernel_us(step, reps=10, before=None) -> dict:
    """Device time of each kernel one call launches (profiler), in microseconds, by kernel name. `before`: run
    ahead of every call (`do_bench`'s L2 flush), its kernels left out of the result."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if before is not None:
                before()
            step()
        torch.cuda.synchronize()
    own = {e.key: e.self_device_time_total / reps for e in prof.key_averages() if e.self_device_time_total > 0}
    if before is not None:
        for name in kernel_us(before, reps):
            own.pop(name, None)
    return own


def host_us(step, reps=30, warmup=0, burst=8) -> float:
    """Host time per call: the fastest of `reps // burst` bursts of `burst` calls, the GPU drained before each,
    so that the launch queue never fills (a full queue makes the host wait for the GPU, and a long burst of a
    GPU-heavy step would time the GPU instead)."""
    for _ in range(warmup):
        step()
    best = float("inf")
    for _ in range(max(1, reps // burst)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(burst):
            step()
        best = min(best, (time.perf_counter() - t0) / burst)
    torch.cuda.synchronize()
    return best * 1e6


def sustained_us(step, calls=200, idle_s=1.0) -> dict:
    """Each of `calls` back-to-back calls timed by its own pair of events (no flush), after `idle_s` seconds with
    the GPU idle: the median of the first 10 calls and of the last 100, in microseconds. A kernel that runs slower
    once the load lasts (a clock that drops with the power drawn) shows as last > first; `kernel_us` times bursts
    of 10 calls, `do_bench` about a hundred (tuning log, step 140)."""
    torch.cuda.synchronize()
    time.sleep(idle_s)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) * 1e3 for start, end in events]
    first, last = sorted(times[:10]), sorted(times[-100:])
    return {"first10_us": first[len(first) // 2], "last100_us": last[len(last) // 2]}


def measure(step, grad_of=None):
    """`do_bench`'s median, the kernels' device time and the host time of `step`; with `grad_of`, those inputs'
    gradients are dropped before every call, as `do_bench` drops them (kept, each backward would add into them:
    an elementwise add per input that the benchmark does not time)."""
    from triton.testing import do_bench

    def fresh():
        for t in grad_of or ():
            t.grad = None
        return step()

    kernels = kernel_us(fresh)
    # the same with the L2 cache flushed before every call, as `do_bench` flushes it (a 256 MB fill)
    flush = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda").zero_
    flushed = kernel_us(fresh, before=flush)
    return {"bench_ms": do_bench(step, warmup=25, rep=100, grad_to_none=grad_of, return_mode="median"),
            "kernel_us": sum(kernels.values()), "kernels_us": kernels, "flushed_kernel_us": sum(flushed.values()),
            "flushed_kernels_us": flushed, "host_us": host_us(fresh), "sustained": sustained_us(fresh)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="rows.json")
    parser.add_argument("--rows", choices=sorted(ROWS), default="host")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    comp = Competitors()  # FlexAttention compiled as the benchmark compiles it (its recompile limits raised: with
    # dynamo's default of 8, the rows after a few masks ran FlexAttention's unfused eager fallback)
    results = []
    for B, H, N, D, name, *kv_heads in ROWS[args.rows]:
        Hkv = kv_heads[0] if kv_heads else H
        mask, causal = build_mask(name, N, "cuda")
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, H, N, D, device="cuda", dtype=dtype, generator=gen).requires_grad_()
        k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype, generator=gen).requires_grad_()
                for _ in range(2))
        do = torch.randn_like(q)
        impls = {"ours": lambda: comp.ours(q, k, v, mask, causal), "flex": lambda: comp.flex_attention(q, k, v, mask, causal)}
        for impl, fn in impls.items():
            with torch.no_grad():
                r = measure(fn)
            results.append({"row": [B, H, Hkv, N, D, name], "dtype": args.dtype, "impl": impl, "mode": "fwd", **r})
            r = measure(lambda: fn().backward(do), grad_of=[q, k, v])
            results.append({"row": [B, H, Hkv, N, D, name], "dtype": args.dtype, "impl": impl, "mode": "fwd+bwd", **r})
            print(results[-2], results[-1], flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"{'row':36} {'impl':5} {'mode':8} {'bench ms':>9} {'kernel ms':>9} {'flushed':>9} {'host ms':>8} "
          f"{'first 10':>9} {'last 100':>9}")
    for r in results:
        print(f"{str(r['row']):36} {r['impl']:5} {r['mode']:8} {r['bench_ms']:9.3f} {r['kernel_us'] / 1e3:9.3f} "
              f"{r['flushed_kernel_us'] / 1e3:9.3f} {r['host_us'] / 1e3:8.3f} {r['sustained']['first10_us'] / 1e3:9.3f} "
              f"{r['sustained']['last100_us'] / 1e3:9.3f}")
    for r in results:
        if r["impl"] == "ours":
            print(r["row"], r["mode"], {name[:40]: round(us, 1) for name, us in r["kernels_us"].items()})


if __name__ == "__main__":
    main()

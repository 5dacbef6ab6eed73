"""Where the time of a benchmark row goes: GPU kernel time against wall time per call.

For each row and competitor (causal where the benchmark's row is) it reports the `do_bench` median (what
bench_attention.py reports), the summed GPU kernel time of one call from the profiler (in all and per kernel;
also with the L2 cache flushed before each call, as `do_bench` flushes it), and the host time per call, so a
row that is bound by Python and launch overhead rather than by its kernels shows as wall >> kernel time. A
`do_bench` time above the flushed kernel time is either idle time between launches (a fixed amount per call) or
kernels running slower under `do_bench`'s longer load (growing with the kernel: tuning log, step 140), which
the `sustained` times show: the first 10 of 200 back-to-back calls after a second idle against the last 100.

`--load` measures that instead (tuning log, step 141): each call alone (the GPU drained and idle 20 ms before
it), then calls back to back for about 1.5 s, without and with `do_bench`'s L2 flush before each, in ten windows
of calls with the SM clock, the power and the power-cap flag that NVML reported during each (sampled every 2 ms
by a thread, through the driver's libnvidia-ml).

    python benchmarks/profile_rows.py --out rows.json [--rows d128]
    python benchmarks/profile_rows.py --out load.json --rows density --load
    SPARSE_FLASH_HOPPER_ONE_PASS=1 python benchmarks/profile_rows.py --out one_pass.json --rows density --load --impls ours
    python benchmarks/profile_rows.py --out rows.json --rows slowest   # the lowest rows vs flex, per kernel
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench_attention import Clocks, Competitors, build_mask  # the benchmark's masks, competitors, clock reader

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


def back_to_back(step, clocks: Clocks, seconds=1.5, before=None, windows=10, idle_s=1.0) -> dict:
    """Calls of `step` back to back for about `seconds` after `idle_s` idle (`before` ahead of each, untimed:
    `do_bench`'s flush), each timed by its own events, in `windows` windows of consecutive calls: each window's
    median time (us) and NVML's readings while it ran on the GPU. A call's GPU start is placed on the host's
    clock from the first call's (launched onto an idle GPU, so it starts within microseconds of the host's
    record) plus the events' elapsed times, so it assumes the host stays ahead of the GPU (true of every row
    whose host time per call is below its GPU time)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    calls = max(4 * windows, round(seconds / max(start.elapsed_time(end) / 1e3, 1e-6)))  # from one call's GPU time
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    time.sleep(idle_s)
    t0 = time.perf_counter()
    for start, end in events:
        if before is not None:
            before()
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    first = events[0][0]
    spans = [(t0 + first.elapsed_time(s) / 1e3, t0 + first.elapsed_time(e) / 1e3, s.elapsed_time(e) * 1e3)
             for s, e in events]
    out, size = [], calls // windows
    for w in range(windows):
        part = spans[w * size:(w + 1) * size]
        times = sorted(us for _, _, us in part)
        out.append({"calls": [w * size, (w + 1) * size], "median_us": times[len(times) // 2],
                    **clocks.during(part[0][0], part[-1][1])})
    return {"calls": calls, "windows": out}


def load(step, grad_of=None, device=0) -> dict:
    """`--load`'s measures of `step` (module docstring): each call alone, then back to back without and with
    the flush; `grad_of`'s gradients dropped before every call."""
    def fresh():
        for t in grad_of or ():
            t.grad = None
        return step()

    flush = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda").zero_
    alone = []
    for _ in range(20):
        torch.cuda.synchronize()
        time.sleep(0.02)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fresh()
        end.record()
        end.synchronize()
        alone.append(start.elapsed_time(end) * 1e3)
    with Clocks(device) as clocks:
        plain = back_to_back(fresh, clocks)
        flushed = back_to_back(fresh, clocks, before=flush)
    return {"alone_us": sorted(alone)[len(alone) // 2], "back_to_back": plain, "flushed": flushed,
            "nvml": clocks.error or "ok"}


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
    parser.add_argument("--load", action="store_true",
                        help="each call alone against calls back to back, with NVML's clock and power (docstring)")
    parser.add_argument("--impls", default="ours,flex",
                        help="competitors to time, comma-separated (a rerun under another kernel switch: ours)")
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
        for impl in args.impls.split(","):
            fn = impls[impl]
            with torch.no_grad():
                r = load(fn) if args.load else measure(fn)
            results.append({"row": [B, H, Hkv, N, D, name], "dtype": args.dtype, "impl": impl, "mode": "fwd", **r})
            step = lambda: fn().backward(do)  # noqa: E731
            r = load(step, grad_of=[q, k, v]) if args.load else measure(step, grad_of=[q, k, v])
            results.append({"row": [B, H, Hkv, N, D, name], "dtype": args.dtype, "impl": impl, "mode": "fwd+bwd", **r})
            print(results[-2], results[-1], flush=True)
            with open(args.out, "w") as f:  # as the rows come: a run cut short keeps what it measured
                json.dump(results, f, indent=1)
    (print_load if args.load else print_rows)(results)


def print_rows(results: list) -> None:
    """The default measures' table, then our kernels' times per kernel."""
    print(f"{'row':36} {'impl':5} {'mode':8} {'bench ms':>9} {'kernel ms':>9} {'flushed':>9} {'host ms':>8} "
          f"{'first 10':>9} {'last 100':>9}")
    for r in results:
        print(f"{str(r['row']):36} {r['impl']:5} {r['mode']:8} {r['bench_ms']:9.3f} {r['kernel_us'] / 1e3:9.3f} "
              f"{r['flushed_kernel_us'] / 1e3:9.3f} {r['host_us'] / 1e3:8.3f} {r['sustained']['first10_us'] / 1e3:9.3f} "
              f"{r['sustained']['last100_us'] / 1e3:9.3f}")
    for r in results:
        if r["impl"] == "ours":
            print(r["row"], r["mode"], {name[:40]: round(us, 1) for name, us in r["kernels_us"].items()})


def print_load(results: list) -> None:
    """`--load`'s table: each call alone, then the first and last windows back to back (ms, mean SM MHz, share
    of samples power-capped), without and with the flush."""
    def cell(w):
        mhz = "-" if w["sm_mhz"] is None else w["sm_mhz"]
        capped = "-" if w["capped"] is None else f"{w['capped']:.2f}"
        return f"{w['median_us'] / 1e3:7.3f} {mhz:>5} {capped:>4}"

    print(f"NVML: {results[0]['nvml'] if results else '-'}")
    print(f"{'row':36} {'impl':5} {'mode':8} {'alone':>7} | {'back to back: first':>18} | {'last':>18} | "
          f"{'flushed: first':>18} | {'last':>18}")
    for r in results:
        b, f = r["back_to_back"]["windows"], r["flushed"]["windows"]
        print(f"{str(r['row']):36} {r['impl']:5} {r['mode']:8} {r['alone_us'] / 1e3:7.3f} | {cell(b[0])} | "
              f"{cell(b[-1])} | {cell(f[0])} | {cell(f[-1])}")


if __name__ == "__main__":
    main()

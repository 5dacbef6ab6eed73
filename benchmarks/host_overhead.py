"""Host time of one attention call, per layer, with and without the cached direct launch.

A small problem (B=1, H=2, N=1024) keeps the GPU idle between launches, so the loop time per call is the
host time. Prints microseconds per call for each layer (launcher, API forward, API forward+backward) in
both launch modes and for FlexAttention (compiled), then a cProfile of the API forward+backward.

    python benchmarks/host_overhead.py --out host.json
    python benchmarks/host_overhead.py --row 1,8,16384,64,longformer --out host.json

    python benchmarks/host_overhead.py --builds --out builds.json
    python benchmarks/host_overhead.py --turns --out turns.json
    python benchmarks/host_overhead.py --costs --out costs.json

`--row B,H,N,D,MASK` (a mask of `bench_attention.build_mask`) times that problem instead. `--builds` times the
benchmark's mask builds at 65,536 tokens instead (`bench_attention.mask_costs`' constructors): per constructor
the host time from the call until the device is idle (median of 30), the host time inside each phase of the
build (layout, sizes, lists, plans; nested phases count in their callers too) and the CUDA launches of one
build (the profiler's kernel and memcpy records). Where the Hopper
(Gluon) kernels serve a pass, the pieces of their calls are timed one by one (descriptors, Triton's
descriptor encoding, the bound launches, chunk sums and merges); where the Triton forward serves it, its
launcher's pieces. Every piece that fails prints its error and the rest still run. `--turns` times each
build alone, then in turns with `create_block_mask` of the same pattern (as the benchmark's build rows take
them), with and without Python's garbage collector, then alone again, with the collector's passes and their
time during our builds (tuning log, step 114: fixed and Longformer slow in turns on one machine only).
`--costs` runs the benchmark's build rows in this process, then profiles builds in turns, then times fixed and
Longformer with pageable uploads and with device-side plan sizes beside the code as it is (step 115).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import inspect
import io
import json
import pstats

import torch

import sparse_flash
from profile_rows import host_us
from sparse_flash.kernels import settings
from sparse_flash.kernels.dispatch import attn_bwd, attn_fwd
from sparse_flash.kernels.launch import plan_key


def launcher_parts(q, k, v, index, geometry, causal: bool = False) -> dict:
    """Host microseconds of the pieces of one forward launch (the Triton forward, which serves this D=64
    problem): the plan's key, allocation, descriptors, Triton's launcher (argument packing and
    cuLaunchKernel) called directly, and the whole launcher."""
    from sparse_flash.kernels import launch as launch_module
    from sparse_flash.kernels.triton.fwd import FwdPlan
    from sparse_flash.kernels.triton.tma import make_descriptor, tile_descriptor

    plans = {}
    attn_fwd(q, k, v, index, geometry, causal, 0.125, plans)
    (plan,) = plans.values()
    if not isinstance(plan, FwdPlan):
        raise TypeError(f"the pieces are the Triton forward's, but {type(plan).__module__} serves this problem")
    bound, compiled = plan.kernel, plan.kernel._compiled
    out, lse = plan(q, k, v)
    part, _, lse_part = plan.split.scratch()
    k_in, v_in = (make_descriptor(k, plan.k_layout), make_descriptor(v, plan.v_layout)) if plan.tma else (k, v)
    head = (q, k_in, v_in, out, lse, part, lse_part, plan.split.counters())
    stream = launch_module._raw_stream(launch_module._current_device())
    args = (*head, *bound.tail, *bound.constexprs.values())
    parts = {
        "plan key": lambda: launch_module.plan_key((q, k, v), "fwd", causal, 0.125),
        "torch.empty (out)": lambda: torch.empty(q.shape, dtype=q.dtype, device=q.device),
        "make_descriptor (one)": lambda: make_descriptor(k, plan.k_layout),
        "tile_descriptor (one, with checks)": lambda: tile_descriptor(k, 64, 64),
        "triton launcher + cuLaunchKernel": lambda: compiled.run(bound.grid, 1, 1, stream, compiled.function,
                                                                 compiled.packed_metadata, None, None, None, *args),
        "BoundLaunch (direct path)": lambda: bound(*head),
        "attn_fwd (whole launcher)": lambda: attn_fwd(q, k, v, index, geometry, causal, 0.125, plans),
        "attn_fwd (no plan cache)": lambda: attn_fwd(q, k, v, index, geometry, causal, 0.125),
    }
    return {f"part: {name} ({len(args)} args)": host_us(f, reps=300, warmup=20) for name, f in parts.items()}


def _timed(parts: dict) -> dict:
    """Host microseconds of each piece; a piece that raises records its error instead."""
    results = {}
    for name, f in parts.items():
        try:
            results[name] = host_us(f, reps=300, warmup=20)
        except Exception as e:  # noqa: BLE001 - a probe: one broken piece must not hide the others
            results[name] = f"failed: {type(e).__name__}: {e}"[:300]
        print(f"{name:60} {results[name]}", flush=True)
    return results


def hopper_parts(q, k, v, do, index, geometry, causal: bool) -> dict:
    """Host microseconds of the pieces of the Hopper passes' calls (those that serve this problem)."""
    from sparse_flash.kernels import dispatch
    from sparse_flash.kernels.gluon import pipeline

    gluon = dispatch.gluon_modules()
    plans = {}
    out, lse = attn_fwd(q, k, v, index, geometry, causal, 0.125, plans)
    attn_bwd(do, q, k, v, out, lse, index, geometry, causal, 0.125, plans)
    fwd = next((p for p in plans.values() if isinstance(p, gluon.fwd.FwdPlan)), None)
    bwd = next((p for p in plans.values() if isinstance(p, dispatch._BackwardPlan)), None)
    parts = {}
    if fwd is not None:
        layout = fwd.layout
        parts["hopper fwd: row_descriptor (one)"] = lambda: pipeline.row_descriptor(k, 128, layout)
        parts["hopper fwd: whole plan call"] = lambda: fwd(q, k, v)
        if fwd.merge is not None and fwd.merge.launch is not None:  # the forward cuts long lists: their merge
            f_out, f_lse = fwd(q, k, v)
            f_part, _, f_lse_part = fwd.split.scratch()
            parts["hopper fwd: row merge (bound launch)"] = lambda: fwd.merge(f_out, f_lse, f_part, f_lse_part)
        try:  # Triton's encoding of one descriptor (its launcher does this for every descriptor of a launch)
            from triton.backends.nvidia import driver as nv_driver

            meta = fwd.launch._compiled.metadata.tensordesc_meta[0]
            desc = pipeline.row_descriptor(k, 128, layout)
            n_args = len(inspect.signature(nv_driver.make_tensordesc_arg).parameters)  # 2 or 3 by Triton version
            extra = (None,) * (n_args - 2)
            parts["hopper fwd: Triton's descriptor encoding (one)"] = lambda: nv_driver.make_tensordesc_arg(desc, meta, *extra)
        except Exception as e:  # noqa: BLE001
            print("descriptor encoding not timed:", type(e).__name__, e)
    if bwd is not None:
        delta = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        parts[f"bwd families {tuple(bwd.families)}: whole plan call"] = lambda: bwd(do, q, k, v, out, lse)
        lse2 = torch.empty_like(delta) if getattr(bwd, "lse2", False) else None  # between two Gluon passes
        extra = () if lse2 is None else (lse2,)
        parts["bwd: dq pass"] = lambda: bwd.dq(q, k, v, out, do, lse, delta, *extra)
        parts["bwd: dkdv pass"] = lambda: bwd.dkdv(q, k, v, do, lse if lse2 is None else lse2, delta)
        if hasattr(bwd.dq, "chunk_sum"):
            dq = torch.empty_like(q)
            part = bwd.dq.chunk_sum.scratch(q.device)
            parts["bwd: dq chunk sum"] = lambda: bwd.dq.chunk_sum(dq, part)
            parts["bwd: dq chunk scratch"] = lambda: bwd.dq.chunk_sum.scratch(q.device)
    parts["plan key (bwd, 6 tensors)"] = lambda: plan_key((do, q, k, v, out, lse), "bwd", causal, 0.125)
    parts["settings.current()"] = settings.current
    return _timed(parts)


BUILD_PHASES = {  # module: functions timed per build (`--builds`), as the constructors reach them
    "sparse_flash.mask": ("layout_from_runs", "run_sizes", "build_index"),
    "sparse_flash.mask_index": ("_layout_sides_on_gpu", "_plans_on_gpu", "_unsplit_plans_on_gpu", "_split_plans_on_gpu",
                                "_host_split", "_plan_sizes_on_gpu", "upload"),
    "sparse_flash.masks._common": ("pattern_runs", "pattern_sizes", "make", "make_from_runs"),
    "sparse_flash.masks.butterfly": ("_host_butterfly", ),
    "sparse_flash.index_gpu": ("runs_layout", "layout_lists"),
}


def build_phases(n: int = 65536, repeats: int = 30) -> dict:
    """Per mask constructor of `bench_attention.mask_costs`: the median host time of a build until the device
    is idle, the mean host time of each phase (`BUILD_PHASES`, wrapped where the constructors look them up) and
    the device's kernel and copy records of one build."""
    import importlib
    import statistics
    import sys
    import time
    from unittest import mock

    from bench_attention import mask_builders, seconds_to_idle

    spent = {}

    def timed(name, f):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
        return wrapper

    patches = []
    for module_name, names in BUILD_PHASES.items():
        importlib.import_module(module_name)
        # every module that imported the function by name: `mask` and the pattern modules look them up there
        holders = [m for m in list(sys.modules.values()) if m is not None and
                   getattr(m, "__name__", "").startswith("sparse_flash")]
        for name in names:
            f = getattr(sys.modules[module_name], name, None)
            if f is None:
                continue
            patches += [mock.patch.object(m, name, timed(name, f)) for m in holders if getattr(m, name, None) is f]
    out = {}
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        for name, build in mask_builders().items():
            for _ in range(5):
                build(n)
            torch.cuda.synchronize()
            spent.clear()
            times = [seconds_to_idle(lambda: build(n)) for _ in range(repeats)]
            phases = {k: round(v / repeats * 1e6, 1) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                build(n)
                torch.cuda.synchronize()
            device = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            out[name] = {"ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times), "phases_us": phases,
                         "device_records": len(device)}
            print(f"{name:10} {out[name]['ms']:.3f} ms (min {out[name]['min_ms']:.3f}), {len(device)} device records; "
                  + ", ".join(f"{k} {v:.0f} us" for k, v in phases.items()), flush=True)
    out["host_only"] = host_only_builds(n, repeats)
    return out


def host_only_builds(n: int = 65536, repeats: int = 30) -> dict:
    """The same builds with every tensor on the host and the Triton launches stubbed (the GPU builders' host
    code, as the development CPU times it: tuning log, step 137), then the median microseconds of a few single
    operators on the host and on the GPU, and each build's host profile (the 25 functions with the most own
    time). Compared with `build_phases`' times on the same machine, it splits a build's time into host code
    and what the CUDA tensors and launches add."""
    import statistics
    import time
    from unittest import mock

    from bench_attention import mask_builders
    from sparse_flash import index_gpu, mask_index
    from sparse_flash.kernels import schedule
    from sparse_flash.kernels.launch import _arg_key

    def median_us(f, reps=200):
        for _ in range(10):
            f()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            f()
            times.append(time.perf_counter() - start)
        return 1e6 * statistics.median(times)

    a, g = torch.arange(512), torch.arange(512, device="cuda")
    out = {"ops_us": {
        "host add (512)": median_us(lambda: a + 1),
        "host empty (512)": median_us(lambda: torch.empty(512, dtype=torch.int64)),
        "host as_strided": median_us(lambda: a.as_strided((256,), (1,), 8)),
        "cuda add (512)": median_us(lambda: g + 1),
        "cuda empty (512)": median_us(lambda: torch.empty(512, dtype=torch.int64, device="cuda")),
        "cuda zeros (512)": median_us(lambda: torch.zeros(512, dtype=torch.int64, device="cuda")),
        "cuda as_strided": median_us(lambda: g.as_strided((256,), (1,), 8)),
        "python loop (1000 adds)": median_us(lambda: sum(range(1000)))}}
    torch.cuda.synchronize()
    def stub(*args, **kwargs):  # a launch that does nothing
        return None

    def keyed(kernel, grid, args, constexprs, *rest, **kwargs):  # the direct launch's key and pointer reads only
        key = (id(kernel), *constexprs.values(), *[a if a.__class__ is int else _arg_key(a) for a in args])
        pointers = [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]
        return key, pointers

    builders = {name: f for name, f in mask_builders(device="cpu").items() if name in ("butterfly", "local")}
    for launcher in (keyed, ):
        with mock.patch.object(mask_index, "_on_gpu", lambda t: True), \
                mock.patch.object(index_gpu, "launch", launcher), mock.patch.object(schedule, "launch", launcher):
            for name, build in builders.items():
                out[f"{name} keyed"] = median_us(lambda: build(n), repeats)
    with mock.patch.object(mask_index, "_on_gpu", lambda t: True), mock.patch.object(index_gpu, "launch", stub), \
            mock.patch.object(schedule, "launch", stub):
        for name, build in builders.items():
            out[name] = {"us": median_us(lambda: build(n), repeats)}
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(repeats):
                build(n)
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
            out[name]["profile"] = text.getvalue()
            print(f"{name:10} host only {out[name]['us']:.0f} us (with the launches' keys {out[name + ' keyed']:.0f})",
                  flush=True)
    print(", ".join(f"{k} {v:.1f} us" for k, v in out["ops_us"].items()), flush=True)
    return out


def build_turns(path: str, n: int = 65536, repeats: int = 15,
                order=("fixed", "longformer", "butterfly", "bigbird", "fixed")) -> list:
    """Per constructor of `order` (fixed first and last): the median host time of our build alone, in turns
    with `create_block_mask` (with the garbage collector on, then off), and alone again; `create_block_mask`'s
    own median; the collector's passes and milliseconds inside our builds in turns; a 16 KB host table's upload
(`mask_index.upload`) alone and right after `create_block_mask`, in microseconds. The rows so far are
    written to `path` (json) after each constructor."""
    import gc
    import statistics
    import time

    from torch.nn.attention.flex_attention import create_block_mask

    from bench_attention import _mask_mods, mask_builders
    from bench_attention import seconds_to_idle as timed
    from sparse_flash.mask_index import upload

    builders = mask_builders()
    collected = {"passes": 0, "s": 0.0, "start": None}

    def watch(phase, info):
        if phase == "start":
            collected["start"] = time.perf_counter()
        elif collected["start"] is not None:
            collected["passes"] += 1
            collected["s"] += time.perf_counter() - collected["start"]

    def median_ms(times) -> float:
        return round(1e3 * statistics.median(times), 3)

    out = []
    for name in order:
        build = builders[name]
        mod = _mask_mods(build(n))[name]

        def flex():
            return create_block_mask(mod, None, None, n, n, device="cuda", _compile=True)
        flex()
        row = {"mask": name, "alone_ms": median_ms([timed(lambda: build(n)) for _ in range(repeats)])}
        for collector in ("gc_on", "gc_off"):
            ours, theirs = [], []
            collected.update(passes=0, s=0.0)
            if collector == "gc_off":
                gc.disable()
            try:
                for _ in range(repeats):
                    gc.callbacks.append(watch)
                    try:
                        ours.append(timed(lambda: build(n)))
                    finally:
                        gc.callbacks.remove(watch)
                    theirs.append(timed(flex))
            finally:
                gc.enable()
            row[f"turns_{collector}_ms"] = median_ms(ours)
            row[f"flex_{collector}_ms"] = median_ms(theirs)
            row[f"gc_passes_{collector}"] = collected["passes"]
            row[f"gc_ms_{collector}"] = round(1e3 * collected["s"], 2)
        row["alone_again_ms"] = median_ms([timed(lambda: build(n)) for _ in range(repeats)])
        table = torch.zeros(4096, dtype=torch.int32)  # a build's host table: its upload alone and in turns
        row["upload_us_alone"] = round(1e3 * median_ms([timed(lambda: upload(table, "cuda")) for _ in range(repeats)]), 1)
        uploads = []
        for _ in range(repeats):
            timed(flex)
            uploads.append(timed(lambda: upload(table, "cuda")))
        row["upload_us_turns"] = round(1e3 * median_ms(uploads), 1)
        out.append(row)
        print(json.dumps(row), flush=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    return out


def build_costs_profile(path: str, n: int = 65536, profiled: int = 3) -> dict:
    """The benchmark's build rows as it takes them (`bench_attention.mask_costs` at `n` tokens, in this process),
    then per constructor `profiled` rounds in turns with `create_block_mask`: a build's host milliseconds, one
    with the launches that missed the cached direct call counted (Triton's own launch path, or a compile), and
    one under the profiler (the device's kernel and copy microseconds, the ten host operators and CUDA runtime
    calls with the most self time). Tuning log step 115: fixed and Longformer built in 29 and 8 ms in the benchmark's
    turns, on a machine where `--turns` built them in 2-4 ms. Written to `path` (json) after each step."""
    import time
    from unittest import mock

    from torch.nn.attention.flex_attention import create_block_mask

    from bench_attention import _mask_mods, mask_builders, mask_costs, seconds_to_idle

    def host_state() -> dict:  # the load, this process's threads and the busiest processes of the machine
        import os
        import subprocess
        threads = next(line.split()[1] for line in open("/proc/self/status") if line.startswith("Threads"))
        busiest = subprocess.run(["ps", "-eo", "pcpu,nlwp,comm", "--sort=-pcpu"], capture_output=True,
                                 text=True).stdout.splitlines()[:6]
        return {"load": os.getloadavg(), "threads": int(threads), "torch_threads": torch.get_num_threads(),
                "busiest": busiest}

    out = {"host_before": host_state()}
    out["mask_costs"] = mask_costs(sizes=(n,))
    out["host_after"], out["profiles"] = host_state(), {}
    print(json.dumps(out["host_before"]), json.dumps(out["host_after"]), sep="\n", flush=True)
    for row in out["mask_costs"]:
        print(f"{row['impl']:24} {row['mask']:10} {row['ms']:.3f} ms (min {row['min_ms']:.3f})", flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    from sparse_flash.kernels import launch as launch_module

    slow = {"calls": 0, "s": 0.0}  # launches past the cached direct call: Triton's own launch path (or a compile)
    normal_path = launch_module._compile_and_launch

    def counted(*args, **kwargs):
        start = time.perf_counter()
        try:
            return normal_path(*args, **kwargs)
        finally:
            slow["calls"] += 1
            slow["s"] += time.perf_counter() - start

    for name, build in mask_builders().items():
        mod = _mask_mods(build(n))[name]
        runs = []
        for _ in range(profiled):
            seconds_to_idle(lambda: create_block_mask(mod, None, None, n, n, device="cuda", _compile=True))
            slow.update(calls=0, s=0.0)
            ms = 1e3 * seconds_to_idle(lambda: build(n))  # unprofiled, the normal path counted
            with mock.patch.object(launch_module, "_compile_and_launch", counted):
                counted_ms = 1e3 * seconds_to_idle(lambda: build(n))
            seconds_to_idle(lambda: create_block_mask(mod, None, None, n, n, device="cuda", _compile=True))
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                profiled_ms = 1e3 * seconds_to_idle(lambda: build(n))
            events = prof.key_averages()
            device_us = sum(e.self_device_time_total for e in events)
            top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]
            runs.append({"ms": round(ms, 3), "ms_counting_launches": round(counted_ms, 3),
                         "normal_path_launches": slow["calls"], "normal_path_ms": round(1e3 * slow["s"], 3),
                         "profiled_ms": round(profiled_ms, 3), "device_us": round(device_us, 1),
                         "top_self_cpu_us": [(e.key, round(e.self_cpu_time_total, 1), e.count) for e in top]})
            print(f"{name:10} {ms:.3f} ms ({slow['calls']} launches by Triton's path, {1e3 * slow['s']:.3f} ms), "
                  f"profiled {profiled_ms:.3f} ms, device {device_us:.0f} us; "
                  + ", ".join(f"{k} {t:.0f} us x{c}" for k, t, c in runs[-1]["top_self_cpu_us"][:5]), flush=True)
        out["profiles"][name] = runs
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    def save():
        with open(path, "w") as f:
            json.dump(out, f, indent=1)

    out["variants"] = {}
    build_variants(n, out["variants"], save)
    return out


def build_variants(n: int = 65536, out: dict | None = None, save=lambda: None,
                   names=("fixed", "longformer")) -> dict:
    """`mask_costs` of the constructors `names` (their lists cut into chunks: `mask_index._host_split` plans
    them) as they are, with the host tables uploaded from pageable memory instead of pinned, with the chunks
    and plan sizes from the device instead of the host (`_plan_sizes_on_gpu`, one device wait, as BigBird),
    with the host's plan sizes but the chunks counted on the device (no upload, no wait), and with the warm-up
    mask's `kernel_index` read as the mask's own tensors (no read-only views): which part of the host-planned
    path or of the benchmark's sequence, if any, the slow turns follow (these runs build fixed and Longformer
    only; the full `mask_costs` before them builds four other constructors first). Each variant's rows go into
    `out` as they come, then `save()` runs."""
    import sys
    from unittest import mock

    import bench_attention
    from sparse_flash import mask as mask_module
    from sparse_flash import mask_index

    def pageable(t, device):
        return t.to(device)

    def device_split(inputs, sizes, device):
        on_gpu = mask_index._plan_sizes_on_gpu(inputs)
        if on_gpu is None:  # no Triton builders on this device: the torch operators
            batch = mask_index._plan_batch(inputs)
            return batch.n, None, batch.base, mask_index._plan_sizes(batch).tolist()
        n, base, plan_sizes = on_gpu
        return n, None, base, plan_sizes.tolist()

    host_split = mask_index._host_split

    def device_chunks(inputs, sizes, device):  # the host's plan sizes, the chunks counted on the device: no upload
        _, _, base, plan_sizes = host_split(inputs, sizes, torch.device("cpu"))
        on_gpu = mask_index._plan_sizes_on_gpu(inputs)
        if on_gpu is None:
            return mask_index._plan_batch(inputs).n, None, base, plan_sizes
        return on_gpu[0], None, base, plan_sizes

    def everywhere(name, f):  # every module of the package that holds the function by name
        original = getattr(mask_index, name)
        return [mock.patch.object(m, name, f) for m in list(sys.modules.values())
                if getattr(m, "__name__", "").startswith("sparse_flash") and getattr(m, name, None) is original]

    everyone = bench_attention.mask_builders()
    variants = {"as is": [], "pageable uploads": everywhere("upload", pageable),
                "device plan sizes": everywhere("_host_split", device_split),
                "host sizes, device chunks": everywhere("_host_split", device_chunks),
                "no read-only views": [mock.patch.object(mask_module, "_read_only", lambda record: record)],
                "as is again": []}
    out = {} if out is None else out
    for variant, patches in variants.items():
        with contextlib.ExitStack() as stack:
            for patch in patches + [mock.patch.object(bench_attention, "mask_builders",
                                                      lambda: {k: everyone[k] for k in names})]:
                stack.enter_context(patch)
            rows = bench_attention.mask_costs(sizes=(n,))
        out[variant] = {r["mask"]: {"ours_ms": round(r["ms"], 3), "ours_min_ms": round(r["min_ms"], 3)}
                        for r in rows if r["impl"] == "sparse_flash"}
        for r in rows:
            if r["impl"] != "sparse_flash" and "ms" in r:
                out[variant][r["mask"]]["flex_ms"] = round(r["ms"], 3)
        print(variant, json.dumps(out[variant]), flush=True)
        save()
    return out


def parse_row(text: str):
    B, H, N, D, name = text.split(",")
    return int(B), int(H), int(N), int(D), name


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="host.json")
    parser.add_argument("--row", type=parse_row, default=None, metavar="B,H,N,D,MASK",
                        help="the problem (default: 1,2,1024,64 butterfly, non-causal)")
    parser.add_argument("--builds", action="store_true", help="time the benchmark's mask builds by phase instead")
    parser.add_argument("--turns", action="store_true",
                        help="time the builds alone and in turns with create_block_mask instead")
    parser.add_argument("--costs", action="store_true",
                        help="the benchmark's build rows, then builds in turns under the profiler, instead")
    args = parser.parse_args()
    if args.costs:
        build_costs_profile(args.out)
        return
    if args.builds:
        with open(args.out, "w") as f:
            json.dump(build_phases(), f, indent=1)
        return
    if args.turns:
        build_turns(args.out)
        return
    from torch.nn.attention.flex_attention import flex_attention

    from bench_attention import build_mask

    B, H, N, D, name = args.row or (1, 2, 1024, 64, "butterfly")
    mask, causal = build_mask(name, N, "cuda")
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    do = torch.randn_like(q)
    index, geometry = mask._records(causal)  # the lists themselves, as the kernels get them
    plans = {}
    out, lse = attn_fwd(q.detach(), k.detach(), v.detach(), index, geometry, causal, 0.125)
    x = torch.empty(10, device="cuda")

    def api():
        return sparse_flash.block_sparse_attention(q, k, v, mask, causal=causal, backend="triton")

    def api_no_grad():
        with torch.no_grad():
            return api()

    flex = torch.compile(flex_attention, dynamic=False)
    fm = mask.to_flex(causal, eager_exact=False)
    steps = {
        "tiny torch kernel": lambda: x.add_(1),
        "launcher fwd": lambda: attn_fwd(q, k, v, index, geometry, causal, 0.125, plans),
        "launcher bwd": lambda: attn_bwd(do, q, k, v, out, lse, index, geometry, causal, 0.125, plans),
        "api fwd no_grad": api_no_grad,
        "api fwd+bwd": lambda: api().backward(do),
        "autograd only": lambda: (q * 1).backward(do),
    }
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    try:
        results = launcher_parts(qd, kd, vd, index, geometry, causal)
    except TypeError as e:  # the Hopper forward serves this problem
        print(e)
        results = {}
    results.update(hopper_parts(qd, kd, vd, do, index, geometry, causal))
    for fast in (False, True):
        with settings.override(fast_launch=fast):
            for name, step in steps.items():
                results[f"{name} (fast launch {'on' if fast else 'off'})"] = host_us(step, reps=300, warmup=20)
    with settings.override(fast_launch=True, tma=False):  # pointer loads: no descriptors to build on the host
        for name in ("launcher fwd", "launcher bwd", "api fwd no_grad", "api fwd+bwd"):
            results[f"{name} (fast launch on, pointer loads)"] = host_us(steps[name], reps=300, warmup=20)
    results["flex fwd no_grad"] = host_us(lambda: flex(q.detach(), k.detach(), v.detach(), block_mask=fm), 300, 20)
    results["flex fwd+bwd"] = host_us(lambda: flex(q, k, v, block_mask=fm).backward(do), 300, 20)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(100):
        api().backward(do)
    pr.disable()
    torch.cuda.synchronize()
    sio = io.StringIO()
    pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(30)
    pstats.Stats(pr, stream=sio).sort_stats("cumulative").print_stats(40)
    with open(args.out, "w") as f:
        json.dump({"us_per_call": results, "cprofile": sio.getvalue()}, f, indent=1)
    print(sio.getvalue())
    for name, us in results.items():
        print(f"{name:60} {us:8.1f} us" if isinstance(us, float) else f"{name:60} {us}")


if __name__ == "__main__":
    main()

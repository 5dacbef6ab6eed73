"""Side-by-side attention benchmark on one CUDA GPU: sparse_flash against FlexAttention and SDPA.

Every competitor runs in the same process on the same inputs and masks, timed the same way
(`triton.testing.do_bench`, median after warm-up). sparse_flash and FlexAttention are each timed twice per
row (three times on rows of up to 4,096 tokens), in alternating orders, and the faster median counts, so
neither pays for running first after a new mask (compilation, an idle GPU) or for a burst of host load.
torch.compile's compile workers start before the first row and stay up (none start beside a timed call);
each row's calls are compiled before any is timed, and the row waits (up to 10 s) until other processes
hold less than one core; each timing round records the cores they held meanwhile (`runs_other_cores`) and the
GPU's mean SM clock and share of power-capped samples (`runs_sm_mhz`, `runs_capped`; NVML, every 5 ms).
Effective TFLOP/s count only the nonzero blocks: forward 4·B·H·N²·D·density, forward+backward 3.5x that
(backward = 2.5x forward). Rows of up to 4,096 tokens, where one call's host time can exceed its GPU time,
are also timed as CUDA-graph replays (`do_bench_cudagraph`) for sparse_flash and FlexAttention, which
separates the kernels from the host. The run first waits (up to 90 s) for the host's 1-minute load to fall
below 1.5, and records it.

    python benchmarks/bench_attention.py                 # the full table (about 10 minutes on an H200)
    python benchmarks/bench_attention.py --quick         # two shapes, fewer masks
    python benchmarks/bench_attention.py --out DIR       # where json, markdown and plots go
    python benchmarks/bench_attention.py --out DIR --resume  # continue a run that a time limit cut short
    python benchmarks/bench_attention.py --shape 4,16,16,4096,64 --mask random --no-mask-costs  # some rows only

Writes `bench.json`, `bench.jsonl`, `bench.md`, `tflops_vs_density.png` and `time_vs_length.png` under --out,
by default `benchmarks/results/latest` (the repository keeps the latest run only: benchmarks/results/README.md).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import ctypes
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import sparse_flash
from sparse_flash import masks

BLOCK = 128
# (B, Hq, Hkv, N, D)
SHAPES = [(4, 16, 16, 4096, 64), (4, 16, 16, 4096, 128), (1, 16, 16, 16384, 128), (1, 8, 8, 65536, 64), (4, 32, 8, 4096, 128)]
QUICK_SHAPES = [(4, 16, 16, 4096, 128), (1, 16, 16, 16384, 128)]
MASKS = ["dense", "causal", "local", "butterfly", "random", "bigbird", "longformer"]
QUICK_MASKS = ["dense", "causal", "butterfly", "bigbird"]
ANY_ORDER = "sparse_flash_any_order"  # dense forward+backward with dQ added in any order (not deterministic)


def build_mask(name: str, n: int, device) -> tuple[sparse_flash.BlockMask, bool]:
    """The benchmark's masks (block 128) and whether the call is causal."""
    if name == "dense":
        return masks.dense(n, BLOCK, device=device), False
    if name == "causal":
        return masks.causal(n, BLOCK, device=device), True
    if name == "local":
        return masks.local(n, BLOCK, window=4, device=device), False
    if name == "butterfly":
        return masks.butterfly(n, BLOCK, device=device), False
    if name == "random":  # 10%, with the diagonal so that no row is empty
        return masks.random(n, BLOCK, density=0.1, seed=0, device=device) | masks.local(n, BLOCK, window=0, device=device), False
    if name == "bigbird":
        return masks.bigbird(n, BLOCK, seed=0, device=device), False
    if name == "longformer":
        return masks.longformer(n, BLOCK, device=device), False
    if name == "neighborhood_2d":  # n pixels of a square image, tile-major in 16 x 8 tiles: 2-D window 1, tile 0 global
        side = int(n**0.5)
        return masks.neighborhood_2d(side, side, (16, 8), 1, device=device) | masks.global_(n, BLOCK, device=device), False
    raise ValueError(name)


def live_density(mask: sparse_flash.BlockMask, causal: bool) -> float:
    """Fraction of blocks the kernels compute (blocks above the causal diagonal are skipped)."""
    return int(mask.row_index(causal).counts.sum()) / mask.layout.numel()


GRAPH_MAX_N = 4096  # rows this short are also timed as CUDA-graph replays (no host time between calls)


def eager_rounds(n: int) -> int:
    """How many times sparse_flash and FlexAttention are timed eagerly on a row of `n` tokens (the faster
    median counts): three on rows of up to GRAPH_MAX_N tokens, whose eager time is the host's where the host
    is slower than the GPU (step 124's run: two medians of one row 0.59 and 0.85 ms, 0.48 ms in a quiet
    process), two on longer ones."""
    return 3 if n <= GRAPH_MAX_N else 2


def bench(fn, grad_of=None, graph=False) -> float:
    """Median milliseconds of fn (forward) or of fn + backward when grad_of lists the inputs.

    graph=False: `do_bench`, one eager call after another (what a training step pays, host time included
    when the host is slower than the GPU). graph=True: `do_bench_cudagraph`, calls captured in a CUDA graph
    and replayed, so only the GPU's time counts.
    """
    from triton.testing import do_bench, do_bench_cudagraph

    def step():
        if grad_of is None:
            return fn()
        fn().backward(do)

    do = None if grad_of is None else torch.randn_like(fn())
    if graph:
        return do_bench_cudagraph(step, rep=40, grad_to_none=grad_of, return_mode="median")
    return do_bench(step, warmup=25, rep=100, grad_to_none=grad_of, return_mode="median")


def warm_up(fn, grad_of=None) -> None:
    """One call of `fn` (and its backward with `grad_of`) so that its compiles happen now; an error is left
    for the row's own timing to report."""
    try:
        if grad_of is None:
            with torch.no_grad():
                fn()
        else:
            fn().sum().backward()
            for t in grad_of:
                t.grad = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class Competitors:
    """The attention implementations, each a function of (q, k, v, mask, causal) returning out."""

    def __init__(self):
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.cache_size_limit = 256
        if hasattr(torch._dynamo.config, "recompile_limit"):
            torch._dynamo.config.recompile_limit = 256
        self.flex = torch.compile(flex_attention, dynamic=False)
        self._flex_masks: dict = {}

    @staticmethod
    def ours(q, k, v, mask, causal):
        return sparse_flash.block_sparse_attention(q, k, v, mask, causal=causal, backend="triton")

    @staticmethod
    def ours_any_order(q, k, v, mask, causal):
        """sparse_flash with `settings.deterministic` off (`SPARSE_FLASH_DETERMINISTIC=0`): its dense non-causal
        backward adds dQ in any order (the one-pass kernel); a call's backward runs under its forward's settings."""
        from sparse_flash.kernels import settings

        with settings.override(deterministic=False):
            return sparse_flash.block_sparse_attention(q, k, v, mask, causal=causal, backend="triton")

    def flex_attention(self, q, k, v, mask, causal):
        cached = self._flex_masks.get(causal)
        if cached is None or cached[0] is not mask:  # one conversion per mask, outside the timed region
            self._flex_masks[causal] = (mask, mask.to_flex(causal, eager_exact=False))
        return self.flex(q, k, v, block_mask=self._flex_masks[causal][1], enable_gqa=q.shape[1] != k.shape[1])

    @staticmethod
    def sdpa(backend):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

        def run(q, k, v, mask, causal):
            with sdpa_kernel([chosen]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])

        return run

    def sdpa_bool_mask(self, q, k, v, mask, causal):
        if getattr(self, "_dense_of", (None,))[0] is not mask:
            self._dense_of = (mask, mask.to_dense())
        allowed = self._dense_of[1]
        if causal:
            allowed = allowed & torch.ones_like(allowed[0, 0]).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=q.shape[1] != k.shape[1])


def row_tasks(mname: str, dtype: torch.dtype) -> list[tuple[str, str]]:
    """The (impl, mode) pairs one (shape, dtype, mask) group of `run_rows` times, each once: sparse_flash and
    flex forward and forward+backward; cuDNN and flash SDPA on the dense and causal masks; the dense
    forward+backward with dQ in any order and the butterfly forward with a bool mask in bf16."""
    impls = ["sparse_flash", "flex"]
    if mname in ("dense", "causal"):
        impls += ["sdpa_cudnn", "sdpa_flash"]
    if mname == "dense" and dtype == torch.bfloat16:
        impls.append(ANY_ORDER)
    if mname == "butterfly" and dtype == torch.bfloat16:
        impls.append("sdpa_bool_mask")
    return [(impl, mode) for impl in impls for mode in ("fwd", "fwd+bwd")
            if not (impl == "sdpa_bool_mask" and mode == "fwd+bwd") and not (impl == ANY_ORDER and mode == "fwd")]


def group_of(row: dict) -> tuple:
    """The (shape, dtype, mask) group of a row of `run_rows`."""
    return tuple(row[f] for f in ("B", "Hq", "Hkv", "N", "D", "dtype", "mask"))


def finished_groups(previous: list[dict]) -> dict:
    """`{group: rows}` of the groups of `previous` (rows of a run cut short, as `bench.jsonl` logged them)
    that hold every row of `row_tasks`: what `--resume` keeps. A group with a row missing is timed again
    whole (its rows were timed in turns with each other).

    Example:
        >>> r = dict(B=1, Hq=1, Hkv=1, N=64, D=64, dtype="bfloat16", mask="random")
        >>> rows = [dict(r, impl=i, mode=m) for i, m in row_tasks("random", torch.bfloat16)]
        >>> list(finished_groups(rows)), finished_groups(rows[:-1])
        ([(1, 1, 1, 64, 64, 'bfloat16', 'random')], {})
    """
    groups = {}
    for row in previous:
        groups.setdefault(group_of(row), []).append(row)
    return {g: rs for g, rs in groups.items()
            if {(r["impl"], r["mode"]) for r in rs} == set(row_tasks(g[-1], getattr(torch, g[-2])))}


def run_rows(shapes, mask_names, dtypes, log, finished: dict | None = None) -> list[dict]:
    """The rows of every (shape, dtype, mask) group, each row passed to `log` when it is done; the groups in
    `finished` (`finished_groups` of a run cut short) are taken from it, not timed again. Each timing round
    records the GPU's mean SM clock and its share of power-capped samples meanwhile (`runs_sm_mhz`,
    `runs_capped`; None without NVML): a faster kernel can run into the power cap where a slower one does not
    (tuning log, step 141)."""
    with Clocks(torch.cuda.current_device(), interval=0.005) as clocks:
        return _run_rows(shapes, mask_names, dtypes, log, finished, clocks)


def _run_rows(shapes, mask_names, dtypes, log, finished: dict | None, clocks: Clocks) -> list[dict]:
    """`run_rows` with its clock reader running."""
    comp = Competitors()
    rows = []
    finished = finished or {}
    for B, Hq, Hkv, N, D in shapes:
        for dtype in dtypes:
            todo = [m for m in mask_names if (B, Hq, Hkv, N, D, str(dtype).replace("torch.", ""), m) not in finished]
            for mname in mask_names:
                for row in finished.get((B, Hq, Hkv, N, D, str(dtype).replace("torch.", ""), mname), []):
                    rows.append(row)
                    log(row)
            if not todo:
                continue
            gen = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype, generator=gen).requires_grad_()
            k = torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype, generator=gen).requires_grad_()
            v = torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype, generator=gen).requires_grad_()
            for mname in todo:
                mask, causal = build_mask(mname, N, "cuda")
                density = live_density(mask, causal)
                tasks = row_tasks(mname, dtype)
                impls = {"sparse_flash": comp.ours, "flex": comp.flex_attention, "sdpa_cudnn": comp.sdpa("cudnn"),
                         "sdpa_flash": comp.sdpa("flash"), ANY_ORDER: comp.ours_any_order,
                         "sdpa_bool_mask": comp.sdpa_bool_mask}
                try:
                    with torch.no_grad():
                        ref = comp.flex_attention(q, k, v, mask, causal)
                except Exception:  # flex's row reports its own error below
                    ref = torch.full_like(q, float("nan"))
                # sparse_flash and flex run twice, in opposite orders, and keep the faster median: whichever
                # runs first after a new mask (compiles, idle GPU) would otherwise pay for it. Short rows, whose
                # eager calls are as fast as the host, run a third time (a burst of host load lasts seconds).
                rounds = eager_rounds(N)
                timed = [t for t in tasks if t[0] in ("sparse_flash", "flex")]
                for r in range(1, rounds):
                    tasks += timed[::-1] if r % 2 else timed
                # every call compiled before the first is timed, then other processes' cores waited out
                # (compile workers stay busy for a while after a compile returned)
                for impl, mode in dict.fromkeys(timed):
                    warm_up(lambda: impls[impl](q, k, v, mask, causal), None if mode == "fwd" else [q, k, v])
                settled = settle_row()
                done = {}
                for impl, mode in tasks:
                    fn = impls[impl]
                    row = done.get((impl, mode))
                    if row is None:
                        row = done[(impl, mode)] = {
                            "B": B, "Hq": Hq, "Hkv": Hkv, "N": N, "D": D, "dtype": str(dtype).replace("torch.", ""),
                            "mask": mname, "causal": causal, "density": density, "impl": impl, "mode": mode,
                            "runs_ms": [], "runs_other_cores": [], "runs_sm_mhz": [], "runs_capped": [],
                            "settle_s": settled}
                        rows.append(row)
                    elif "error" in row:
                        continue
                    try:
                        if mode == "fwd":
                            with torch.no_grad():
                                if "max_diff_vs_flex" not in row:
                                    out = fn(q, k, v, mask, causal)
                                    row["max_diff_vs_flex"] = float((out.float() - ref.float()).abs().max())
                                with HostMeter() as host, clocks.meter() as gpu:
                                    row["runs_ms"].append(bench(lambda: fn(q, k, v, mask, causal)))
                        else:
                            with HostMeter() as host, clocks.meter() as gpu:
                                row["runs_ms"].append(bench(lambda: fn(q, k, v, mask, causal), grad_of=[q, k, v]))
                        row["runs_other_cores"].append(host.other_cores)
                        row["runs_sm_mhz"].append(gpu["sm_mhz"])
                        row["runs_capped"].append(gpu["capped"])
                        row["ms"] = min(row["runs_ms"])
                        flops = 4 * B * Hq * N * N * D * density * (3.5 if mode == "fwd+bwd" else 1.0)
                        row["tflops"] = flops / row["ms"] / 1e9
                    except Exception as e:  # a competitor that cannot run this row says why
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                        torch.cuda.empty_cache()
                    done_eager = len(row["runs_ms"]) == (rounds if impl in ("sparse_flash", "flex") else 1)
                    if done_eager and impl in ("sparse_flash", "flex") and N <= GRAPH_MAX_N and "error" not in row:
                        try:
                            if mode == "fwd":
                                with torch.no_grad():
                                    row["graph_ms"] = bench(lambda: fn(q, k, v, mask, causal), graph=True)
                            else:
                                row["graph_ms"] = bench(lambda: fn(q, k, v, mask, causal), grad_of=[q, k, v], graph=True)
                        except Exception as e:
                            row["graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    if done_eager or "error" in row:
                        log(row)
                del mask
            del q, k, v
            torch.cuda.empty_cache()
    return rows


def add_ratios(rows: list[dict]) -> None:
    """Speed-ups of sparse_flash over flex and over cuDNN dense attention (same shape, dtype and mode)."""
    def key(r, **kw):
        d = {f: r[f] for f in ("B", "Hq", "Hkv", "N", "D", "dtype", "mode", "mask")}
        d.update(kw)
        return tuple(sorted(d.items()))

    table = {key(r, impl=r["impl"]): r for r in rows if "ms" in r}
    for r in rows:
        if r["impl"] == ANY_ORDER and "ms" in r:
            cudnn = table.get(key(r, impl="sdpa_cudnn", mask="dense"))
            default = table.get(key(r, impl="sparse_flash"))
            if cudnn:
                r["speedup_vs_cudnn_dense"] = cudnn["ms"] / r["ms"]
            if default:
                r["speedup_vs_deterministic"] = default["ms"] / r["ms"]
        if r["impl"] != "sparse_flash" or "ms" not in r:
            continue
        flex = table.get(key(r, impl="flex"))
        if flex:
            r["speedup_vs_flex"] = flex["ms"] / r["ms"]
            if "graph_ms" in r and "graph_ms" in flex:
                r["graph_speedup_vs_flex"] = flex["graph_ms"] / r["graph_ms"]
        cudnn = table.get(key(r, impl="sdpa_cudnn", mask="dense"))
        if cudnn:
            r["speedup_vs_cudnn_dense"] = cudnn["ms"] / r["ms"]
        flash = table.get(key(r, impl="sdpa_flash", mask=r["mask"])) if r["mask"] in ("dense", "causal") else None
        if flash:
            r["speedup_vs_sdpa_flash"] = flash["ms"] / r["ms"]
        dense = table.get(key(r, impl="sparse_flash", mask="dense"))
        if dense:
            r["time_over_dense"] = r["ms"] / dense["ms"]


MASK_COST_REPEATS = 15  # timed builds per (impl, mask, N), taken in turns with the other impl's
# Issue 25's target for these constructors at 65,536 tokens: at most 1 ms. Their builds are also timed back to
# back (no `create_block_mask` between them), and one build in turns is profiled where the median misses it
# (step 125: local 1.09 ms alone, 1.97 ms in turns, on one host).
BUILD_TARGET_MS, BUILD_TARGET_MASKS, BUILD_TARGET_N = 1.0, ("butterfly", "local"), 65536


def _mask_mods(ours: sparse_flash.BlockMask):
    """FlexAttention `mask_mod`s of the same patterns as the constructors of `mask_costs`: the structured ones
    as formulas, the drawn ones (random, bigbird) as a lookup in our layout (the block pattern is the same)."""
    def butterfly_mod(b, h, q_idx, kv_idx):
        x = (q_idx // BLOCK) ^ (kv_idx // BLOCK)
        return (x & (x - 1)) == 0

    def local_mod(b, h, q_idx, kv_idx):
        d = q_idx // BLOCK - kv_idx // BLOCK
        return (d <= LOCAL_WINDOW) & (d >= -LOCAL_WINDOW)

    def fixed_mod(b, h, q_idx, kv_idx):  # `masks.fixed`'s defaults on a grid of whole windows: 4 blocks, the last global
        q, k = q_idx // BLOCK, kv_idx // BLOCK
        return (q // 4 == k // 4) | (k % 4 == 3)

    def longformer_mod(b, h, q_idx, kv_idx):  # `masks.longformer`'s defaults: a window of +-1 block, block 0 global
        q, k = q_idx // BLOCK, kv_idx // BLOCK
        return ((q - k <= 1) & (k - q <= 1)) | (q == 0) | (k == 0)

    table = ours.layout[0, 0].clone()  # a plain tensor (the layout is read-only)

    def table_mod(b, h, q_idx, kv_idx):
        return table[q_idx // BLOCK, kv_idx // BLOCK]

    return {"butterfly": butterfly_mod, "local": local_mod, "random": table_mod, "bigbird": table_mod,
            "fixed": fixed_mod, "longformer": longformer_mod}


LOCAL_WINDOW = 3


def mask_builders(device="cuda") -> dict:
    """The constructors whose builds `mask_costs` times, each `n -> BlockMask` on `device`."""
    return {
        "butterfly": lambda n: masks.butterfly(n, BLOCK, device=device),
        "local": lambda n: masks.local(n, BLOCK, window=LOCAL_WINDOW, device=device),
        "random": lambda n: masks.random(n, BLOCK, density=0.1, seed=0, device=device),
        "bigbird": lambda n: masks.bigbird(n, BLOCK, seed=0, device=device),
        "fixed": lambda n: masks.fixed(n, BLOCK, device=device),  # 131,584 runs at 65,536 tokens: counted from the pattern
        "longformer": lambda n: masks.longformer(n, BLOCK, device=device),
    }


def seconds_to_idle(f) -> float:
    """Host seconds from calling `f()` on an idle device until the device is idle again."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    f()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def slow_build_profile(build) -> dict:
    """One build under the profiler, with the host's state: the host operators and CUDA runtime calls with the
    most self time, the device's microseconds, the load, this process's threads and the busiest processes."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        ms = 1e3 * seconds_to_idle(build)
    events = prof.key_averages()
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
    threads = next(line.split()[1] for line in open("/proc/self/status") if line.startswith("Threads"))
    busiest = subprocess.run(["ps", "-eo", "pcpu,nlwp,comm", "--sort=-pcpu"], capture_output=True,
                             text=True).stdout.splitlines()[1:6]
    return {"profiled_ms": round(ms, 3), "device_us": round(sum(e.self_device_time_total for e in events), 1),
            "top_self_cpu_us": [(e.key, round(e.self_cpu_time_total, 1), e.count) for e in top],
            "load": os.getloadavg(), "threads": int(threads), "torch_threads": torch.get_num_threads(),
            "busiest": busiest}


def mask_costs(sizes=(65536, 1 << 20)) -> list[dict]:
    """Host time to build masks with their index lists on the GPU (from the call to the device idle), and their
    metadata bytes; FlexAttention's `create_block_mask` of the same pattern beside them at 65,536 tokens.

    Each (mask, N) is built once to load its kernels, then `MASK_COST_REPEATS` times in turns with
    `create_block_mask` (ours, flex, ours, ...): the host's clock and load drift over a run, and turns give
    both the same conditions. The median of each is reported. The constructors with a 1 ms target
    (`BUILD_TARGET_MASKS`) are then built back to back too (`alone_ms`), after one build in turns under the
    profiler where their median misses the target (`turn_profile`). The cores other processes held over the turns
    and over the builds back to back go beside them (`other_cores`, `alone_other_cores`: `HostMeter`)."""
    out = []
    builders = mask_builders()
    only_short = ("fixed", "longformer")  # at 65,536 tokens only (fixed at 2**20 holds 16.8M blocks)
    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError as e:
        create_block_mask, flex_error = None, f"{type(e).__name__}: {e}"[:200]

    timed = seconds_to_idle
    for n in sizes:
        for name, build in builders.items():
            if name in only_short and n > 65536:
                continue
            m = build(n)  # loads the kernels of this geometry
            meta = m.kernel_index(False).nbytes() + m.kernel_index(True).nbytes()
            flex_build = None
            if create_block_mask is not None and n <= 65536:
                mod = _mask_mods(m)[name]

                def flex_build():
                    return create_block_mask(mod, None, None, n, n, device="cuda", _compile=True)
                fm = flex_build()
                flex_meta = sum(t.numel() * t.element_size() for t in fm.as_tuple() if isinstance(t, torch.Tensor))
            ours_times, flex_times = [], []
            with HostMeter() as host:  # the cores other processes held over the turns (host time is the build's)
                for _ in range(MASK_COST_REPEATS):
                    ours_times.append(timed(lambda: build(n)))
                    if flex_build is not None:
                        flex_times.append(timed(flex_build))
            out.append({"impl": "sparse_flash", "mask": name, "N": n, "ms": 1e3 * statistics.median(ours_times),
                        "min_ms": 1e3 * min(ours_times), "layout_bytes": m.layout.numel(), "index_bytes": meta,
                        "nnz": m.nnz, "other_cores": host.other_cores})
            if name in BUILD_TARGET_MASKS and n == BUILD_TARGET_N:
                if flex_build is not None and out[-1]["ms"] > BUILD_TARGET_MS:  # the last build was flex's
                    out[-1]["turn_profile"] = slow_build_profile(lambda: build(n))
                with HostMeter() as host:
                    alone = [timed(lambda: build(n)) for _ in range(MASK_COST_REPEATS)]
                out[-1]["alone_ms"], out[-1]["alone_min_ms"] = 1e3 * statistics.median(alone), 1e3 * min(alone)
                out[-1]["alone_other_cores"] = host.other_cores
            if flex_build is not None:
                out.append({"impl": "flex create_block_mask", "mask": name, "N": n,
                            "ms": 1e3 * statistics.median(flex_times), "min_ms": 1e3 * min(flex_times),
                            "index_bytes": flex_meta})
                out[-2]["speedup_vs_flex"] = out[-1]["ms"] / out[-2]["ms"]
                if out[-2]["speedup_vs_flex"] < 0.5:  # tuning log step 115: slow only in some processes
                    out[-2]["slow_build"] = slow_build_profile(lambda: build(n))
            elif create_block_mask is None:
                out.append({"impl": "flex create_block_mask", "mask": name, "N": n, "error": flex_error})
            else:
                out.append({"impl": "flex create_block_mask", "mask": name, "N": n,
                            "error": f"not run: evaluates the mask_mod on all N^2 = {n * n:.2e} pairs"})
    return out


def summarize(rows: list[dict]) -> dict:
    ours = [r for r in rows if r["impl"] == "sparse_flash" and "speedup_vs_flex" in r and r["dtype"] == "bfloat16"]
    s = {}
    for mode in ("fwd", "fwd+bwd"):
        sp = [r["speedup_vs_flex"] for r in ours if r["mode"] == mode]
        if sp:
            worst = min((r for r in ours if r["mode"] == mode), key=lambda r: r["speedup_vs_flex"])
            s[mode] = {"min_vs_flex": min(sp), "median_vs_flex": statistics.median(sp),
                       "worst_row": f"{worst['B']},{worst['Hq']},{worst['N']},{worst['D']} {worst['mask']}",
                       "rows_at_or_above_1": f"{sum(x >= 1.0 for x in sp)} of {len(sp)}"}
            graphed = [r for r in ours if r["mode"] == mode and "graph_speedup_vs_flex" in r]
            if graphed:
                below = [f"{r['B']},{r['Hq']},{r['N']},{r['D']} {r['mask']}: {r['graph_speedup_vs_flex']:.2f}"
                         for r in graphed if r["graph_speedup_vs_flex"] < 1.0]
                s[mode]["cuda_graph_rows"] = {
                    "rows": len(graphed), "median_vs_flex": statistics.median(r["graph_speedup_vs_flex"] for r in graphed),
                    "below_1": below}
    dense128 = [r for r in ours if r["mask"] == "dense" and r["D"] == 128 and r["mode"] == "fwd" and r["Hq"] == r["Hkv"]]
    if dense128:
        s["dense_fwd_d128_vs_cudnn"] = min(r.get("speedup_vs_cudnn_dense", 0) for r in dense128)
        s["dense_fwd_d128_vs_sdpa_flash"] = min(r.get("speedup_vs_sdpa_flash", 0) for r in dense128)
    for impl, name in (("sparse_flash", "dense_fwd_bwd_vs_cudnn"), (ANY_ORDER, "dense_fwd_bwd_any_order_vs_cudnn")):
        dense_bwd = [r for r in rows if r["impl"] == impl and r["mask"] == "dense" and r["mode"] == "fwd+bwd"
                     and r["dtype"] == "bfloat16" and "speedup_vs_cudnn_dense" in r]
        if dense_bwd:
            s[name] = {f"{r['N']},{r['D']}" + ("" if r["Hq"] == r["Hkv"] else " gqa"):
                       round(r["speedup_vs_cudnn_dense"], 3) for r in dense_bwd}
    # rows timed while other processes held a core or more (their eager medians may be the host's, not ours)
    s["rows_timed_beside_busy_cores"] = [
        f"{r['B']},{r['Hq']},{r['N']},{r['D']} {r['mask']} {r['mode']} {r['impl']}: "
        + " ".join(f"{c:.1f}" for c in r["runs_other_cores"] if c is not None)
        for r in rows if any(c is not None and c >= ROW_SETTLE_CORES for c in r.get("runs_other_cores", []))]
    # the GPU's clock while each row's kept (fastest) round ran, per competitor, and the rows kept from a round with
    # a quarter or more of its samples power-capped: a faster kernel can run into the cap where a slower one does
    # not (tuning log, step 141). Empty without NVML
    kept = {}
    for r in rows:
        if r.get("runs_sm_mhz") and "ms" in r:
            i = r["runs_ms"].index(r["ms"])
            if r["runs_sm_mhz"][i] is not None:
                kept[id(r)] = (r["runs_sm_mhz"][i], r["runs_capped"][i])
    s["median_sm_mhz"] = {impl: statistics.median(kept[id(r)][0] for r in rows if r["impl"] == impl and id(r) in kept)
                          for impl in dict.fromkeys(r["impl"] for r in rows if id(r) in kept)}
    s["rows_timed_power_capped"] = [
        f"{r['B']},{r['Hq']},{r['N']},{r['D']} {r['mask']} {r['mode']} {r['impl']}: {kept[id(r)][0]} MHz, "
        f"{kept[id(r)][1]:.0%} of samples capped" for r in rows if id(r) in kept and kept[id(r)][1] >= 0.25]
    follow = [r for r in ours if r["N"] >= 16384 and "time_over_dense" in r and r["mask"] != "dense"]
    s["density_rule_violations"] = [
        f"{r['N']},{r['D']} {r['mask']} {r['mode']}: {r['time_over_dense']:.3f} > {1.15 * r['density'] + 0.01:.3f}"
        for r in follow if r["time_over_dense"] > 1.15 * r["density"] + 0.01
    ]
    return s


def git_commit() -> str | None:
    """The commit measured: $SPARSE_FLASH_COMMIT when set (a copy of the tree run on a machine whose checkout
    is not the one the tree came from), else git's HEAD, with "+dirty" when sparse_flash/ or benchmarks/ have
    uncommitted changes; None outside git."""
    if os.environ.get("SPARSE_FLASH_COMMIT"):
        return os.environ["SPARSE_FLASH_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "sparse_flash", "benchmarks"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = head.stdout.strip() if head.returncode == 0 else ""
    return (commit + ("+dirty" if dirty.stdout.strip() else "")) or None


def environment() -> dict:
    """What every result file records: date, GPU (None without CUDA), versions, commit, command line, host."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"date": datetime.date.today().isoformat(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
            "commit": git_commit(), "command": " ".join(sys.argv), "host": host_info()}


SETTLE_LOAD, SETTLE_SECONDS = 1.5, 90  # the 1-minute load the run waits for, and for how long at most


def quiet_compiles() -> None:
    """Start torch.compile's pool of compile workers now and keep it up: FlexAttention and
    `create_block_mask(_compile=True)` compile through it, and a pool that starts (or wakes from its idle
    shutdown) with a compile keeps starting its worker processes while the next calls are timed; the short
    rows' eager calls and the mask builds are host time (step 118: a build 10x slower while the pool started).
    The compiled code is the same. Where this torch has no such pool, nothing to do."""
    try:
        import torch._inductor.config as inductor_config
        from torch._inductor.async_compile import AsyncCompile

        if hasattr(inductor_config, "quiesce_async_compile_pool"):
            inductor_config.quiesce_async_compile_pool = False
        if AsyncCompile.use_process_pool() is False:  # compiles run in this process: no pool to start
            return
        AsyncCompile.wait_pool_ready()  # its workers started and idle
    except Exception as e:  # the benchmark runs without it, only noisier
        print(f"compile pool not started ahead: {type(e).__name__}: {e}", flush=True)


def cpu_seconds(stat: str = "/proc/stat") -> tuple[float, float] | None:
    """`(busy CPU seconds of the whole host, CPU seconds of this process)` so far, or None without `/proc`.
    Busy is every state but idle and iowait (`/proc/stat`'s first line, in clock ticks); this process's
    counts all its threads (`os.times`), so the difference is other processes' (compile workers included)."""
    try:
        with open(stat) as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system


class HostMeter:
    """Cores busy with other processes and with this one over a stretch of wall time (a timing round):
    `with HostMeter() as m: ...`, then `m.other_cores` and `m.own_cores` (None without `/proc`). A row whose
    eager median is far above its CUDA-graph time while other processes held cores was slowed by them."""

    def __init__(self, read=cpu_seconds, clock=time.perf_counter):
        self.read, self.clock = read, clock
        self.other_cores = self.own_cores = None

    def __enter__(self):
        self.start, self.t0 = self.read(), self.clock()
        return self

    def __exit__(self, *exc):
        end, wall = self.read(), self.clock() - self.t0
        if self.start is not None and end is not None and wall > 0:
            own = (end[1] - self.start[1]) / wall
            self.own_cores = round(own, 2)
            self.other_cores = round(max(0.0, (end[0] - self.start[0]) / wall - own), 2)
        return False


class Clocks:
    """The GPU's SM clock (MHz), power (W) and whether a power cap holds its clock down, sampled every `interval`
    seconds by a thread while in use (`with Clocks(device) as clocks: ...`; `clocks.samples`: `(host time,
    MHz, W, capped)`), through NVML from the driver's libnvidia-ml (ctypes: no Python package needed). Samples
    nothing where NVML cannot be loaded (`clocks.error` says why)."""

    SW_POWER_CAP, HW_POWER_BRAKE = 0x4, 0x80  # NVML's clock-event reasons that a power limit sets

    def __init__(self, device: int, interval: float = 0.002):
        self.samples, self.error, self.interval = [], None, interval
        self._stop = threading.Event()
        try:
            self._nvml = ctypes.CDLL("libnvidia-ml.so.1")
            if self._nvml.nvmlInit_v2() != 0:
                raise OSError("nvmlInit_v2 failed")
            self._handle = ctypes.c_void_p()
            props = torch.cuda.get_device_properties(device)
            bus, found = getattr(props, "pci_bus_id", None), -1
            if bus is not None:  # the handle of this CUDA device, whatever NVML's order of devices
                name = f"{props.pci_domain_id:08X}:{bus:02X}:{props.pci_device_id:02X}.0".encode()
                found = self._nvml.nvmlDeviceGetHandleByPciBusId_v2(name, ctypes.byref(self._handle))
            if found != 0:
                found = self._nvml.nvmlDeviceGetHandleByIndex_v2(device, ctypes.byref(self._handle))
            if found != 0:
                raise OSError(f"no NVML handle for CUDA device {device} (NVML error {found})")
            self._reads = (self._nvml.nvmlDeviceGetClockInfo, self._nvml.nvmlDeviceGetPowerUsage,
                           self._nvml.nvmlDeviceGetCurrentClocksThrottleReasons)  # each present, or AttributeError
        except (OSError, AttributeError) as e:
            self.error = str(e)

    def _sample(self):
        mhz, mw, reasons = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
        clock, power, events = self._reads
        while not self._stop.is_set():
            clock(self._handle, 1, ctypes.byref(mhz))  # 1: NVML_CLOCK_SM, the current clock
            power(self._handle, ctypes.byref(mw))  # milliwatts (the driver's average over its own window)
            events(self._handle, ctypes.byref(reasons))
            capped = bool(reasons.value & (self.SW_POWER_CAP | self.HW_POWER_BRAKE))
            self.samples.append((time.perf_counter(), mhz.value, mw.value / 1e3, capped))
            time.sleep(self.interval)

    def __enter__(self):
        if self.error is None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.error is None:
            self._stop.set()
            self._thread.join()

    @contextlib.contextmanager
    def meter(self):
        """`with clocks.meter() as gpu: ...`: `gpu` holds `during` of that stretch of wall time once it ends."""
        gpu, t0 = {}, time.perf_counter()
        try:
            yield gpu
        finally:
            gpu.update(self.during(t0, time.perf_counter()))

    def during(self, t0: float, t1: float) -> dict:
        """Mean SM clock, highest power and the share of samples with a power cap, between host times t0 and t1."""
        samples = self.samples  # in time order: the stretch found by bisection (a benchmark takes ~10^5 samples)
        inside = samples[bisect.bisect_left(samples, (t0, )):bisect.bisect_right(samples, (t1, math.inf))]
        if not inside:
            return {"sm_mhz": None, "watts_max": None, "capped": None, "samples": 0}
        return {"sm_mhz": round(sum(s[1] for s in inside) / len(inside)), "watts_max": max(s[2] for s in inside),
                "capped": round(sum(s[3] for s in inside) / len(inside), 3), "samples": len(inside)}


ROW_SETTLE_CORES, ROW_SETTLE_SECONDS = 1.0, 10.0  # other processes' cores a row waits out, and for how long


def settle_row(limit: float = ROW_SETTLE_CORES, seconds: float = ROW_SETTLE_SECONDS, window: float = 0.25,
               meter=HostMeter) -> float:
    """Before a row's timing rounds (after its compiles): wait until other processes hold fewer than `limit`
    cores over a `window` of seconds (compile workers finishing a compile keep cores for a while after the
    compiled call returned), at most `seconds`; returns the seconds waited (0 without `/proc`)."""
    waited = 0.0
    while waited < seconds:
        with meter() as m:
            time.sleep(window)
        waited += window
        if m.other_cores is None or m.other_cores < limit:
            return round(waited - window, 2)
    return round(waited, 2)


def settle_host(limit: float = SETTLE_LOAD, seconds: float = SETTLE_SECONDS, sleep=time.sleep) -> float:
    """Wait until the host's 1-minute load average is below `limit` (at most `seconds`); returns the seconds
    waited. Eager rows of 4,096 tokens are as fast as the host: a run started right after an 8-worker test run
    (load 4.1) had them at 0.81-0.94x FlexAttention where an idle host gave 1.15-1.68x (2026-12-04)."""
    waited = 0.0
    while hasattr(os, "getloadavg") and os.getloadavg()[0] >= limit and waited < seconds:
        sleep(5.0)
        waited += 5.0
    return waited


def host_info() -> dict:
    """The host that small, host-bound rows depend on: CPU model, cores, and load when the run started."""
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    return {"cpu": model, "cores": os.cpu_count(), "load_1min": load}


def markdown(meta: dict, rows: list[dict], costs: list[dict], summary: dict) -> str:
    host = meta.get("host", {})
    lines = [f"# Attention benchmark, {meta['date']}", "",
             f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}; host "
             f"{host.get('cpu', '?')}, {host.get('cores', '?')} cores, load {host.get('load_1min', '?')} at the start. "
             "Median of `triton.testing.do_bench` (sparse_flash and FlexAttention: the faster of two medians, "
             f"three on rows up to {GRAPH_MAX_N} tokens, timed in alternating orders); TFLOP/s on nonzero blocks "
             "only (fwd 4·B·H·N²·D·density, fwd+bwd 3.5x). "
             f"Rows up to {GRAPH_MAX_N} tokens are also timed as CUDA-graph replays (`do_bench_cudagraph`: GPU time "
             "only, no host time between calls): the last column.",
             "", "| B,Hq,Hkv,N,D | dtype | mask | density | mode | sparse_flash ms | flex ms | vs flex | vs cuDNN dense | sparse_flash TFLOP/s | flex TFLOP/s | vs flex, CUDA graphs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by = {}
    for r in rows:
        by.setdefault((r["B"], r["Hq"], r["Hkv"], r["N"], r["D"], r["dtype"], r["mask"], r["mode"]), {})[r["impl"]] = r
    for (B, Hq, Hkv, N, D, dt, mname, mode), impls in by.items():
        o, f = impls.get("sparse_flash", {}), impls.get("flex", {})

        def fmt(x, spec):
            return format(x, spec) if isinstance(x, (int, float)) else "n/a"

        lines.append(
            f"| {B},{Hq},{Hkv},{N},{D} | {dt} | {mname} | {o.get('density', 0):.3f} | {mode} | {fmt(o.get('ms'), '.3f')} | "
            f"{fmt(f.get('ms'), '.3f')} | {fmt(o.get('speedup_vs_flex'), '.2f')}x | {fmt(o.get('speedup_vs_cudnn_dense'), '.2f')}x | "
            f"{fmt(o.get('tflops'), '.0f')} | {fmt(f.get('tflops'), '.0f')} | "
            + (f"{o['graph_speedup_vs_flex']:.2f}x ({o['graph_ms']:.3f} / {f['graph_ms']:.3f} ms) |"
               if "graph_speedup_vs_flex" in o else "|")
        )
    lines += ["", "## SDPA on the same shapes", "", "| B,Hq,Hkv,N,D | dtype | mask | mode | impl | ms | TFLOP/s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["impl"].startswith("sdpa"):
            val = f"{r['ms']:.3f} | {r['tflops']:.0f}" if "ms" in r else f"n/a | {r.get('error', '')[:60]}"
            lines.append(f"| {r['B']},{r['Hq']},{r['Hkv']},{r['N']},{r['D']} | {r['dtype']} | {r['mask']} | {r['mode']} | {r['impl']} | {val} |")
    any_order = [r for r in rows if r["impl"] == ANY_ORDER]
    if any_order:
        lines += ["", "## Dense forward+backward with dQ added in any order (`SPARSE_FLASH_DETERMINISTIC=0`)", "",
                  "The one-pass backward kernel (not deterministic: dQ varies in its last bits from run to run).", "",
                  "| B,Hq,Hkv,N,D | dtype | ms | vs deterministic | vs cuDNN dense |", "|---|---|---|---|---|"]
        for r in any_order:
            def ratio(name):
                return f"{r[name]:.2f}x" if name in r else "n/a"

            val = f"{r['ms']:.3f}" if "ms" in r else f"n/a ({r.get('error', '')[:60]})"
            lines.append(f"| {r['B']},{r['Hq']},{r['Hkv']},{r['N']},{r['D']} | {r['dtype']} | {val} | "
                         f"{ratio('speedup_vs_deterministic')} | {ratio('speedup_vs_cudnn_dense')} |")
    lines += ["", "## Mask construction on the GPU (with index lists)", "",
              f"Host time from the call until the device is idle, median (and min) of {MASK_COST_REPEATS} builds "
              "taken in turns with `create_block_mask` of the same pattern (random and bigbird: a lookup in our "
              f"layout). {', '.join(BUILD_TARGET_MASKS)} at {BUILD_TARGET_N:,} tokens are also built "
              f"{MASK_COST_REPEATS} times back to back: the last column.", "",
              "| impl | mask | N | ms | min ms | vs flex | metadata bytes | back to back ms |",
              "|---|---|---|---|---|---|---|---|"]
    for c in costs:
        ms = f"{c['ms']:.2f} | {c['min_ms']:.2f}" if "ms" in c else f"{c.get('error', '')} | "
        ratio = f"{c['speedup_vs_flex']:.2f}x" if "speedup_vs_flex" in c else ""
        alone = f"{c['alone_ms']:.2f}" if "alone_ms" in c else ""
        lines.append(f"| {c['impl']} | {c.get('mask', '')} | {c.get('N', '')} | {ms} | {ratio} | "
                     f"{c.get('index_bytes', '')} | {alone} |")
    lines += ["", "## Summary", "", "```", json.dumps(summary, indent=2), "```", ""]
    return "\n".join(lines)


def plots(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        for impl, marker in (("sparse_flash", "o"), ("flex", "s")):
            pts = [r for r in rows if r["impl"] == impl and r["mode"] == mode and "tflops" in r and r["dtype"] == "bfloat16"]
            ax.scatter([r["density"] for r in pts], [r["tflops"] for r in pts], marker=marker, label=impl, alpha=0.7)
        ax.set_xscale("log")
        ax.set_xlabel("density of computed blocks")
        ax.set_ylabel("effective TFLOP/s")
        ax.set_title(f"bf16 {mode}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "tflops_vs_density.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for impl, mname, style in (("sparse_flash", "butterfly", "o-"), ("flex", "butterfly", "s--"),
                               ("sparse_flash", "dense", "o-"), ("sdpa_cudnn", "dense", "^:")):
        pts = sorted((r["N"], r["ms"]) for r in rows if r["impl"] == impl and r["mask"] == mname and r["mode"] == "fwd+bwd"
                     and "ms" in r and r["dtype"] == "bfloat16" and r["Hq"] == r["Hkv"] and r["D"] in (64, 128))
        if pts:
            ax.plot(*zip(*pts), style, label=f"{impl} {mname}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("fwd+bwd ms")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "time_vs_length.png", dpi=110)
    plt.close(fig)


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    """`--shape`'s "B,Hq,Hkv,N,D" as five positive ints.

    Example:
        >>> parse_shape("4,16,16,4096,64")
        (4, 16, 16, 4096, 64)
    """
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 5 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"--shape takes five positive ints B,Hq,Hkv,N,D, got {text!r}")
    return shape


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two shapes and four masks")
    parser.add_argument("--out", default="benchmarks/results/latest", help="output folder (default: %(default)s)")
    parser.add_argument("--no-mask-costs", action="store_true", help="skip the mask construction timings")
    parser.add_argument("--shape", action="append", type=parse_shape, metavar="B,Hq,Hkv,N,D",
                        help="only this shape (repeatable; bf16, without the fp16 and 2-D neighbourhood rows)")
    parser.add_argument("--mask", action="append", choices=MASKS, help="only this mask (repeatable)")
    parser.add_argument("--resume", action="store_true",
                        help="continue a run cut short: keep the finished groups of OUT/bench.jsonl, time the rest")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    waited = settle_host()
    quiet_compiles()  # after the wait: the pool's start would hold up the 1-minute load it reads
    meta = {**environment(), "block_size": BLOCK, "settle_wait_s": waited}
    print(f"host load {meta['host']['load_1min']} after waiting {waited:.0f} s for it to fall below {SETTLE_LOAD}",
          flush=True)
    shapes = args.shape or (QUICK_SHAPES if args.quick else SHAPES)
    mask_names = args.mask or (QUICK_MASKS if args.quick else MASKS)
    whole = not (args.shape or args.mask)
    finished = {}
    if args.resume and (out / "bench.jsonl").exists():
        finished = finished_groups([json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()
                                    if line.strip()])
        meta["resumed_groups"] = len(finished)
        print(f"resuming: {len(finished)} finished (shape, dtype, mask) groups kept", flush=True)
    log_file = open(out / "bench.jsonl", "w")

    def log(row):
        log_file.write(json.dumps(row) + "\n")
        log_file.flush()
        speed = f"{row['ms']:.3f} ms {row['tflops']:.0f} TF/s" if "ms" in row else row.get("error", "")
        print(f"{row['B']},{row['Hq']},{row['Hkv']},{row['N']},{row['D']} {row['dtype']:8s} {row['mask']:10s} "
              f"{row['mode']:7s} {row['impl']:14s} {speed}", flush=True)

    rows = run_rows(shapes, mask_names, [torch.bfloat16], log, finished)
    if whole:
        rows += run_rows([(4, 16, 16, 4096, 128)], ["butterfly"], [torch.float16], log, finished)
        rows += run_rows([(1, 8, 8, 65536, 64)], ["neighborhood_2d"], [torch.bfloat16], log, finished)  # 256 x 256
    add_ratios(rows)
    costs = [] if args.no_mask_costs else mask_costs()
    summary = summarize(rows)
    (out / "bench.json").write_text(json.dumps({"meta": meta, "rows": rows, "mask_costs": costs, "summary": summary}, indent=2))
    (out / "bench.md").write_text(markdown(meta, rows, costs, summary))
    plots(rows, out)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a host-bound benchmark row loses time: a profiler timeline of the host and the GPU, per call.

For each row and competitor (sparse_flash, FlexAttention compiled) it runs calls the way `do_bench` does
(a cache flush, then the call) under torch.profiler and reports, per call: the host time from the call's
start to each kernel launch, the GPU's busy time, and the idle gaps on the GPU before each kernel. A row
whose GPU idles between its kernels is bound by the host, and the timeline says which host step is late.
It also times the rows with `do_bench` with the process pinned to one or two CPU cores, which shows how
much thread placement moves the host-bound rows.

    cd benchmarks && python trace_rows.py --out trace/   (on a CUDA machine; traces land in trace/traces.tgz)
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import tarfile
from pathlib import Path

import torch

from bench_attention import Competitors, build_mask

ROWS = [(4, 16, 4096, 128, "random"), (4, 16, 4096, 64, "butterfly"), (4, 16, 4096, 64, "longformer")]


def step_of(fn, q, k, v, do, backward: bool):
    def step():
        out = fn()
        if backward:
            out.backward(do)
            for t in (q, k, v):
                t.grad = None
    return step


def timeline(trace: dict) -> list[dict]:
    """Per annotated call ("call N"): launch times on the host and kernel times on the GPU, in us."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    calls = sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("call ")),
                   key=lambda e: e["ts"])
    launches = sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "aunch" in e["name"]),
                      key=lambda e: e["ts"])
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    by_corr = {e["args"].get("correlation"): e for e in kernels}
    out = []
    for c in calls:
        t0, t1 = c["ts"], c["ts"] + c["dur"]
        mine = [e for e in launches if t0 <= e["ts"] <= t1]
        ks = [by_corr.get(e["args"].get("correlation")) for e in mine]
        pairs = [(lch, k) for lch, k in zip(mine, ks) if k is not None]
        if not pairs:
            continue
        gpu_busy = sum(k["dur"] for _, k in pairs)
        gaps, prev_end = [], None
        for _, k in pairs:
            if prev_end is not None:
                gaps.append(round(k["ts"] - prev_end, 1))
            prev_end = k["ts"] + k["dur"]
        out.append({
            "host_call_us": round(c["dur"], 1),
            "launch_at_us": [round(lch["ts"] - t0, 1) for lch, _ in pairs],
            "launch_cost_us": [round(lch["dur"], 1) for lch, _ in pairs],
            "kernels": [k["name"][:40] for _, k in pairs],
            "kernel_us": [round(k["dur"], 1) for _, k in pairs],
            "gpu_busy_us": round(gpu_busy, 1),
            "gpu_span_us": round(pairs[-1][1]["ts"] + pairs[-1][1]["dur"] - pairs[0][1]["ts"], 1),
            "gpu_gaps_us": gaps,
        })
    return out


def traced(step, path: Path, calls=8) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile, record_function

    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            flush.zero_()
            with record_function(f"call {i}"):
                step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    with gzip.open(str(path) + ".gz", "wt") as f:
        json.dump(trace, f)
    path.unlink()
    return timeline(trace)


def pinned_medians(step, grad_of, cores_sets, repeats=3) -> dict:
    from triton.testing import do_bench

    everything = os.sched_getaffinity(0)
    res = {}
    for cores in cores_sets:
        os.sched_setaffinity(0, cores or everything)
        res[str(sorted(cores)) if cores else "all"] = [
            round(do_bench(step, warmup=25, rep=100, grad_to_none=grad_of, return_mode="median"), 4)
            for _ in range(repeats)]
    os.sched_setaffinity(0, everything)
    return res


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="trace")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    comp = Competitors()
    report, table = [], []
    for B, H, N, D, name in ROWS:
        mask, causal = build_mask(name, N, "cuda")
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        for who, fn in (("sparse_flash", lambda: comp.ours(q, k, v, mask, causal)),
                        ("flex", lambda: comp.flex_attention(q, k, v, mask, causal))):
            for backward in (False, True):
                mode = "fwd+bwd" if backward else "fwd"
                step = step_of(fn, q, k, v, do, backward)
                tag = f"{name}_d{D}_{who}_{mode.replace('+', '')}"
                calls = traced(step, out / f"{tag}.json")
                pinned = pinned_medians(step, [q, k, v] if backward else None, [None, {2}, {2, 3}])
                row = {"row": (B, H, N, D, name), "who": who, "mode": mode, "calls": calls, "do_bench_ms": pinned}
                report.append(row)
                med = lambda key: statistics.median(c[key] for c in calls)  # noqa: E731
                table.append((f"{name} D{D}", who, mode, med("host_call_us"), med("gpu_busy_us"), med("gpu_span_us"),
                              *(statistics.median(v) for v in pinned.values())))
    (out / "trace_rows.json").write_text(json.dumps(report, indent=1))
    with tarfile.open(out / "traces.tgz", "w:gz") as tar:  # one file for the traces (fewer files to fetch)
        for path in sorted(out.glob("*.json.gz")):
            tar.add(path, arcname=path.name)
            path.unlink()
    print(f"{'row':16} {'who':13} {'mode':8} {'host us':>8} {'busy us':>8} {'span us':>8} "
          f"{'all ms':>7} {'core2 ms':>8} {'c2,3 ms':>8}")
    for r in table:
        print(f"{r[0]:16} {r[1]:13} {r[2]:8} {r[3]:8.0f} {r[4]:8.0f} {r[5]:8.0f} {r[6]:7.3f} {r[7]:8.3f} {r[8]:8.3f}")


if __name__ == "__main__":
    main()

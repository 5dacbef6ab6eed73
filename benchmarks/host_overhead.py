"""Host time of one attention call, per layer, with and without the cached direct launch.

A small problem (B=1, H=2, N=1024) keeps the GPU idle between launches, so the loop time per call is the
host time. Prints microseconds per call for each layer (launcher, API forward, API forward+backward) in
both launch modes and for FlexAttention (compiled), then a cProfile of the API forward+backward.

    python benchmarks/host_overhead.py --out host.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats

import torch

import sparse_flash
from sparse_flash import masks
from sparse_flash.kernels.bwd import attn_bwd
from sparse_flash.kernels.fwd import attn_fwd
from sparse_flash.kernels.launch import set_fast_launch
from sparse_flash.kernels.tma import set_tma
from profile_rows import host_us


def launcher_parts(q, k, v, rows, geom) -> dict:
    """Host microseconds of the pieces of one forward launch: the plan's key, allocation, descriptors,
    Triton's launcher (argument packing and cuLaunchKernel) called directly, and the whole launcher."""
    from sparse_flash.kernels import launch as launch_module
    from sparse_flash.kernels.tma import make_descriptor, tile_descriptor, tma_enabled

    plans = {}
    attn_fwd(q, k, v, rows, geom, False, 0.125, plans)
    (plan,) = plans.values()
    bound, compiled = plan.kernel, plan.kernel._compiled
    out, lse = plan(q, k, v)
    part, _, lse_part = plan.split.scratch()
    head = (q, make_descriptor(k, plan.k_layout), make_descriptor(v, plan.v_layout), out, lse, part, lse_part) \
        if plan.tma else (q, k, v, out, lse, part, lse_part)
    stream = launch_module._raw_stream(launch_module._current_device())
    args = (*head, *bound.tail, *bound.constexprs.values())
    parts = {
        "plan key": lambda: launch_module.plan_key((q, k, v), "fwd", False, 0.125, tma_enabled()),
        "torch.empty (out)": lambda: torch.empty(q.shape, dtype=q.dtype, device=q.device),
        "make_descriptor (one)": lambda: make_descriptor(k, plan.k_layout),
        "tile_descriptor (one, with checks)": lambda: tile_descriptor(k, 64, 64),
        "triton launcher + cuLaunchKernel": lambda: compiled.run(bound.grid, 1, 1, stream, compiled.function,
                                                                 compiled.packed_metadata, None, None, None, *args),
        "BoundLaunch (direct path)": lambda: bound(*head),
        "attn_fwd (whole launcher)": lambda: attn_fwd(q, k, v, rows, geom, False, 0.125, plans),
        "attn_fwd (no plan cache)": lambda: attn_fwd(q, k, v, rows, geom, False, 0.125),
    }
    return {f"part: {name} ({len(args)} args)": host_us(f, reps=300, warmup=20) for name, f in parts.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="host.json")
    args = parser.parse_args()
    from torch.nn.attention.flex_attention import flex_attention

    B, H, N, D = 1, 2, 1024, 64
    mask = masks.butterfly(N, 128, device="cuda")
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    do = torch.randn_like(q)
    idx = mask.kernel_index(False)
    rows, cols = idx.rows(), idx.cols()
    geom = [*mask.shape, *mask.block_size, int(mask.has_long_lists(False))]
    plans = {}
    out, lse = attn_fwd(q.detach(), k.detach(), v.detach(), rows, geom, False, 0.125)
    x = torch.empty(10, device="cuda")

    def api():
        return sparse_flash.block_sparse_attention(q, k, v, mask, backend="triton")

    def api_no_grad():
        with torch.no_grad():
            return api()

    flex = torch.compile(flex_attention, dynamic=False)
    fm = mask.to_flex(False, eager_exact=False)
    steps = {
        "tiny torch kernel": lambda: x.add_(1),
        "launcher fwd": lambda: attn_fwd(q, k, v, rows, geom, False, 0.125, plans),
        "launcher bwd": lambda: attn_bwd(do, q, k, v, out, lse, rows + cols, geom, False, 0.125, plans),
        "api fwd no_grad": api_no_grad,
        "api fwd+bwd": lambda: api().backward(do),
        "autograd only": lambda: (q * 1).backward(do),
    }
    results = launcher_parts(q.detach(), k.detach(), v.detach(), rows, geom)
    for fast in (False, True):
        set_fast_launch(fast)
        for name, step in steps.items():
            results[f"{name} (fast launch {'on' if fast else 'off'})"] = host_us(step, reps=300, warmup=20)
    previous = set_tma(False)  # pointer loads: no descriptors to build on the host
    for name in ("launcher fwd", "launcher bwd", "api fwd no_grad", "api fwd+bwd"):
        results[f"{name} (fast launch on, pointer loads)"] = host_us(steps[name], reps=300, warmup=20)
    set_tma(previous)
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
        print(f"{name:36} {us:8.1f} us")


if __name__ == "__main__":
    main()

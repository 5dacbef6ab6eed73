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
from profile_rows import host_us
from sparse_flash import masks
from sparse_flash.kernels import settings
from sparse_flash.kernels.dispatch import attn_bwd, attn_fwd


def launcher_parts(q, k, v, index, geometry) -> dict:
    """Host microseconds of the pieces of one forward launch (the Triton forward, which serves this D=64
    problem): the plan's key, allocation, descriptors, Triton's launcher (argument packing and
    cuLaunchKernel) called directly, and the whole launcher."""
    from sparse_flash.kernels import launch as launch_module
    from sparse_flash.kernels.triton.fwd import FwdPlan
    from sparse_flash.kernels.triton.tma import make_descriptor, tile_descriptor

    plans = {}
    attn_fwd(q, k, v, index, geometry, False, 0.125, plans)
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
        "plan key": lambda: launch_module.plan_key((q, k, v), "fwd", False, 0.125),
        "torch.empty (out)": lambda: torch.empty(q.shape, dtype=q.dtype, device=q.device),
        "make_descriptor (one)": lambda: make_descriptor(k, plan.k_layout),
        "tile_descriptor (one, with checks)": lambda: tile_descriptor(k, 64, 64),
        "triton launcher + cuLaunchKernel": lambda: compiled.run(bound.grid, 1, 1, stream, compiled.function,
                                                                 compiled.packed_metadata, None, None, None, *args),
        "BoundLaunch (direct path)": lambda: bound(*head),
        "attn_fwd (whole launcher)": lambda: attn_fwd(q, k, v, index, geometry, False, 0.125, plans),
        "attn_fwd (no plan cache)": lambda: attn_fwd(q, k, v, index, geometry, False, 0.125),
    }
    return {f"part: {name} ({len(args)} args)": host_us(f, reps=300, warmup=20) for name, f in parts.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="host.json")
    args = parser.parse_args()
    from torch.nn.attention.flex_attention import flex_attention

    B, H, N, D = 1, 2, 1024, 64
    mask = masks.butterfly(N, 128, device="cuda")
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    do = torch.randn_like(q)
    index, geometry = mask._records(False)  # the lists themselves, as the kernels get them
    plans = {}
    out, lse = attn_fwd(q.detach(), k.detach(), v.detach(), index, geometry, False, 0.125)
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
        "launcher fwd": lambda: attn_fwd(q, k, v, index, geometry, False, 0.125, plans),
        "launcher bwd": lambda: attn_bwd(do, q, k, v, out, lse, index, geometry, False, 0.125, plans),
        "api fwd no_grad": api_no_grad,
        "api fwd+bwd": lambda: api().backward(do),
        "autograd only": lambda: (q * 1).backward(do),
    }
    results = launcher_parts(q.detach(), k.detach(), v.detach(), index, geometry)
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
        print(f"{name:36} {us:8.1f} us")


if __name__ == "__main__":
    main()

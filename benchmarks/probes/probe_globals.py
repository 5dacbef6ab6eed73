"""Where the forward spends its time on BigBird and Longformer (NOTES step 44).

Times the forward, Hopper kernel and Triton kernel, on each benchmark mask and on variants of it without
its global row or column (1 x 16 heads x 16,384 tokens, D=128, bf16), and lists the time of each CUDA
kernel of a call (the main kernel, the merge of split lists). Run from the repository root on a GPU:

    OUT=out PYTHONPATH=. python benchmarks/probes/probe_globals.py
"""

import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_attention import build_mask  # noqa: E402

from sparse_flash import BlockMask  # noqa: E402
from sparse_flash.kernels import configs, fwd  # noqa: E402

N, B, H, D = 16384, 1, 16, 128
M = N // 128  # mask blocks per side


def variants() -> dict:
    """name -> block layout (M, M) or (1, 1, M, M), or None for the dense path."""
    longformer = build_mask("longformer", N, "cuda")[0].layout.bool()
    bigbird = build_mask("bigbird", N, "cuda")[0].layout.bool()
    row0 = torch.zeros(M, M, dtype=torch.bool, device="cuda")
    row0[0] = True
    col0 = torch.zeros(M, M, dtype=torch.bool, device="cuda")
    col0[:, 0] = True
    diagonal = torch.eye(M, dtype=torch.bool, device="cuda")
    return {
        "longformer": longformer,
        "lf-no-global-row": longformer & ~row0 | (longformer & row0 & col0),
        "lf-no-global-col": longformer & ~col0 | (longformer & row0),
        "lf-window-only": longformer & ~row0 & ~col0 | diagonal,
        "bigbird": bigbird,
        "bb-no-global-row": bigbird & ~row0 | (bigbird & row0 & col0),
        "local4": build_mask("local", N, "cuda")[0].layout.bool(),
        "dense": None,
    }


def kernel_times(call, repeats=5) -> dict:
    """Milliseconds per call of each CUDA kernel the call launches (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            call()
        torch.cuda.synchronize()
    return {e.key[:40]: round(e.device_time_total / repeats / 1000, 4) for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA}


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    results = []
    for name, layout in variants().items():
        for hopper in (True, False):
            configs.set_hopper_forward(hopper)
            if layout is None:
                rows, geometry, tiles = [], [1, 1, 1, 1, 128, 128, 0], H * M * M
            else:
                mask = BlockMask.from_layout(layout, 128)
                rows = mask.kernel_index(False).rows()
                geometry = [*mask.shape, *mask.block_size, int(mask.has_long_lists(False))]
                tiles = int(layout.sum()) * H  # one layout shared by the heads
            plans = {}
            call = lambda: fwd.attn_fwd(q, k, v, rows, geometry, False, D**-0.5, plans)  # noqa: E731
            call()
            ms = min(do_bench(call, warmup=25, rep=100, return_mode="median") for _ in range(3))
            r = dict(name=name, hopper=hopper, ms=ms, tiles=tiles, us_per_tile_per_sm=ms * 1000 * 132 / tiles,
                     split=bool(len(rows) and rows[8].shape[0]), kernels=kernel_times(call))
            print(r, flush=True)
            results.append(r)
    with open(os.path.join(os.environ.get("OUT", "."), "globals.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"{'mask':18} {'hopper':6} {'ms':>7} {'tiles':>7} {'us/tile/SM':>10}")
    for r in results:
        print(f"{r['name']:18} {str(r['hopper']):6} {r['ms']:7.3f} {r['tiles']:7d} {r['us_per_tile_per_sm']:10.2f}")


if __name__ == "__main__":
    main()

"""Time the forward of copies of the package against the working tree's, interleaved, on the same inputs.

For kernel variants too rough to keep behind a switch (NOTES step 44: a variant without the O store, one
with item records loaded ahead): each argument is a folder holding a modified `sparse_flash` package,
imported under its own name. Rows: 16,384 tokens (1 x 16 heads) and 4,096 tokens (4 x 16 heads), D=128,
bf16, the benchmark's sparse masks and a band of 3 blocks per row. Run from the repository root on a GPU:

    mkdir -p var_base && git archive HEAD sparse_flash | tar -x -C var_base
    OUT=out PYTHONPATH=. python benchmarks/probes/probe_variants.py var_base

Prints each row's fastest time per version and the working tree's time divided by it.
"""

import importlib
import json
import os
import sys
import types

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_attention import build_mask  # noqa: E402

from sparse_flash import BlockMask  # noqa: E402


def load_forward(name: str, path: str):
    """The forward launcher module of the package copy in `path`, imported as `name` without running its
    package `__init__` files (they would register the library's custom ops a second time)."""
    for module, folder in ((name, path), (name + ".kernels", os.path.join(path, "kernels"))):
        package = types.ModuleType(module)
        package.__path__ = [folder]
        sys.modules[module] = package
    return importlib.import_module(name + ".kernels.fwd")


def rows() -> list:
    """(N, B, H, mask name, mask) of the rows timed."""
    out = []
    for N, B, H in ((16384, 1, 16), (4096, 4, 16)):
        for name in ("window", "local", "longformer", "bigbird", "random", "butterfly"):
            if name == "window":  # 3 blocks per row: the shortest lists
                diagonal = torch.eye(N // 128, dtype=torch.bool, device="cuda")
                mask = BlockMask.from_layout(diagonal | diagonal.roll(1, 0) | diagonal.roll(-1, 0), 128)
            else:
                mask = build_mask(name, N, "cuda")[0]
            out.append((N, B, H, name, mask))
    return out


def main():
    versions = {"head": importlib.import_module("sparse_flash.kernels.fwd")}
    for folder in sys.argv[1:]:
        versions[folder] = load_forward("sf_" + folder, os.path.join(folder, "sparse_flash"))
    results = []
    for N, B, H, name, mask in rows():
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, N, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        index = mask.kernel_index(False).rows()
        geometry = [*mask.shape, *mask.block_size, int(mask.has_long_lists(False))]
        calls = {}
        for tag, module in versions.items():
            plans = {}  # each version keeps its launch plan, as the library does per mask
            calls[tag] = (lambda m=module, p=plans: m.attn_fwd(q, k, v, index, geometry, False, 128**-0.5, p))
            calls[tag]()
        times = {tag: [] for tag in calls}
        for round_ in range(3):  # alternate the order of the versions between rounds
            for tag in (list(calls) if round_ % 2 == 0 else list(calls)[::-1]):
                times[tag].append(do_bench(calls[tag], warmup=25, rep=100, return_mode="median"))
        r = dict(N=N, B=B, H=H, mask=name, ms={t: min(x) for t, x in times.items()}, runs=times)
        print(r, flush=True)
        results.append(r)
    with open(os.path.join(os.environ.get("OUT", "."), "variants.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"{'row':22}" + "".join(f"{t:>14}" for t in versions))
    for r in results:
        base = r["ms"]["head"]
        print(f"{r['N']:6} {r['mask']:15}" + "".join(f"{r['ms'][t]:8.3f} {base / r['ms'][t]:5.3f}" for t in versions))


if __name__ == "__main__":
    main()

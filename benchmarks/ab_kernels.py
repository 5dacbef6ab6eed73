"""A/B timing of kernel variants in one process, on the benchmark's rows and the same inputs.

Before a kernel change is kept, both versions run interleaved (base, new, new, base; `--repeats` rounds,
after one round thrown away) and each keeps its fastest `do_bench` median and the median of its runs; the
ratios base/new are the change's gain. Three ways to name the versions:

    # a saved copy of the Triton forward launcher against the current one (forward only); with
    # --base-family gluon, a saved gluon/fwd.py (rows that the Gluon forward does not serve are skipped)
    git show HEAD:sparse_flash/kernels/triton/fwd.py > benchmarks/_fwd_base.py
    python benchmarks/ab_kernels.py --base benchmarks/_fwd_base.py --out ab.json
    # a kernel setting (`sparse_flash.kernels.settings`) off (base) against on (new), the library choosing
    # the kernels as it does (`dispatch.py`): pointer loads against TMA descriptor loads, forward and backward
    python benchmarks/ab_kernels.py --switch tma --out ab.json
    # the Triton forward (base) against the Hopper forward (new) where it serves; or, for masks with split
    # lists, the Triton forward (base) against the Hopper forward's split-list path (new)
    python benchmarks/ab_kernels.py --switch hopper --out ab.json
    python benchmarks/ab_kernels.py --switch hopper-split --rows "bigbird|longformer" --out ab.json
    # the Hopper kernels' items taken in turn by their programs (base) against balanced by load (new),
    # forward and backward (the Hopper dQ and dK/dV kernels place their items the same way)
    python benchmarks/ab_kernels.py --switch hopper-balance --out ab.json
    # the Triton backward kernels (base) against the Hopper dQ and dK/dV kernels (new), backward only
    python benchmarks/ab_kernels.py --switch hopper-bwd --rows "128" --out ab.json
    # at head dim 64: the Triton kernels (base) against the Hopper ones (new), forward and backward
    python benchmarks/ab_kernels.py --switch hopper-d64 --rows ",64," --out ab.json
    # the two Hopper backward passes (base) against the one-pass backward (new) where it serves; and, with
    # --switch deterministic, dQ added in any order (base: the dense non-causal rows take the one-pass kernel)
    # against the default (new)
    python benchmarks/ab_kernels.py --switch hopper-one-pass --out ab.json
    # the dense non-causal rows on the two Hopper passes (base) against the one-pass kernel (new, the default)
    python benchmarks/ab_kernels.py --switch hopper-one-pass-dense --rows "dense,false" --out ab.json
    # a saved copy of the whole package, of HEAD or of any older commit, against the current one, forward
    # and backward, each through its own package's public entry (`block_sparse_attention(...,
    # backend="triton")`: each side's API host time counts too)
    mkdir -p /tmp/base && git archive HEAD sparse_flash | tar -x -C /tmp/base
    python benchmarks/ab_kernels.py --base-package /tmp/base/sparse_flash --out ab.json

Each version keeps its launch plans per row, as the library keeps them per mask (a package copy keeps its
own), so the timings are those of repeated calls (no plan built inside the timed call).

Each step of a row (its compiles and first calls per version, each pass's timing) prints a line with the
seconds since the start, and `--row-timeout S` ends the run once one row has taken S seconds, printing every
thread's Python stack first: a kernel that never returns shows as a stack waiting on the device, a slow
compile as one inside Triton's compiler.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

import sparse_flash
from bench_attention import build_mask  # the benchmark's masks (run from benchmarks/)
from sparse_flash.kernels import dispatch, settings

# (B, Hq, Hkv, N, D, mask, causal); "dense" is the all-ones mask (dense path)
ROWS = [(4, 16, 16, 4096, 128, m, False) for m in ("dense", "local", "butterfly", "random", "bigbird")] + [
    (4, 16, 16, 4096, 128, "dense", True), (4, 32, 8, 4096, 128, "butterfly", False)] + [
    (1, 16, 16, 16384, 128, m, False) for m in ("dense", "local", "butterfly", "random", "bigbird", "longformer")] + [
    (1, 8, 8, 65536, 64, m, False) for m in ("dense", "local", "butterfly", "random", "bigbird", "longformer")] + [
    (4, 16, 16, 4096, 64, m, False) for m in ("butterfly", "random")] + [
    (1, 16, 16, 16384, 128, "local16", False)]  # long lists at D=128: 31 blocks per row (tuning log, step 39)

# --switch: the setting each name turns off (base) and on (new), and the passes it changes
SWITCHES = {"tma": ("tma", ("fwd", "bwd")), "hopper": ("hopper_forward", ("fwd",)),
            "hopper-split": ("hopper_split", ("fwd",)), "hopper-balance": ("hopper_balance", ("fwd", "bwd")),
            "hopper-bwd": ("hopper_backward", ("bwd",)), "hopper-d64": ("hopper_d64", ("fwd", "bwd")),
            "hopper-one-pass": ("hopper_one_pass", ("bwd",)),
            "hopper-one-pass-dense": ("hopper_one_pass_dense", ("bwd",)), "deterministic": ("deterministic", ("bwd",))}
BASE_PACKAGE = "sparse_flash_base"  # the name a saved package copy is imported under


def kernel_records(mask, causal: bool):
    """The mask's lists and geometry as its kernels get them: the tensors themselves (`_records`), not the
    read-only views handed to users, whose dispatch would add host time to every version's calls alike (masks
    of packages before 2026-12-02 have no `_records`)."""
    records = getattr(mask, "_records", None)
    return records(causal) if records is not None else mask.kernel_records(causal)


def parse_row(text: str) -> tuple:
    """`B,Hq,Hkv,N,D,MASK,CAUSAL` (MASK a benchmark mask name or local<w>, CAUSAL true or false) as a row."""
    parts = [p.strip() for p in text.split(",")]
    try:
        if len(parts) != 7 or parts[6].lower() not in ("true", "false"):
            raise ValueError
        B, Hq, Hkv, N, D = (int(p) for p in parts[:5])
    except ValueError:
        raise argparse.ArgumentTypeError(f"a row is B,Hq,Hkv,N,D,MASK,CAUSAL such as 1,16,16,16384,64,dense,true; "
                                         f"got {text!r}") from None
    return (B, Hq, Hkv, N, D, parts[5], parts[6].lower() == "true")


def row_mask(name: str, N: int, device="cuda"):
    """The benchmark's mask of that name, or for `local<w>` a local mask of window w (block 128)."""
    if name.startswith("local") and name[5:].isdigit():
        return sparse_flash.masks.local(N, 128, window=int(name[5:]), device=device)
    return build_mask(name, N, device)[0]


def load_base(path: str, family: str = "triton"):
    """A saved forward launcher module of `family`, loaded inside `sparse_flash.kernels.<family>` so that its
    relative imports resolve (a copy from the current layout)."""
    spec = importlib.util.spec_from_file_location(f"sparse_flash.kernels.{family}._fwd_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rename_base_ops() -> None:
    """Make the custom ops that a saved package registers take the namespace `sparse_flash_base` (the current
    package holds `sparse_flash::attn_fwd` and `sparse_flash::attn_bwd`; a second registration would fail).
    Every version of the package registers them with `torch.library.custom_op("sparse_flash::...")`, called
    from the module that defines them, whose name tells the two packages apart."""
    define = torch.library.custom_op
    if getattr(define, "renames_base_ops", False):
        return

    def custom_op(name, *args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.split(".")[0] == BASE_PACKAGE and name.startswith("sparse_flash::"):
            name = BASE_PACKAGE + name[len("sparse_flash"):]
        return define(name, *args, **kwargs)

    custom_op.renames_base_ops = True
    torch.library.custom_op = custom_op


def load_base_package(path: str):
    """A saved copy of the sparse_flash package folder (from any commit), imported whole as
    `sparse_flash_base`: its public entry, BlockMask and kernels, beside the current package."""
    _rename_base_ops()
    spec = importlib.util.spec_from_file_location(BASE_PACKAGE, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    package = importlib.util.module_from_spec(spec)
    sys.modules[BASE_PACKAGE] = package
    spec.loader.exec_module(package)
    return package


class Launchers:
    """A version that calls kernel launchers on a mask's index lists, under kernel settings (`switches`)."""

    def __init__(self, forward=None, backward=None, **switches):
        self.launch_fwd, self.launch_bwd, self.switches = forward, backward, switches

    def context(self):
        return settings.override(**self.switches)

    def calls(self, mask, causal, q, k, v, do):
        """(forward, backward) of one row, each a call with no arguments, or None for a pass not compared.
        The backward takes the library's forward output (default settings), the same for every version."""
        index, geometry = kernel_records(mask, causal)
        scale, plans = q.shape[-1] ** -0.5, {}  # this version's launch plans for this row
        out, lse = dispatch.attn_fwd(q, k, v, index, geometry, causal, scale) if self.launch_bwd else (None, None)

        def forward():
            return self.launch_fwd(q, k, v, index, geometry, causal, scale, plans)[0]

        def backward():
            return self.launch_bwd(do, q, k, v, out, lse, index, geometry, causal, scale, plans)

        return forward if self.launch_fwd else None, backward if self.launch_bwd else None


class PublicEntry:
    """A version that calls a package's `block_sparse_attention(..., backend="triton")`: the forward without
    grad, the backward as `torch.autograd.grad` of one forward output (graph kept, so no forward is timed)."""

    def __init__(self, package):
        self.package = package

    def context(self):
        return contextlib.nullcontext()

    def calls(self, mask, causal, q, k, v, do):
        if not isinstance(mask, self.package.BlockMask):  # the mask as this package builds it
            mask = self.package.BlockMask.from_layout(mask.layout.clone(), mask.block_size,
                                                      seq_len_q=mask.seq_len_q, seq_len_k=mask.seq_len_k)
        entry = self.package.block_sparse_attention

        def forward():
            with torch.no_grad():
                return entry(q, k, v, mask, causal=causal, backend="triton")

        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = entry(*leaves, mask, causal=causal, backend="triton")
        return forward, lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)


def time_versions(calls: dict, contexts: dict, repeats: int, do_bench) -> dict:
    """`do_bench` medians (ms) of each version's call (inside its context), in rounds of (base, new, new,
    base). One round before them is thrown away: the GPU runs its first timing after an idle spell at
    higher clocks."""
    times = {tag: [] for tag in calls}
    for i, tag in enumerate(("base", "new") + ("base", "new", "new", "base") * repeats):
        with contexts[tag]():
            ms = do_bench(calls[tag], warmup=25, rep=100, return_mode="median")
        if i >= 2:
            times[tag].append(ms)
    return times


def max_diff(results: dict) -> float:
    """The largest elementwise difference between the base and new results (a tensor or a tuple of them)."""
    pairs = zip(*(r if isinstance(r, (tuple, list)) else (r,) for r in (results["base"], results["new"])))
    return max(float((a.float() - b.float()).abs().max()) for a, b in pairs)


def ab_record(row, dtype, pass_, times, diff) -> dict:
    """One result: each version's fastest and median timing, and the gains base/new of both."""
    r = {"row": row, "dtype": dtype, "pass": pass_, "base_ms": min(times["base"]), "new_ms": min(times["new"]),
         "runs_ms": times, "max_diff": diff}
    r["gain"] = r["base_ms"] / r["new_ms"]
    r["median_gain"] = statistics.median(times["base"]) / statistics.median(times["new"])
    print(r, flush=True)
    return r


def run_row(versions: dict, row, dtype, repeats: int, do_bench, device="cuda", supported=None) -> list[dict]:
    """The records of one row: each pass that the versions compare, timed interleaved. `supported(q, k, v,
    index, geometry)`, where given, says whether the row can run at all (else it is skipped)."""
    B, Hq, Hkv, N, D, name, causal = row
    mask = row_mask(name, N, device)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, Hq, N, D, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(B, Hkv, N, D, device=device, dtype=dtype, generator=gen) for _ in range(2))
    do = torch.randn(q.shape, device=device, dtype=dtype, generator=gen)
    if supported is not None and not supported(q, k, v, *kernel_records(mask, causal)):
        print(f"skipped {list(row)}: the base's kernel family does not serve it", flush=True)
        return []
    contexts = {tag: version.context for tag, version in versions.items()}
    calls = {}
    for tag, version in versions.items():
        progress(f"{list(row)}: {tag}: compiles and first calls")
        calls[tag] = version.calls(mask, causal, q, k, v, do)
    records = []
    for i, pass_ in enumerate(("fwd", "bwd")):
        timed = {tag: c[i] for tag, c in calls.items()}
        if any(c is None for c in timed.values()):
            continue
        results = {}
        for tag, call in timed.items():
            progress(f"{list(row)} {pass_}: {tag}: first call")
            with contexts[tag]():
                results[tag] = call()
            torch.cuda.synchronize(device)
        progress(f"{list(row)} {pass_}: timing")
        records.append(ab_record([B, Hq, Hkv, N, D, name, causal], str(dtype).removeprefix("torch."), pass_,
                                 time_versions(timed, contexts, repeats, do_bench), max_diff(results)))
    return records


_START = time.perf_counter()


def progress(step: str) -> None:
    """One line per step of a row, with the seconds since the start (a run cut by its time limit shows where)."""
    print(f"[{time.perf_counter() - _START:7.1f} s] {step}", flush=True)


def versions_of(args) -> tuple[dict, object]:
    """The two versions that the arguments name, and the row filter of `run_row` (`supported`)."""
    if args.base:
        family = importlib.import_module(f"sparse_flash.kernels.{args.base_family}.fwd")
        base = load_base(args.base, args.base_family)
        # the family's launcher is called directly: hopper settings (dispatch's choice) do not apply
        supported = getattr(family, "supported", None)
        return {"base": Launchers(base.attn_fwd), "new": Launchers(family.attn_fwd)}, supported
    if args.base_package:
        return {"base": PublicEntry(load_base_package(args.base_package)), "new": PublicEntry(sparse_flash)}, None
    field, passes = SWITCHES[args.switch]
    launchers = (dispatch.attn_fwd if "fwd" in passes else None, dispatch.attn_bwd if "bwd" in passes else None)
    return {"base": Launchers(*launchers, **{field: False}), "new": Launchers(*launchers, **{field: True})}, None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="a saved copy of sparse_flash/kernels/triton/fwd.py (or gluon/fwd.py)")
    parser.add_argument("--base-family", choices=["triton", "gluon"], default="triton",
                        help="--base: the kernel family of the saved forward launcher")
    parser.add_argument("--base-package", help="a saved copy of the sparse_flash package folder (any commit)")
    parser.add_argument("--switch", choices=sorted(SWITCHES),
                        help="time the library with a setting off (base) and on (new)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--rows", help="only rows whose text B,Hq,Hkv,N,D,MASK,CAUSAL (as --row spells it, e.g. "
                        "1,8,8,65536,64,dense,false) contains one of these ('|'-separated, any case)")
    parser.add_argument("--row", action="append", type=parse_row, default=[], metavar="B,Hq,Hkv,N,D,MASK,CAUSAL",
                        help="a row outside the benchmark's, e.g. 1,16,16,16384,64,dense,true (repeatable; with "
                        "--row only those rows run)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of (base, new, new, base) timings per row")
    parser.add_argument("--row-timeout", type=float, default=0.0,
                        help="seconds one row may take before the run ends with every thread's stack (0: none)")
    parser.add_argument("--out", default="ab.json")
    args = parser.parse_args()
    if sum(a is not None for a in (args.base, args.base_package, args.switch)) != 1:
        parser.error("give exactly one of --base, --base-package and --switch")
    from triton.testing import do_bench

    versions, supported = versions_of(args)
    rows = args.row or ROWS
    def text(row):  # as --row spells a row: B,Hq,Hkv,N,D,MASK,CAUSAL, lower case
        return ",".join(str(x) for x in row).lower()

    chosen = [r for r in rows if args.rows is None or any(p.lower() in text(r) for p in args.rows.split("|"))]
    results = []
    for row in chosen:  # the results file rewritten after every row: a run cut by its time limit keeps its rows
        if args.row_timeout > 0:  # a hung kernel never returns: the stacks say where the run waits
            faulthandler.dump_traceback_later(args.row_timeout, exit=True)
        done = run_row(versions, row, getattr(torch, args.dtype), args.repeats, do_bench, supported=supported)
        faulthandler.cancel_dump_traceback_later()
        results += done
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        for r in done:
            print(f"{str(r['row'])} {r['pass']}: base {r['base_ms']:.3f} ms, new {r['new_ms']:.3f} ms, "
                  f"gain {r['gain']:.3f}", flush=True)
    print(f"{'row':44} {'pass':4} {'base ms':>8} {'new ms':>8} {'gain':>6} {'median gain':>11} {'max diff':>9}")
    for r in results:
        print(f"{str(r['row']):44} {r['pass']:4} {r['base_ms']:8.3f} {r['new_ms']:8.3f} {r['gain']:6.3f} "
              f"{r['median_gain']:11.3f} {r['max_diff']:9.2e}")


if __name__ == "__main__":
    main()

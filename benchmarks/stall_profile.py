"""Where a kernel's warps wait, instruction by instruction: Nsight Compute's warp-state sampling of one call.

Runs one benchmark row's forward (or forward and backward) under `ncu` with the source counters, profiles one
launch of the kernels whose name matches `--kernel` (after `--skip` launches of them, so caches and clocks are
warm), and writes to `--out`:

- `<label>.ncu-rep`: the report (open it in Nsight Compute's GUI for the source view);
- `<label>_sass.csv`: its source page, one row per SASS instruction with its sampled warp states;
- `<label>_details.csv`: the sections' metrics (duration, throughputs, occupancy);
- a summary printed last: the samples per opcode family (barrier waits, tensor-core products, exponentials,
  global loads, ...) and the instructions that hold the most samples, with their stall reasons where the
  report names them.

A kernel's time outside its hot loop (a Hopper kernel's per-item work: record loads, the first product, the
store) shows as samples on instructions outside the loop; `benchmarks/kernel_resources.py` finds the loop in
the same SASS.

    python benchmarks/stall_profile.py --row 1,8,8,65536,64,longformer,false --out prof/
    python benchmarks/stall_profile.py --row 1,16,16,16384,128,random,false --pass bwd --kernel dkdv --out prof/

Needs a CUDA machine with `ncu` that can read the hardware counters (run it with the clocks left alone:
`--clock-control none`).
"""

from __future__ import annotations

import argparse
import collections
import csv
import glob
import io
import os
import shutil
import subprocess
import sys

from kernel_resources import hot_loop

FAMILIES = [  # (family, opcode prefixes), first match wins
    ("barrier wait (mbarrier)", ("SYNCS",)),
    ("tensor-core product", ("HGMMA", "WARPGROUP", "WARPSYNC")),
    ("exponential (MUFU)", ("MUFU",)),
    ("global load", ("LDG", "LD.")),
    ("global store", ("STG", "ST.", "RED", "ATOM")),
    ("shared memory", ("LDS", "STS", "LDSM", "STSM")),
    ("TMA", ("UTMA", "UBLKCP")),
    ("block barrier", ("BAR",)),
    ("branch", ("BRA", "BSSY", "BSYNC", "EXIT", "RET", "CALL")),
]


def find_ncu() -> str:
    """The `ncu` on PATH, else the newest under /opt/nvidia or a CUDA install."""
    found = shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu")
                                                    + glob.glob("/usr/local/cuda*/bin/ncu"), reverse=True)), None)
    if not found:
        raise SystemExit("stall_profile: no ncu on this machine (PATH, /opt/nvidia/nsight-compute, /usr/local/cuda)")
    return found


def run_row(row: tuple, pass_: str, calls: int) -> None:
    """The row's pass `calls` times (run under ncu, which profiles the matching launches)."""
    import torch

    import sparse_flash
    from ab_kernels import row_mask

    B, Hq, Hkv, N, D, name, causal = row
    mask = row_mask(name, N)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=pass_ == "bwd")
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=gen,
                        requires_grad=pass_ == "bwd") for _ in range(2))
    for _ in range(calls):
        out = sparse_flash.block_sparse_attention(q, k, v, mask, causal=causal, backend="triton")
        if pass_ == "bwd":
            out.backward(torch.ones_like(out))
    torch.cuda.synchronize()


def family(source: str) -> str:
    """The opcode family of one SASS line (its predicate left out)."""
    words = source.split()
    op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")
    return next((name for name, prefixes in FAMILIES if op.startswith(prefixes)), "other")


def instruction(address: str, source: str) -> tuple[int, str, str, bool]:
    """`(address, opcode, operands, guarded)` of one SASS row, as `kernel_resources.hot_loop` takes them."""
    words = source.split(None, 1)
    guarded = bool(words) and words[0].startswith("@")
    op, _, rest = (words[1] if guarded and len(words) > 1 else source.strip()).partition(" ")
    try:
        where = int(str(address).strip(), 0)
    except ValueError:
        where = -1
    return where, op, rest, guarded


def regions(rows: list[dict], executed: str, samples: str) -> list[tuple[int, int, float, float]]:
    """`(first, last, executions, samples)` of each run of consecutive instructions with the same execution
    count: the basic blocks of one loop body or of one per-item stretch group together, so the samples of a
    kernel's per-item work show beside its loop's."""
    def number(row, column) -> float:
        try:
            return float(str(row.get(column) or 0).replace(",", ""))
        except ValueError:
            return 0.0

    out = []
    for i, row in enumerate(rows):
        count, n = number(row, executed), number(row, samples)
        if out and out[-1][2] == count:
            out[-1] = (out[-1][0], i, count, out[-1][3] + n)
        else:
            out.append((i, i, count, n))
    return out


def summarize(sass_csv: str, top: int) -> str:
    """Samples per opcode family and the `top` instructions by samples, from the source page's CSV."""
    lines = open(sass_csv).read().splitlines()
    # ncu may print notes and a line naming the kernel before the table: it starts at the header naming Source
    start = next((i for i, line in enumerate(lines) if '"Source"' in line), 0)
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    if not rows:
        return f"no rows in {sass_csv}"
    columns = [c for c in rows[0] if c]  # a trailing comma makes a column without a name
    source = next((c for c in columns if c.strip().lower() == "source"), None)
    samples = next((c for c in columns if "Sampling" in c and "All" in c), None)
    not_issued = next((c for c in columns if "Sampling" in c and "Not" in c), None)
    # stall reasons: `stall_<reason>` (ncu 2025) or `smsp__pcsamp_warps_issue_stalled_<reason>` (older)
    reasons = [c for c in columns if c.startswith(("stall_", "smsp__pcsamp_warps_issue_stalled"))
               and "not_issued" not in c.lower().replace(" ", "_")]
    if source is None or samples is None:
        return f"columns not recognised in {sass_csv}: {columns}"

    def number(row, column) -> float:
        try:
            return float(str(row.get(column) or 0).replace(",", ""))
        except ValueError:
            return 0.0

    total = sum(number(r, samples) for r in rows) or 1.0
    by_family = collections.Counter()
    for r in rows:
        by_family[family(r[source])] += number(r, samples)
    lines = [f"{len(rows)} instructions, {total:.0f} samples ({samples})"]
    address = next((c for c in columns if "Address" in c), None)
    span = hot_loop([instruction(r[address], r[source]) for r in rows]) if address else None
    if span is None:
        lines.append("hot loop: not found (no branch back over products and exponentials)")
    else:
        inside = sum(number(r, samples) for r in rows[span[0]:span[1] + 1])
        lines.append(f"hot loop: instructions {span[0]}-{span[1]}, {inside / total:.1%} of the samples "
                     f"({1 - inside / total:.1%} outside it: per-item work, waits, the other warps' roles)")
    executed = next((c for c in columns if c == "Instructions Executed"), None)
    if executed:
        lines += ["", "regions (runs of instructions executed equally often: per tile, per item, once) with >= 1% of "
                  "the samples", f"{'instructions':>13} {'executed':>10} {'samples':>8} {'share':>6}  first"]
        for first, last, count, n in regions(rows, executed, samples):
            if n >= 0.01 * total:
                lines.append(f"{first:6d}-{last:<6d} {count:10.0f} {n:8.0f} {n / total:6.1%}  "
                             f"{rows[first][source].strip()[:50]}")
    lines += ["", f"{'family':28} {'samples':>8} {'share':>6}"]
    lines += [f"{name:28} {n:8.0f} {n / total:6.1%}" for name, n in by_family.most_common()]
    lines += ["", f"{'index':>5} {'samples':>8} {'share':>6} {'not issued':>10}  instruction  [largest stall reasons]"]
    ranked = sorted(range(len(rows)), key=lambda i: -number(rows[i], samples))[:top]
    for i in ranked:
        r = rows[i]
        why = sorted(((number(r, c), c.replace("smsp__pcsamp_warps_issue_stalled_", "").replace("stall_", "")) for c in reasons),
                     reverse=True)[:2]
        why_text = ", ".join(f"{c} {n:.0f}" for n, c in why if n)
        issued = f"{number(r, not_issued):10.0f}" if not_issued else f"{'-':>10}"
        lines.append(f"{i:5d} {number(r, samples):8.0f} {number(r, samples) / total:6.1%} {issued}  "
                     f"{r[source].strip()[:70]}  [{why_text}]")
    return "\n".join(lines)


def main():
    from ab_kernels import parse_row

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row", type=parse_row, required=True, metavar="B,Hq,Hkv,N,D,MASK,CAUSAL")
    parser.add_argument("--pass", dest="pass_", choices=("fwd", "bwd"), default="fwd",
                        help="the forward alone, or forward and backward (default fwd)")
    parser.add_argument("--kernel", default="attn_fwd_hopper", help="a part of the profiled kernel's name "
                        "(default attn_fwd_hopper; e.g. dkdv, dq_hopper, one_pass)")
    parser.add_argument("--skip", type=int, default=3, help="matching launches left unprofiled first (default 3)")
    parser.add_argument("--top", type=int, default=30, help="instructions listed (default 30)")
    parser.add_argument("--out", required=True, help="folder for the report, its CSV pages and the summary")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the run that ncu profiles
    args = parser.parse_args()
    if args.child:
        run_row(args.row, args.pass_, args.skip + 1)
        return
    os.makedirs(args.out, exist_ok=True)
    ncu = find_ncu()
    B, Hq, Hkv, N, D, name, causal = args.row
    label = f"{args.kernel}_{name}_{N}_d{D}{'_causal' if causal else ''}_{args.pass_}"
    report = os.path.join(args.out, label)
    child = [sys.executable, os.path.abspath(__file__), "--child", "--row", ",".join(map(str, args.row)),
             "--pass", args.pass_, "--skip", str(args.skip), "--out", args.out]
    profile = [ncu, "--clock-control", "none", "--target-processes", "all", "--kernel-name", f"regex:{args.kernel}",
               "--launch-skip", str(args.skip), "--launch-count", "1", "--section", "SourceCounters",
               "--section", "WarpStateStats", "--section", "SpeedOfLight", "--section", "LaunchStats",
               "--import-source", "no", "-f", "-o", report, *child]
    print(" ".join(profile), flush=True)
    done = subprocess.run(profile, text=True, capture_output=True)
    with open(report + "_ncu.log", "w") as f:
        f.write(done.stdout + done.stderr)
    if done.returncode or not os.path.exists(report + ".ncu-rep"):
        raise SystemExit(f"stall_profile: ncu exited {done.returncode}; its log: {report}_ncu.log\n"
                         + (done.stdout + done.stderr)[-3000:])
    for page, extra in (("source", ["--print-source", "sass"]), ("details", [])):
        with open(f"{report}_{'sass' if page == 'source' else page}.csv", "w") as f:
            subprocess.run([ncu, "-i", report + ".ncu-rep", "--page", page, "--csv", *extra], stdout=f, text=True)
    summary = summarize(report + "_sass.csv", args.top)
    with open(report + "_summary.txt", "w") as f:
        f.write(summary + "\n")
    print(summary)


if __name__ == "__main__":
    main()

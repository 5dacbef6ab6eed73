"""Dynamic block masks on one CUDA GPU: building a top-k mask per call, and a MoBA-style attention step.

Two parts, every competitor in the same process on the same scores and inputs:

1. **Mask build.** `BlockMask.from_topk` (index lists included, `check_finite=False`, so nothing waits for the
   device) at 65,536 and 32,768 tokens, B=1, H=16, block 128, causal and not, k = 8 and 32: eager (median of
   CUDA-event timings of back-to-back calls, `triton.testing.do_bench`) and replayed from a CUDA graph that
   holds `from_topk` and nothing else (`do_bench_cudagraph`). The issue's target: at most 100 us, capturable.
   Also the same build compiled whole (`torch.compile(ours_topk_index, fullgraph=True)`: the index lists and
   work plans an attention call reads: the same Triton launches as custom ops since step 89, before it ~280 small
   operators fused by inductor), eager and graphed.
   Beside it, FlexAttention's builders: `create_block_mask` (compiled) with a mask_mod reading a boolean
   block table of the same choice, at 65,536 tokens (it evaluates the mask_mod on all B*H*N^2 pairs), and
   `BlockMask.from_kv_blocks` fed the same top-k choice (`torch.topk`, the route FlexAttention users take
   when the blocks are known: no mask_mod evaluation), eager and from a CUDA graph.
2. **MoBA-style step** at 32,768 tokens, causal, B=1, H=16, D=128, bf16, block 128, top_k 8 and 16: block-mean
   gate scores (MoBA's gate, as `sparse_flash.nn.MoBAAttention.select`), the choice, and attention, per call,
   forward and forward+backward. Ours: `from_topk` + `block_sparse_attention` (the default kernels, and the
   Triton kernels alone), and the whole step compiled (`torch.compile(fullgraph=True)`: choice, mask
   build and attention in one graph, as a compiled model runs `sparse_flash.nn.MoBAAttention`). FlexAttention:
   `from_kv_blocks` from the same choice + `torch.compile(flex_attention)` (compiled once: the block tables
   are padded to a fixed width, so top_k 8 and 16 share one graph). cuDNN SDPA dense causal is the
   reference point. ours and flex run twice in opposite orders and keep the faster median, as in
   bench_attention.py. TFLOP/s count the computed blocks only, over the whole step's time.

A script of its own rather than a section of bench_attention.py: that script's rows are (shape, static mask)
pairs whose mask is built once outside the timed region, while here the mask build is what is timed; the
timing (`bench`), the competitors (`Competitors`), `live_density` and the environment record are imported
from it, so both files time and record alike.

    python benchmarks/bench_dynamic.py                # over 2.5 minutes on an H200 (the step part unfinished at
                                                      # 135 s on 2026-12-02; compiles included)
    python benchmarks/bench_dynamic.py --out DIR      # where dynamic.json goes
    python benchmarks/bench_dynamic.py --profile --out DIR  # where the per-call time goes, operator by operator
    python benchmarks/bench_dynamic.py --smoke        # tiny sizes, any device (CPU: torch backend, or triton
                                                      # under TRITON_INTERPRET=1); runs every path once,
                                                      # times nothing worth quoting, writes no file

Writes `dynamic.json` under --out (default `benchmarks/results/latest`; with --smoke only where --out is given)
and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_attention, also when imported from tests/

import sparse_flash  # noqa: E402
from bench_attention import Competitors, bench, environment, live_density  # noqa: E402
from sparse_flash import BlockMask  # noqa: E402

BLOCK = 128
TARGET_US = 100.0  # the target for from_topk at 65,536 tokens


class Sizes:
    """The sizes of a run: the full one on a GPU, or a tiny one (--smoke) that any device runs in seconds."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.build_heads = 2 if smoke else 16
        self.build_lengths = (1024, 512) if smoke else (65536, 32768)
        self.build_ks = (2, 4) if smoke else (8, 32)
        self.create_block_mask_lengths = self.build_lengths[:1]
        self.step = dict(B=1, H=1, N=384, D=16) if smoke else dict(B=1, H=16, N=32768, D=128)
        self.step_top_ks = (1, 2) if smoke else (8, 16)


# ---------------------------------------------------------------------------------------------- the choice
def block_scores(q: torch.Tensor, k: torch.Tensor, block: int) -> torch.Tensor:
    """float32 `(B, H, M, M)`: `mean(q over block i - 1) . mean(k over block j)`, MoBA's causal block gate (the
    one of `MoBAAttention.select` with causal=True: each block's gate reads the block before it), for q and k
    `(B, H, N, D)` with N a multiple of `block`; no gradient."""
    B, H, N, D = q.shape
    with torch.no_grad():
        q_means = q.view(B, H, N // block, block, D).mean(3, dtype=torch.float32)  # no float32 copy of q
        q_means = torch.cat([torch.zeros_like(q_means[:, :, :1]), q_means[:, :, :-1]], 2)
        k_means = k.view(B, H, N // block, block, D).mean(3, dtype=torch.float32)
        return q_means @ k_means.transpose(-1, -2)


def ours_topk_mask(scores: torch.Tensor, k: int, causal: bool) -> BlockMask:
    return BlockMask.from_topk(scores, k, causal=causal, block_size=BLOCK, check_finite=False)


def ours_topk_index(scores: torch.Tensor, k: int, causal: bool):
    """What an attention call with this `causal` flag reads of a `from_topk` mask: its `KernelIndex` (index lists
    and work plans). Compiled whole (`torch.compile`), the choice, lists and plans run as `index_gpu`'s custom
    ops."""
    return ours_topk_mask(scores, k, causal)._records(causal)[0]  # the lists themselves, as the kernels get them


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def flex_topk_mask(scores: torch.Tensor, k: int, causal: bool):
    """FlexAttention's BlockMask of the choice `from_topk` makes: each query block's k best key blocks by
    `scores` `(B, H, M, M)`; with `causal`, the diagonal block (a partial block, masked by `q_idx >= kv_idx`)
    and the k - 1 best earlier ones (full blocks). Built by `BlockMask.from_kv_blocks`, its tables padded to M
    columns (the width FlexAttention's transpose expects, and one shape for every k)."""
    from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask

    B, H, M, _ = scores.shape
    dev = scores.device
    i = torch.arange(M, device=dev)
    width = min(k - 1, M - 1) if causal else k
    if causal:  # only blocks before the diagonal compete; rows near the start keep all of theirs
        ranked = scores.masked_fill(i[None, :] >= i[:, None], float("-inf"))
        n_full = torch.clamp(i, max=width).to(torch.int32).expand(B, H, M)
    else:
        ranked = scores
        n_full = torch.full((B, H, M), width, dtype=torch.int32, device=dev)
    slot = torch.arange(width, device=dev)
    chosen = torch.where(slot < n_full[..., None], torch.topk(ranked, width, dim=-1).indices, M)  # unused slots last
    full_indices = F.pad(torch.sort(chosen, dim=-1).values.clamp_(max=M - 1), (0, M - width)).to(torch.int32)
    if causal:
        kv_num = torch.ones(B, H, M, dtype=torch.int32, device=dev)
        kv_indices = F.pad(i.to(torch.int32)[:, None], (0, M - 1)).expand(B, H, M, M).contiguous()
    else:
        kv_num = torch.zeros(B, H, M, dtype=torch.int32, device=dev)
        kv_indices = torch.zeros_like(full_indices)
    return FlexBlockMask.from_kv_blocks(kv_num, kv_indices, n_full.contiguous(), full_indices, BLOCK_SIZE=BLOCK,
                                        mask_mod=_causal if causal else None)


class TableMaskMod:
    """A mask_mod reading a boolean block table `(B, H, M, M)` (and `q_idx >= kv_idx` with `causal`), for
    `create_block_mask`. One table per shape, refilled in place, so the compiled builder is traced once."""

    def __init__(self, shape, causal: bool, device):
        self.table = torch.zeros(shape, dtype=torch.bool, device=device)
        table = self.table

        def mask_mod(b, h, q_idx, kv_idx):
            keep = table[b, h, q_idx // BLOCK, kv_idx // BLOCK]
            return keep & (q_idx >= kv_idx) if causal else keep

        self.mask_mod = mask_mod


# ---------------------------------------------------------------------------------------------- timing
def timed(fn, *, grad_of=None, graph=False) -> float:
    """Milliseconds of fn (forward, or forward + backward when grad_of lists the inputs): bench_attention's
    `bench` on a GPU; on the CPU (a smoke run) one wall-clock call, which only shows that the path runs."""
    if torch.cuda.is_available():
        return bench(fn, grad_of=grad_of, graph=graph)
    if graph:
        raise ValueError("CUDA graphs need a CUDA device")

    def step():
        if grad_of is None:
            return fn()
        out = fn()
        out.backward(torch.ones_like(out))
        for t in grad_of:
            t.grad = None

    start = time.perf_counter()
    step()
    return 1e3 * (time.perf_counter() - start)


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def _say(text: str) -> None:
    print(text, flush=True)


# ---------------------------------------------------------------------------------------------- part 1
def build_rows(sizes: Sizes, device, compiled: bool = True) -> list[dict]:
    """Mask build times: from_topk eager and from a CUDA graph, flex's from_kv_blocks and create_block_mask.
    `compiled=False` leaves out the two builds that torch.compile first (from_topk compiled whole and
    `create_block_mask`): the rest takes about a minute on an H200."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows = []
    H = sizes.build_heads
    compiled_index = torch.compile(ours_topk_index, fullgraph=True, dynamic=False) if compiled else None
    for N in sizes.build_lengths:
        M = N // BLOCK
        gen = torch.Generator(device=device).manual_seed(0)
        scores = torch.randn(1, H, M, M, device=device, generator=gen)
        tables = {}
        for causal in (True, False):
            for k in sizes.build_ks:
                row = {"N": N, "B": 1, "H": H, "block": BLOCK, "causal": causal, "k": k}
                mask = ours_topk_mask(scores, k, causal)
                row["nnz"] = mask.nnz
                builders = {"from_topk": lambda: ours_topk_mask(scores, k, causal),
                            "flex_from_kv_blocks": lambda: flex_topk_mask(scores, k, causal)}
                if device.type == "cuda" and compiled:  # the build compiled whole (inductor fuses its small operators)
                    builders["from_topk_compiled"] = lambda: compiled_index(scores, k, causal)
                try:
                    fm = builders["flex_from_kv_blocks"]()
                    row["flex_same_blocks"] = bool(torch.equal(fm.to_dense().bool(), mask.layout))
                except Exception as e:
                    row["flex_same_blocks_error"] = _error(e)
                for name, build in builders.items():
                    for how, graph in (("eager", False),) + ((("graph", True),) if device.type == "cuda" else ()):
                        try:
                            row[f"{name}_{how}_ms"] = timed(build, graph=graph)
                        except Exception as e:
                            row[f"{name}_{how}_error"] = _error(e)
                if N in sizes.create_block_mask_lengths and compiled:
                    if causal not in tables:
                        tables[causal] = TableMaskMod((1, H, M, M), causal, device)
                    tables[causal].table.copy_(mask.layout.as_subclass(torch.Tensor))
                    try:
                        def build_flex(t=tables[causal]):
                            return create_block_mask(t.mask_mod, 1, H, N, N, device=device,
                                                     _compile=device.type == "cuda")

                        if not sizes.smoke and k == sizes.build_ks[0]:
                            _say(f"build N={N} causal={causal}: compiling create_block_mask")
                        fm = build_flex()  # compiles once per causal flag
                        row["flex_create_block_mask_same_blocks"] = bool(torch.equal(fm.to_dense().bool(), mask.layout))
                        row["flex_create_block_mask_ms"] = _wall_median(build_flex, 1 if sizes.smoke else 3)
                    except Exception as e:
                        row["flex_create_block_mask_error"] = _error(e)
                rows.append(row)
                _say(_build_line(row))
                del mask
        del scores, tables
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def _wall_median(fn, repeats: int) -> float:
    """Median wall-clock milliseconds of fn, the device synchronised around each call (for builders whose
    single call is long: bench_attention's `mask_costs` times create_block_mask the same way)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def _fmt(value, spec=".3f", scale=1.0) -> str:
    return format(value * scale, spec) if isinstance(value, (int, float)) else "n/a"


def _ratio(value) -> str:
    return f"{value:.2f}x" if isinstance(value, float) else "n/a"


def _build_line(row: dict) -> str:
    return (f"build N={row['N']} H={row['H']} causal={row['causal']!s:5} k={row['k']:<2}  from_topk eager "
            f"{_fmt(row.get('from_topk_eager_ms'))} ms, graph {_fmt(row.get('from_topk_graph_ms'), '.1f', 1e3)} us | "
            f"flex from_kv_blocks eager {_fmt(row.get('flex_from_kv_blocks_eager_ms'))} ms, graph "
            f"{_fmt(row.get('flex_from_kv_blocks_graph_ms'), '.1f', 1e3)} us | flex create_block_mask "
            f"{_fmt(row.get('flex_create_block_mask_ms'))} ms | from_topk compiled "
            f"{_fmt(row.get('from_topk_compiled_eager_ms'))} ms, graph "
            f"{_fmt(row.get('from_topk_compiled_graph_ms'), '.1f', 1e3)} us")


# ---------------------------------------------------------------------------------------------- part 2
def step_rows(sizes: Sizes, device, backend: str) -> list[dict]:
    """A MoBA-style causal step per call (gate scores, choice, attention): ours against flex, forward and
    forward+backward, and cuDNN dense causal."""
    B, H, N, D = (sizes.step[x] for x in "BHND")
    dtype = torch.float32 if sizes.smoke else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device=device, dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    comp = Competitors()
    flex_runs = device.type == "cuda"  # compiled flex_attention: inductor's CPU path is not what is compared

    def ours(top_k, triton_only=False):
        from sparse_flash.kernels import settings

        def run():
            mask = ours_topk_mask(block_scores(q, k, BLOCK), top_k, True)
            return sparse_flash.block_sparse_attention(q, k, v, mask, causal=True, backend=backend)

        def run_triton_kernels():  # the Hopper kernels off: the Triton forward and backward serve every call
            with settings.override(hopper_forward=False, hopper_backward=False):
                return run()

        return run_triton_kernels if triton_only else run

    def flex(top_k):
        def run():
            return comp.flex(q, k, v, block_mask=flex_topk_mask(block_scores(q, k, BLOCK), top_k, True))

        return run

    def cudnn():
        return comp.sdpa("cudnn")(q, k, v, None, True)

    rows = []
    base = {"B": B, "Hq": H, "Hkv": H, "N": N, "D": D, "dtype": str(dtype).replace("torch.", ""), "causal": True}
    causal_density = live_density(sparse_flash.masks.causal(N, BLOCK, device=device), True)
    plans = []
    for top_k in sizes.step_top_ks:
        impls = {"sparse_flash": ours(top_k)}
        if device.type == "cuda" and backend == "triton":
            impls["sparse_flash_triton_kernels"] = ours(top_k, triton_only=True)
            # the whole step compiled (choice, mask build and attention in one graph), as flex's attention is
            impls["sparse_flash_compiled"] = torch.compile(ours(top_k), fullgraph=True, dynamic=False)
        impls["flex"] = flex(top_k)
        plans.append((f"moba top-{top_k}", top_k, impls))
    plans.append(("dense causal", None, {"sdpa_cudnn": cudnn}))
    for mask_name, top_k, impls in plans:
        if top_k is None:
            density = causal_density
        else:
            mask = ours_topk_mask(block_scores(q, k, BLOCK), top_k, True)
            density = live_density(mask, True)
        extra = {}
        if top_k is not None:
            try:
                fm = flex_topk_mask(block_scores(q, k, BLOCK), top_k, True)
                extra["flex_same_blocks"] = bool(torch.equal(fm.to_dense().bool(), mask.layout))
                if flex_runs:
                    first = top_k == sizes.step_top_ks[0]
                    _say(f"step {mask_name}: {'compiling flex_attention, ' if first else ''}comparing outputs")
                    with torch.no_grad():
                        diff = impls["sparse_flash"]().float() - impls["flex"]().float()
                    extra["max_diff_vs_flex"] = float(diff.abs().max())
            except Exception as e:
                extra["flex_check_error"] = _error(e)
        tasks = [(impl, mode) for impl in impls for mode in ("fwd", "fwd+bwd")]
        tasks += ([t for t in reversed(tasks) if t[0] in ("sparse_flash", "sparse_flash_compiled", "flex")]
                  if not sizes.smoke else [])
        done = {}
        for impl, mode in tasks:
            row = done.get((impl, mode))
            if row is None:
                row = done[(impl, mode)] = {**base, "mask": mask_name, "top_k": top_k, "density": density,
                                            "impl": impl, "mode": mode, "runs_ms": [], **extra}
                rows.append(row)
            if "error" in row:
                continue
            fn = impls[impl]
            if impl == "flex" and not flex_runs:
                row["error"] = "not run: compiled flex_attention is compared on CUDA only"
            elif impl == "sdpa_cudnn" and device.type != "cuda":
                row["error"] = "not run: cuDNN needs CUDA"
            else:
                if impl == "flex" and mode == "fwd+bwd" and not row["runs_ms"] and top_k == sizes.step_top_ks[0]:
                    _say(f"step {mask_name}: compiling flex_attention's backward")
                if impl == "sparse_flash_compiled" and not row["runs_ms"]:
                    _say(f"step {mask_name}: compiling the whole {mode} step")
                try:
                    if mode == "fwd":
                        with torch.no_grad():
                            row["runs_ms"].append(timed(fn))
                    else:
                        row["runs_ms"].append(timed(fn, grad_of=[q, k, v]))
                    row["ms"] = min(row["runs_ms"])
                    flops = 4 * B * H * N * N * D * density * (3.5 if mode == "fwd+bwd" else 1.0)
                    row["tflops"] = flops / row["ms"] / 1e9
                except Exception as e:
                    row["error"] = _error(e)
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
            runs = 2 if impl in ("sparse_flash", "sparse_flash_compiled", "flex") and not sizes.smoke else 1
            if len(row["runs_ms"]) == runs or "error" in row:
                _say(_step_line(row))
    step_ratios(rows)
    return rows


def step_ratios(rows: list[dict]) -> None:
    """Each row's time against flex's (flex ms / ours, above 1: ours is faster) and cuDNN dense causal's, same
    mode; the flex ratio within the same top_k."""
    timed_rows = {(r["mask"], r["impl"], r["mode"]): r for r in rows if "ms" in r}
    for r in rows:
        if "ms" not in r or r["impl"] in ("flex", "sdpa_cudnn"):
            continue
        flex = timed_rows.get((r["mask"], "flex", r["mode"]))
        if flex:
            r["flex_over_ours"] = flex["ms"] / r["ms"]
        cudnn = timed_rows.get(("dense causal", "sdpa_cudnn", r["mode"]))
        if cudnn:
            r["cudnn_causal_over_ours"] = cudnn["ms"] / r["ms"]


def _step_line(row: dict) -> str:
    speed = f"{row['ms']:.3f} ms" if "ms" in row else row.get("error", "")
    return f"step N={row['N']} {row['mask']:12s} {row['mode']:7s} {row['impl']:27s} {speed}"


# ---------------------------------------------------------------------------------------------- report
def summarize(build: list[dict], step: list[dict]) -> dict:
    """The headline: from_topk from a CUDA graph at the longest length against the target, capture failures,
    whether flex's masks held the same blocks as ours, and flex over ours per step."""
    s = {}
    longest = max((r["N"] for r in build), default=None)
    graphed = [r for r in build if r["N"] == longest and "from_topk_graph_ms" in r]
    if graphed:
        s["from_topk_capture_failures"] = [f"N={r['N']} causal={r['causal']} k={r['k']}: {r['from_topk_graph_error']}"
                                           for r in build if "from_topk_graph_error" in r]
        worst = max(graphed, key=lambda r: r["from_topk_graph_ms"])
        s["from_topk_graph_us_max"] = 1e3 * worst["from_topk_graph_ms"]
        s["from_topk_graph_worst_row"] = f"N={worst['N']} causal={worst['causal']} k={worst['k']}"
        within = sum(1e3 * r["from_topk_graph_ms"] <= TARGET_US for r in graphed)
        s[f"from_topk_graph_at_most_{TARGET_US:g}us"] = f"{within} of {len(graphed)} rows at N={longest}"
    checked = [r[key] for r in build + step for key in ("flex_same_blocks", "flex_create_block_mask_same_blocks")
               if key in r]
    s["flex_chose_the_same_blocks"] = f"{sum(checked)} of {len(checked)} masks"
    for impl, name in (("sparse_flash", "ours"), ("sparse_flash_compiled", "ours_compiled")):
        for mode in ("fwd", "fwd+bwd"):
            ratios = {r["mask"]: round(r["flex_over_ours"], 3) for r in step
                      if r["impl"] == impl and r["mode"] == mode and "flex_over_ours" in r}
            if ratios:
                s[f"step_{mode}_flex_over_{name}"] = ratios
    return s


def table(build: list[dict], step: list[dict], smoke: bool) -> str:
    note = " (smoke run: tiny sizes, not a measurement)" if smoke else ""
    lines = [f"Mask build, B=1, block {BLOCK}{note}: from_topk eager ms / CUDA graph us (target <= {TARGET_US:g} us)",
             f"{'N':>6} {'causal':6} {'k':>3} | {'from_topk':>9} {'graph us':>9} | {'compiled':>9} {'graph us':>9} | "
             f"{'flex kv_blocks':>14} {'graph us':>9} | {'flex create_block_mask':>22}"]
    for r in build:
        lines.append(f"{r['N']:>6} {r['causal']!s:6} {r['k']:>3} | {_fmt(r.get('from_topk_eager_ms')):>9} "
                     f"{_fmt(r.get('from_topk_graph_ms'), '.1f', 1e3):>9} | "
                     f"{_fmt(r.get('from_topk_compiled_eager_ms')):>9} "
                     f"{_fmt(r.get('from_topk_compiled_graph_ms'), '.1f', 1e3):>9} | "
                     f"{_fmt(r.get('flex_from_kv_blocks_eager_ms')):>14} "
                     f"{_fmt(r.get('flex_from_kv_blocks_graph_ms'), '.1f', 1e3):>9} | "
                     f"{_fmt(r.get('flex_create_block_mask_ms')):>22}")
    if step:
        r0 = step[0]
        lines += ["", f"MoBA step per call (scores + choice + attention), B={r0['B']} H={r0['Hq']} N={r0['N']} "
                      f"D={r0['D']} {r0['dtype']} causal, ms{note}",
                  f"{'mask':12s} {'mode':7s} | {'ours':>8} {'ours Triton':>11} {'compiled':>8} {'flex':>8} "
                  f"{'flex/ours':>9} {'flex/compiled':>13} | {'cuDNN dense causal':>18}"]
        by = {}
        for r in step:
            by.setdefault((r["mask"], r["mode"]), {})[r["impl"]] = r
        cudnn = {mode: impls.get("sdpa_cudnn", {}).get("ms") for (m, mode), impls in by.items() if m == "dense causal"}
        for (mask, mode), impls in by.items():
            if mask == "dense causal":
                continue
            o, c = impls.get("sparse_flash", {}), impls.get("sparse_flash_compiled", {})
            lines.append(f"{mask:12s} {mode:7s} | {_fmt(o.get('ms')):>8} "
                         f"{_fmt(impls.get('sparse_flash_triton_kernels', {}).get('ms')):>11} {_fmt(c.get('ms')):>8} "
                         f"{_fmt(impls.get('flex', {}).get('ms')):>8} {_ratio(o.get('flex_over_ours')):>9} "
                         f"{_ratio(c.get('flex_over_ours')):>13} | {_fmt(cudnn.get(mode)):>18}")
    return "\n".join(lines)


def profile(sizes: Sizes, device, backend: str, out: Path) -> None:
    """Where the per-call time goes, operator by operator (torch.profiler, after warm-up calls): the `from_topk`
    build at the largest length and k (not causal), a butterfly mask's build at that length (the pattern
    constructors' path: layout, index lists, plans, with its host waits), and the MoBA step forward+backward
    at the smallest top_k, with the default kernels and with the Triton kernels alone. Each writes `profile_<what>.txt` under `out`:
    the operators by device time, then by host time, per call."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from sparse_flash.kernels import settings

    B, H, N, D = (sizes.step[x] for x in "BHND")
    dtype = torch.float32 if sizes.smoke else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    n, k = sizes.build_lengths[0], sizes.build_ks[0]
    scores = torch.randn(1, sizes.build_heads, n // BLOCK, n // BLOCK, device=device, generator=gen)
    q, kk, v = (torch.randn(B, H, N, D, device=device, dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    top_k = sizes.step_top_ks[0]

    def step():
        mask = ours_topk_mask(block_scores(q, kk, BLOCK), top_k, True)
        sparse_flash.block_sparse_attention(q, kk, v, mask, causal=True, backend=backend).sum().backward()

    def triton_step():
        with settings.override(hopper_forward=False, hopper_backward=False):
            step()

    cases = {f"from_topk_{n}_k{k}": lambda: ours_topk_mask(scores, k, False),
             f"butterfly_build_{n}": lambda: sparse_flash.masks.butterfly(n, BLOCK, device=device),
             f"moba_step_{N}_top{top_k}": step, f"moba_step_{N}_top{top_k}_triton_kernels": triton_step}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    calls = 2 if sizes.smoke else 10
    for name, fn in cases.items():
        for _ in range(3):  # compiles and plans outside the profile
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        with torch_profile(activities=activities) as prof:
            for _ in range(calls):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
        averages = prof.key_averages()
        by_device = averages.table(sort_by="self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total",
                                   row_limit=40)
        by_host = averages.table(sort_by="cpu_time_total", row_limit=40)
        text = f"# {name}: {calls} calls\n\n## by device time\n{by_device}\n## by host time\n{by_host}\n"
        (out / f"profile_{name}.txt").write_text(text)
        _say(f"profile {name}: {calls} calls, written to {out / f'profile_{name}.txt'}\n{by_device[:3000]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="output folder (default: benchmarks/results/latest; with --smoke: none, "
                        "a smoke run's numbers are no measurement)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on any device: checks that every path runs")
    parser.add_argument("--backend", choices=("auto", "triton", "torch"), default="auto",
                        help="sparse_flash backend (auto: triton on CUDA or under TRITON_INTERPRET=1, else torch)")
    parser.add_argument("--skip-build", action="store_true", help="skip part 1 (mask build)")
    parser.add_argument("--skip-step", action="store_true", help="skip part 2 (MoBA step)")
    parser.add_argument("--no-compile", action="store_true",
                        help="part 1 without the builds that compile first (from_topk compiled whole, "
                        "create_block_mask): a quick measurement of from_topk against the target")
    parser.add_argument("--profile", action="store_true",
                        help="instead of timing: operator tables (torch.profiler) of a from_topk build and of the "
                        "MoBA step, written to --out as profile_*.txt")
    args = parser.parse_args(argv)
    if args.out is None and not args.smoke:
        args.out = "benchmarks/results/latest"
    if args.out is None and args.profile:
        parser.error("--profile --smoke needs --out (where its tables go)")
    if args.out is not None:
        try:
            sparse_flash.checks.output_folder(args.out, "--out")
        except ValueError as error:
            parser.error(str(error))
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("bench_dynamic needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    backend = args.backend
    if backend == "auto":
        backend = "triton" if cuda or os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    device = torch.device("cuda" if cuda else "cpu")
    sizes = Sizes(args.smoke)
    meta = {**environment(), "block_size": BLOCK, "backend": backend, "smoke": args.smoke,
            "timing": "smoke: tiny sizes, not a measurement" if args.smoke else
            "triton.testing.do_bench medians (CUDA events), do_bench_cudagraph for graph replays; "
            "create_block_mask: median wall clock of 3 synchronised calls"}
    _say(f"bench_dynamic: {meta['gpu'] or 'CPU'}, torch {meta['torch']}, backend {backend}, commit {meta['commit']}"
         + (" (smoke)" if args.smoke else ""))
    if args.profile:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        profile(sizes, device, backend, out)
        return 0
    start = time.perf_counter()
    if not args.skip_build:
        _say("part 1: building top-k masks (from_topk, flex from_kv_blocks, flex create_block_mask)")
    build = [] if args.skip_build else build_rows(sizes, device, compiled=not args.no_compile)
    if not args.skip_step:
        _say(f"part 2 after {time.perf_counter() - start:.0f} s: MoBA-style steps (first calls compile kernels)")
    step = [] if args.skip_step else step_rows(sizes, device, backend)
    meta["seconds"] = round(time.perf_counter() - start, 1)
    summary = summarize(build, step)
    if args.out is not None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "dynamic.json").write_text(json.dumps({"meta": meta, "mask_build": build, "step": step,
                                                      "summary": summary}, indent=2))
    _say(json.dumps(summary, indent=2))
    _say(f"wrote {Path(args.out) / 'dynamic.json'} after {meta['seconds']:.0f} s\n" if args.out is not None else
         f"done after {meta['seconds']:.0f} s (a smoke run without --out writes no file)\n")
    _say(table(build, step, args.smoke))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

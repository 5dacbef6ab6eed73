"""The benchmark's bookkeeping on made-up timings: ratios, the summary the targets are read from, the table;
and the GPU suite's split into shards.

The timings come from a GPU run; what is computed from them is plain Python and is checked here, so a
wrong ratio or a miscounted row cannot slip into the README's numbers.
"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
bench = pytest.importorskip("bench_attention")


def row(impl, mode, ms, *, mask="random", N=4096, D=64, density=0.134, graph_ms=None):
    r = {"B": 4, "Hq": 16, "Hkv": 16, "N": N, "D": D, "dtype": "bfloat16", "mask": mask, "causal": False,
         "density": density, "impl": impl, "mode": mode, "ms": ms, "runs_ms": [ms], "tflops": 1.0}
    if graph_ms is not None:
        r["graph_ms"] = graph_ms
    return r


def rows():
    return [
        # host-bound eagerly (0.8x), faster on the GPU (1.25x)
        row("sparse_flash", "fwd", 0.25, graph_ms=0.08), row("flex", "fwd", 0.20, graph_ms=0.10),
        row("sparse_flash", "fwd+bwd", 1.00, graph_ms=0.50), row("flex", "fwd+bwd", 0.90, graph_ms=0.45),
        # a long row: eager timing only
        row("sparse_flash", "fwd", 2.0, mask="dense", N=16384, D=128, density=1.0),
        row("flex", "fwd", 3.0, mask="dense", N=16384, D=128, density=1.0),
        row("sdpa_cudnn", "fwd", 1.8, mask="dense", N=16384, D=128, density=1.0),
        row("sdpa_flash", "fwd", 3.2, mask="dense", N=16384, D=128, density=1.0),
        # time over dense 0.1 at density 0.05: above 1.15 * 0.05 + 0.01 = 0.0675 (printed 0.067)
        row("sparse_flash", "fwd", 0.2, mask="butterfly", N=16384, D=128, density=0.05),
        row("flex", "fwd", 0.3, mask="butterfly", N=16384, D=128, density=0.05),
    ]


def test_ratios_compare_like_with_like():
    rs = rows()
    bench.add_ratios(rs)
    ours = {(r["mask"], r["mode"]): r for r in rs if r["impl"] == "sparse_flash"}
    assert ours[("random", "fwd")]["speedup_vs_flex"] == pytest.approx(0.8)
    assert ours[("random", "fwd")]["graph_speedup_vs_flex"] == pytest.approx(1.25)
    assert ours[("random", "fwd+bwd")]["graph_speedup_vs_flex"] == pytest.approx(0.9)
    assert "graph_speedup_vs_flex" not in ours[("dense", "fwd")]  # flex has no graph timing there
    assert ours[("dense", "fwd")]["speedup_vs_cudnn_dense"] == pytest.approx(0.9)
    assert ours[("dense", "fwd")]["speedup_vs_sdpa_flash"] == pytest.approx(1.6)
    assert ours[("butterfly", "fwd")]["time_over_dense"] == pytest.approx(0.1)


def test_summary_counts_rows_and_names_every_failure():
    rs = rows()
    bench.add_ratios(rs)
    s = bench.summarize(rs)
    fwd = s["fwd"]
    assert fwd["rows_at_or_above_1"] == "2 of 3"
    assert fwd["median_vs_flex"] == pytest.approx(1.5)
    assert fwd["min_vs_flex"] == pytest.approx(0.8) and fwd["worst_row"] == "4,16,4096,64 random"
    assert fwd["cuda_graph_rows"] == {"rows": 1, "median_vs_flex": pytest.approx(1.25), "below_1": []}
    assert s["fwd+bwd"]["cuda_graph_rows"]["below_1"] == ["4,16,4096,64 random: 0.90"]
    assert s["dense_fwd_d128_vs_cudnn"] == pytest.approx(0.9)
    assert s["density_rule_violations"] == ["16384,128 butterfly fwd: 0.100 > 0.067"]
    assert s["rows_timed_beside_busy_cores"] == []  # no round recorded other processes' cores
    rs[2]["runs_other_cores"] = [0.2, 3.0, None]
    assert bench.summarize(rs)["rows_timed_beside_busy_cores"] == ["4,16,4096,64 random fwd+bwd sparse_flash: 0.2 3.0"]
    # the clock of each row's kept (fastest) round: ours capped at 1,600 MHz there, flex at full clock
    assert s["median_sm_mhz"] == {} and s["rows_timed_power_capped"] == []  # no NVML readings
    rs[2].update(runs_ms=[1.1, 1.0], runs_sm_mhz=[1980, 1600], runs_capped=[0.0, 0.6])
    rs[3].update(runs_ms=[0.9], runs_sm_mhz=[1980], runs_capped=[0.0])
    rs[0].update(runs_ms=[0.25], runs_sm_mhz=[None], runs_capped=[None])  # a round without readings
    s = bench.summarize(rs)
    assert s["median_sm_mhz"] == {"sparse_flash": 1600, "flex": 1980}
    assert s["rows_timed_power_capped"] == ["4,16,4096,64 random fwd+bwd sparse_flash: 1600 MHz, 60% of samples capped"]


def test_markdown_shows_both_timings():
    rs = rows()
    bench.add_ratios(rs)
    meta = {"date": "d", "gpu": "g", "torch": "t", "triton": "x", "cuda": "c"}
    text = bench.markdown(meta, rs, [], bench.summarize(rs))
    line = next(x for x in text.splitlines() if x.startswith("| 4,16,16,4096,64 | bfloat16 | random | 0.134 | fwd |"))
    assert "0.80x" in line and "1.25x (0.080 / 0.100 ms)" in line
    dense = next(x for x in text.splitlines() if x.startswith("| 4,16,16,16384,128 | bfloat16 | dense | 1.000 | fwd |"))
    assert dense.rstrip().endswith("| |")  # no graph column for long rows


def test_mask_build_table_shows_back_to_back_builds_where_timed():
    costs = [{"impl": "sparse_flash", "mask": "local", "N": 65536, "ms": 1.97, "min_ms": 1.8, "index_bytes": 10,
              "speedup_vs_flex": 1.6, "alone_ms": 1.09, "alone_min_ms": 1.02},
             {"impl": "flex create_block_mask", "mask": "local", "N": 65536, "ms": 3.15, "min_ms": 3.0,
              "index_bytes": 20},
             {"impl": "flex create_block_mask", "mask": "fixed", "N": 1048576, "error": "not run"}]
    meta = {"date": "d", "gpu": "g", "torch": "t", "triton": "x", "cuda": "c"}
    lines = bench.markdown(meta, [], costs, {}).splitlines()
    ours = next(x for x in lines if x.startswith("| sparse_flash | local |"))
    assert ours == "| sparse_flash | local | 65536 | 1.97 | 1.80 | 1.60x | 10 | 1.09 |"
    assert next(x for x in lines if x.startswith("| flex create_block_mask | local |")).endswith("| 20 |  |")
    assert "| not run | " in next(x for x in lines if "| fixed |" in x)


def test_ab_rows_outside_the_benchmark_parse_or_say_what_a_row_is():
    ab = pytest.importorskip("ab_kernels")
    assert ab.parse_row("1,16,16,16384,64,dense,True") == (1, 16, 16, 16384, 64, "dense", True)
    assert ab.parse_row(" 4, 8, 2, 4096, 96, local16, false") == (4, 8, 2, 4096, 96, "local16", False)
    for bad in ("1,2,3", "1,16,16,16384,64,dense,yes", "a,16,16,16384,64,dense,true"):
        with pytest.raises(ab.argparse.ArgumentTypeError, match="B,Hq,Hkv,N,D,MASK,CAUSAL"):
            ab.parse_row(bad)


def test_ab_row_timeout_ends_a_stuck_row_with_its_stack():
    """`ab_kernels.py --row-timeout`: a row that never returns (a hung kernel) ends the run with the stack of
    where it waits, after the progress lines of the steps before, instead of silently using up a GPU call."""
    pytest.importorskip("ab_kernels")
    script = ("import sys, time\n"
              "sys.argv = ['ab_kernels.py', '--switch', 'tma', '--row', '1,1,1,128,16,dense,false',"
              " '--row-timeout', '1', '--out', sys.argv[1]]\n"
              "import ab_kernels\n"
              "def stuck_in_the_kernel(*args, **kwargs):\n"
              "    ab_kernels.progress('a step')\n"
              "    time.sleep(60)\n"
              "ab_kernels.run_row = stuck_in_the_kernel\n"
              "ab_kernels.main()\n")
    bench_dir = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run([sys.executable, "-c", script, os.path.join(folder, "ab.json")], cwd=bench_dir,
                              capture_output=True, text=True, timeout=50)
    assert done.returncode != 0
    assert re.search(r"^\[ +[0-9.]+ s\] a step$", done.stdout, re.M)
    assert "in stuck_in_the_kernel" in done.stderr and "Timeout" in done.stderr


def test_the_run_waits_for_a_loaded_host_to_settle_and_no_longer_than_its_limit(monkeypatch):
    loads = iter([4.1, 3.0, 1.7, 1.2, 9.0])
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    slept = []
    assert bench.settle_host(1.5, 90, sleep=slept.append) == 15.0  # three waits until the load fell below 1.5
    assert slept == [5.0] * 3
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (8.0, 0.0, 0.0))
    slept.clear()
    assert bench.settle_host(1.5, 20, sleep=slept.append) == 20.0  # a host that never settles: the limit
    assert len(slept) == 4


def test_host_meter_splits_the_busy_cores_between_other_processes_and_this_one(tmp_path):
    """`cpu_seconds` reads the host's busy ticks (idle and iowait left out) and this process's CPU seconds;
    `HostMeter` turns two readings into cores held per second of wall time."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 1000 30 5 5 0 0 0\ncpu0 1 2 3\n")
    busy, own = bench.cpu_seconds(str(stat))
    assert busy == pytest.approx(160 / bench.os.sysconf("SC_CLK_TCK")) and own > 0
    assert bench.cpu_seconds(str(tmp_path / "missing")) is None
    readings, clock = iter([(10.0, 1.0), (13.5, 1.5)]), iter([0.0, 1.0])
    with bench.HostMeter(read=lambda: next(readings), clock=lambda: next(clock)) as m:
        pass
    assert (m.other_cores, m.own_cores) == (3.0, 0.5)  # 3.5 busy cores, half a core of them this process's
    with bench.HostMeter(read=lambda: None) as m:  # no /proc: nothing known
        pass
    assert m.other_cores is None and m.own_cores is None


def test_a_row_waits_while_other_processes_hold_cores_and_no_longer_than_its_limit(monkeypatch):
    monkeypatch.setattr(bench.time, "sleep", lambda s: None)
    held = iter([3.0, 2.0, 0.4, 5.0])

    class Meter:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.other_cores = next(held)

    assert bench.settle_row(1.0, 10.0, window=0.25, meter=Meter) == 0.5  # two busy windows, then a quiet one
    held = iter([4.0] * 10)
    assert bench.settle_row(1.0, 1.0, window=0.25, meter=Meter) == 1.0  # never quiet: the limit
    held = iter([None])
    assert bench.settle_row(1.0, 1.0, window=0.25, meter=Meter) == 0.0  # no /proc: no wait


def test_warm_up_compiles_both_directions_and_leaves_errors_to_the_row():
    x = torch.ones(3, requires_grad=True)
    calls = []
    bench.warm_up(lambda: calls.append("fwd") or x * 2, grad_of=[x])
    assert calls == ["fwd"] and x.grad is None  # the backward ran and its gradient was dropped
    bench.warm_up(lambda: (_ for _ in ()).throw(RuntimeError("no kernel")))  # not raised


def test_shape_option_takes_five_positive_ints():
    assert bench.parse_shape("4,16,16,4096,64") == (4, 16, 16, 4096, 64)
    for bad in ("4,16,16,4096", "4,16,16,4096,0", "a,16,16,4096,64"):
        with pytest.raises(bench.argparse.ArgumentTypeError, match="B,Hq,Hkv,N,D"):
            bench.parse_shape(bad)


def test_short_rows_are_timed_three_times_and_long_ones_twice():
    assert [bench.eager_rounds(n) for n in (1024, bench.GRAPH_MAX_N, 16384, 65536)] == [3, 3, 2, 2]


def test_the_compile_pool_is_started_ahead_and_kept_up(monkeypatch):
    """`quiet_compiles` turns off the pool's idle shutdown and waits for its workers; where compiles run in the
    process (no pool) it waits for nothing; an error there leaves the run going (it is only noisier)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.async_compile import AsyncCompile

    calls = []
    monkeypatch.setattr(inductor_config, "quiesce_async_compile_pool", True, raising=False)
    monkeypatch.setattr(AsyncCompile, "use_process_pool", classmethod(lambda cls: calls.append("use") or True))
    monkeypatch.setattr(AsyncCompile, "wait_pool_ready", classmethod(lambda cls, timeout=120: calls.append("wait")))
    bench.quiet_compiles()
    assert calls == ["use", "wait"] and inductor_config.quiesce_async_compile_pool is False
    calls.clear()
    monkeypatch.setattr(AsyncCompile, "use_process_pool", classmethod(lambda cls: calls.append("use") or False))
    bench.quiet_compiles()
    assert calls == ["use"]

    def broken(cls):
        raise RuntimeError("no pools in daemonic processes")

    monkeypatch.setattr(AsyncCompile, "use_process_pool", classmethod(broken))
    bench.quiet_compiles()  # prints why, does not raise


def test_dense_backward_in_any_order_is_compared_with_the_default_and_cudnn():
    """The any-order row (`SPARSE_FLASH_DETERMINISTIC=0`, dense forward+backward only) gets its ratios against
    the deterministic default and cuDNN of the same row, a section of the table, and the summary lists the dense
    forward+backward against cuDNN for both."""
    dense = dict(mask="dense", N=16384, D=128, density=1.0)
    rs = [row("sparse_flash", "fwd+bwd", 15.0, **dense), row("flex", "fwd+bwd", 18.0, **dense),
          row("sdpa_cudnn", "fwd+bwd", 13.5, **dense), row(bench.ANY_ORDER, "fwd+bwd", 13.0, **dense)]
    bench.add_ratios(rs)
    fast = rs[-1]
    assert fast["speedup_vs_deterministic"] == pytest.approx(15.0 / 13.0)
    assert fast["speedup_vs_cudnn_dense"] == pytest.approx(13.5 / 13.0)
    assert "speedup_vs_flex" not in fast
    s = bench.summarize(rs)
    assert s["dense_fwd_bwd_vs_cudnn"] == {"16384,128": pytest.approx(0.9)}
    assert s["dense_fwd_bwd_any_order_vs_cudnn"] == {"16384,128": pytest.approx(1.038, abs=1e-3)}
    meta = {"date": "d", "gpu": "g", "torch": "t", "triton": "tr", "cuda": "c", "host": {}}
    text = bench.markdown(meta, rs, [], s)
    assert "| 4,16,16,16384,128 | bfloat16 | 13.000 | 1.15x | 1.04x |" in text


def test_gpu_shards_split_the_tests_by_their_recorded_seconds():
    """SPARSE_FLASH_SHARD=i/n splits the tests by their GPU seconds (`conftest.shard_tests`: a long test's own,
    else a share of its file's remaining time): every test in exactly one shard, the same shards every time
    whatever the order, no shard over an even share by more than one test's time, so a file longer than a shard
    spreads over several; every test file has a recorded time or counts 1 s. `conftest.gpu_seconds` makes the
    record from the durations logs."""
    import json

    from conftest import GPU_SECONDS, OWN_SECONDS, shard_tests

    with open(GPU_SECONDS) as f:
        seconds = json.load(f)
    files = sorted(f"tests/{p.name}" for p in Path(__file__).parent.glob("test_*.py"))
    assert all(name.startswith("tests/test_") and value >= 0 for name, value in seconds.items())
    assert all(value >= OWN_SECONDS for name, value in seconds.items() if "::" in name)
    heaviest = max(files, key=lambda name: seconds.get(name, 1.0))
    tests_in = {name: 12 if name == heaviest else 1 + i % 7 * 5 for i, name in enumerate(files)}
    ids = [f"{name}::t[{j}]" for name in files for j in range(tests_in[name])]  # a stand-in collection
    weight = {i: seconds.get(i.split("::")[0], 1.0) / tests_in[i.split("::")[0]] for i in ids}
    for count in (1, 2, 3, 6):
        shards = shard_tests(ids, count)
        assert shards == shard_tests(ids[::-1], count)
        assert sorted(i for shard in shards for i in shard) == sorted(ids)
        loads = [sum(weight[i] for i in shard) for shard in shards]
        assert max(loads) <= sum(loads) / count + max(weight.values())
    assert sum(any(i.startswith(heaviest + "::") for i in shard) for shard in shard_tests(ids, 6)) > 1
    assert [sorted(s) for s in shard_tests(["a::1", "b::1", "c::1"], 2, {"a": 1, "b": 1, "c": 1})] == [
        ["a::1", "c::1"], ["b::1"]]
    # a::4 weighs its own 5 s, a's other tests share the file's remaining 6 s: 5 + 2 against 4 + 2 + 2
    assert [sorted(s) for s in shard_tests(["a::1", "a::2", "a::3", "a::4", "b::1"], 2, {"a": 6, "a::4": 5, "b": 4})] \
        == [["a::2", "a::4"], ["a::1", "a::3", "b::1"]]
    from conftest import gpu_seconds

    lines = [f"{OWN_SECONDS + 7:8.2f} tests/test_a.py::slow[x]", "    0.25 tests/test_a.py::quick", "0.3 tests/test_a.py::other",
             "1.0 tests/test_b.py::t"]
    assert gpu_seconds(lines) == {"tests/test_a.py": 0.6, "tests/test_a.py::slow[x]": OWN_SECONDS + 7,
                                  "tests/test_b.py": 1.0}


def test_a_resumed_run_keeps_only_groups_with_every_row():
    """`--resume` (a benchmark cut short by a time limit, continued in a second call): a (shape, dtype, mask)
    group is kept only when it holds every (impl, mode) row that a run times for it (the SDPA rows on dense and
    causal, the bool-mask row on butterfly, the any-order row on dense), else it is timed again whole; an error
    row counts as done."""
    import torch

    assert bench.row_tasks("random", torch.bfloat16) == [("sparse_flash", "fwd"), ("sparse_flash", "fwd+bwd"),
                                                         ("flex", "fwd"), ("flex", "fwd+bwd")]
    assert ("sdpa_bool_mask", "fwd") in bench.row_tasks("butterfly", torch.bfloat16)
    assert ("sdpa_bool_mask", "fwd") not in bench.row_tasks("butterfly", torch.float16)
    assert (bench.ANY_ORDER, "fwd+bwd") in bench.row_tasks("dense", torch.bfloat16)
    full = [row(i, m, 1.0, mask="dense", N=16384, D=128, density=1.0) for i, m in bench.row_tasks("dense", torch.bfloat16)]
    short = [row(i, m, 1.0) for i, m in bench.row_tasks("random", torch.bfloat16)]
    short[-1] = {k: v for k, v in short[-1].items() if k != "ms"} | {"error": "OutOfMemoryError"}
    cut = [row(i, m, 1.0, mask="causal") for i, m in bench.row_tasks("causal", torch.bfloat16)][:-1]
    kept = bench.finished_groups(full + short + cut)
    assert sorted(g[-1] for g in kept) == ["dense", "random"]
    assert kept[bench.group_of(full[0])] == full


SAMPLES, NOT_ISSUED = "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)"


def _sass_page(folder, first_line: str, rows: list[list[str]], end: str = ""):
    """An ncu source page: `first_line` (a note, or the line naming the kernel), then `rows` quoted, each line
    ending in `end` (ncu 2025 ends them with a comma)."""
    page = folder / "page.csv"
    page.write_text("\n".join([first_line] + [",".join(f'"{x}"' for x in row) + end for row in rows]) + "\n")
    return page


def test_stall_profile_summary_splits_samples_by_family_and_hot_loop(tmp_path):
    """`benchmarks/stall_profile.py`'s summary of an ncu source page (CSV, notes before the table, numbers
    with thousands separators): samples per opcode family, the share inside the hot loop (a guarded branch
    back over a product and an exponential), and the instructions ranked with their largest stall reasons."""
    import stall_profile

    page = _sass_page(tmp_path, "==PROF== a note", [
        ["# Address", "Source", SAMPLES, NOT_ISSUED, "smsp__pcsamp_warps_issue_stalled_barrier",
         "smsp__pcsamp_warps_issue_stalled_long_scoreboard"],
        ["0x10", "@P0 SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x8], R3", "1,200", "1100", "1000", "3"],
        ["0x20", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ", "300", "10", "0", "0"],
        ["0x30", "MUFU.EX2 R5, R6", "500", "100", "0", "0"],
        ["0x40", "@P1 BRA 0x20", "0", "0", "0", "0"],
        ["0x50", "LDG.E R7, desc[UR6][R2.64]", "100", "90", "0", "80"]])
    text = stall_profile.summarize(str(page), 2)
    assert "5 instructions, 2100 samples" in text
    assert "hot loop: instructions 1-3, 38.1% of the samples" in text
    assert "barrier wait (mbarrier)          1200  57.1%" in text and "global load                       100" in text
    ranked = text.splitlines()[-2:]
    assert "SYNCS.PHASECHK" in ranked[0] and "[barrier 1000, long_scoreboard 3]" in ranked[0]
    assert "MUFU.EX2" in ranked[1]


def test_stall_profile_summary_reads_ncu_2025_pages_and_groups_regions(tmp_path):
    """A page as ncu 2025 writes it (a line naming the kernel first, `stall_<reason>` columns, a trailing comma,
    the execution counts): the reasons are read, and runs of instructions executed equally often (a loop body,
    a per-item stretch) are summed into regions."""
    import stall_profile

    page = _sass_page(tmp_path, '"Kernel Name","_attn_fwd_hopper_kernel",', [
        ["Address", "Source", SAMPLES, NOT_ISSUED, "Instructions Executed", "stall_barrier", "stall_long_sb",
         "stall_barrier (Not Issued)"],
        ["0x10", "LDG.E R7, desc[UR6][R2.64]", "40", "30", "100", "0", "35", "0"],
        ["0x20", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ", "300", "10", "400", "0", "0", "0"],
        ["0x30", "MUFU.EX2 R5, R6", "500", "100", "400", "0", "0", "0"],
        ["0x40", "@P1 BRA 0x20", "0", "0", "400", "0", "0", "0"],
        ["0x50", "BAR.SYNC.DEFER_BLOCKING 0x2, 0x80", "160", "150", "100", "140", "0", "150"]], end=",")
    text = stall_profile.summarize(str(page), 1)
    assert "5 instructions, 1000 samples" in text
    assert "     1-3             400      800  80.0%  HGMMA" in text
    assert "     0-0             100       40   4.0%  LDG.E" in text and "     4-4             100      160  16.0%" in text
    assert "MUFU.EX2" in text.splitlines()[-1]
    (bar,) = [line for line in stall_profile.summarize(str(page), 5).splitlines() if "BAR.SYNC" in line and "[" in line]
    assert bar.endswith("[barrier 140]")  # the not-issued column is not a reason of its own


def test_load_windows_place_each_call_on_the_host_clock_and_read_the_clocks_it_ran_under(monkeypatch):
    """`profile_rows.py --load` on made-up events: each window holds its calls' median time and the NVML
    samples taken while those calls ran (their GPU start placed on the host's clock from the first call's);
    without NVML the windows say so instead of showing a clock."""
    import profile_rows

    class Event:  # a call's events on a fake GPU clock: every call takes 1 ms, the last half 2 ms
        clock = [0.0]

        def __init__(self, enable_timing=True):
            self.t = None

        def record(self):
            self.t = Event.clock[0]

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    calls = [0]

    def step():
        calls[0] += 1
        Event.clock[0] += 1e-3 if calls[0] <= 21 else 2e-3  # call 1 sizes the run; then 20 calls of 1 ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    clocks = profile_rows.Clocks.__new__(profile_rows.Clocks)
    clocks.error, clocks.samples = None, []
    monkeypatch.setattr(profile_rows.time, "perf_counter", lambda: 100.0)  # the host time of the first call
    monkeypatch.setattr(profile_rows.time, "sleep", lambda s: None)
    # two samples while the first window (calls 0-9: GPU times 0-10 ms) ran, one capped; one in the last
    clocks.samples = [(100.002, 1980, 400.0, False), (100.008, 1700, 700.0, True), (100.05, 1500, 710.0, True),
                      (101.0, 345, 70.0, False)]
    out = profile_rows.back_to_back(step, clocks, seconds=0.04, windows=4, idle_s=0.0)
    assert out["calls"] == 40  # 0.04 s over the first call's 1 ms
    first, last = out["windows"][0], out["windows"][-1]
    assert first["calls"] == [0, 10] and abs(first["median_us"] - 1000.0) < 1e-6
    assert first["sm_mhz"] == 1840 and first["watts_max"] == 700.0 and first["capped"] == 0.5
    assert abs(last["median_us"] - 2000.0) < 1e-6 and last["sm_mhz"] == 1500 and last["samples"] == 1
    clocks.samples = []
    assert profile_rows.back_to_back(step, clocks, seconds=0.04, windows=4, idle_s=0.0)["windows"][0]["sm_mhz"] is None


def test_clock_meter_reads_the_samples_of_its_stretch_of_time(monkeypatch):
    """`bench_attention.Clocks.meter` (each timing round's SM clock): the samples between its start and end,
    none from before or after; no samples (no NVML) gives None, not a number."""
    now = [10.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])
    clocks = bench.Clocks.__new__(bench.Clocks)
    clocks.error = None
    clocks.samples = [(9.0, 1980, 100.0, False), (10.5, 1600, 700.0, True), (10.7, 1800, 650.0, False),
                      (12.0, 1980, 90.0, False)]
    with clocks.meter() as gpu:
        now[0] = 11.0
    assert gpu == {"sm_mhz": 1700, "watts_max": 700.0, "capped": 0.5, "samples": 2}
    clocks.samples = []
    with clocks.meter() as gpu:
        pass
    assert gpu["sm_mhz"] is None and gpu["capped"] is None


@pytest.mark.parametrize("argv, words", [
    (["benchmarks/density_fit.py", "--head-dims", "x"], "take comma-separated integers"),
    (["benchmarks/density_fit.py", "--seq-len", "-1"], "--seq-len must be at least 1"),
    (["benchmarks/sanitize.py", "--help"], "Problem names: causal ragged"),
])
def test_benchmark_scripts_answer_help_and_bad_flags_in_one_line(argv, words):
    """Found by the seventeenth probe: tracebacks for bad flags, and no help from sanitize.py."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, *argv], cwd=root, capture_output=True, text=True, timeout=240)
    assert "Traceback" not in done.stderr and words in done.stdout + done.stderr, done.stderr
    assert done.returncode == (0 if "--help" in argv else 2)

"""Test configuration: devices, dtypes, hypothesis profiles, NaN poisoning and the error record.

Without a CUDA GPU the triton backend runs on the CPU under the Triton interpreter (TRITON_INTERPRET=1,
set here before anything imports triton); with one, it runs compiled on the GPU and bfloat16 joins the
dtypes (the interpreter computes bfloat16 wrongly, so it is tested on the GPU only).
"""

import collections
import contextlib
import glob
import json
import os
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=10, deadline=None, print_blob=True)  # CI: 2 cores, 20 minutes
settings.register_profile("gpu", max_examples=20, deadline=None, print_blob=True)
settings.register_profile("dev", max_examples=8, deadline=None, print_blob=True)
settings.register_profile("deep", max_examples=300, deadline=None, print_blob=True)  # a fuzz campaign, by hand
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gpu" if HAS_CUDA else "ci"))



def examples(n: int) -> int:
    """A test's own number of examples, `n` at 20 a profile (`gpu`'s), scaled to the profile in force: the `ci`
    profile's 10 gives n // 2 (at least 1), `deep`'s 300 gives 15 n: `@settings(max_examples=examples(8))` draws
    4 in CI and 8 on a GPU."""
    return max(1, n * settings().max_examples // 20)


DEVICE = "cuda" if HAS_CUDA else "cpu"
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])


def triton_usable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"


_IN_WORKER = False  # a pytest-xdist worker (the controller alone writes the logs below)


def pytest_configure(config):
    global _IN_WORKER
    _IN_WORKER = hasattr(config, "workerinput")


def pytest_collection_modifyitems(config, items):
    """Skip GPU tests without a GPU; with SPARSE_FLASH_SHARD=i/n keep the i-th of n shards (`shard_tests`), for a
    suite split over several time-limited calls."""
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
    shard = os.environ.get("SPARSE_FLASH_SHARD")
    if shard:
        index, count = (int(x) for x in shard.split("/"))
        if not 1 <= index <= count:
            raise pytest.UsageError(f"SPARSE_FLASH_SHARD must be i/n with 1 <= i <= n, got {shard!r}")
        mine = shard_tests([item.nodeid for item in items], count)[index - 1]
        deselected = [item for item in items if item.nodeid not in mine]
        items[:] = [item for item in items if item.nodeid in mine]
        config.hook.pytest_deselected(items=deselected)


GPU_SECONDS = os.path.join(os.path.dirname(__file__), "gpu_seconds.json")  # per long test and file, from a GPU run


def shard_tests(nodeids, count: int, seconds: dict | None = None) -> list[set]:
    """The tests `nodeids` in `count` shards of about equal GPU time. A test's time is its own where `seconds`
    (by default `GPU_SECONDS`, written by `gpu_seconds` from a whole suite's durations) holds it, else a share of
    its file's remaining time (the file's entry shared evenly among its tests without their own; a file missing
    there counts 1 s), so a long file spreads over the shards. The longest tests go first, each into the shard
    with the least time so far; the same tests give the same shards.

    Example:
        >>> ids = ["a::1", "a::2", "a::3", "a::4", "b::1"]
        >>> [sorted(shard) for shard in shard_tests(ids, 2, {"a": 6, "a::4": 5, "b": 4})]  # 2 s for a::1..3
        [['a::2', 'a::4'], ['a::1', 'a::3', 'b::1']]
    """
    if seconds is None:
        with open(GPU_SECONDS) as f:
            seconds = json.load(f)
    without_own = collections.Counter(nodeid.split("::")[0] for nodeid in set(nodeids) if nodeid not in seconds)

    def weight(nodeid: str) -> float:
        if nodeid in seconds:
            return seconds[nodeid]
        name = nodeid.split("::")[0]
        return seconds.get(name, 1.0) / without_own[name]

    shards, loads = [set() for _ in range(count)], [0.0] * count
    for nodeid in sorted(set(nodeids), key=lambda nodeid: (-weight(nodeid), nodeid)):
        emptiest = loads.index(min(loads))
        shards[emptiest].add(nodeid)
        loads[emptiest] += weight(nodeid)
    return shards


OWN_SECONDS = 5.0  # a test this long or longer keeps its own time in `GPU_SECONDS`


def gpu_seconds(lines) -> dict:
    """`GPU_SECONDS`' content from the lines of the suite's durations logs (`seconds nodeid`, as
    benchmarks/run_gpu_checks.sh writes them; the shards' logs together for a whole suite): each test of
    `OWN_SECONDS` or more by itself, and per file the sum of its other tests, rounded to 0.1 s.

    Example:
        >>> gpu_seconds(["  12.04 tests/test_a.py::slow", "   0.5 tests/test_a.py::quick", "0.2 tests/test_b.py::x"])
        {'tests/test_a.py': 0.5, 'tests/test_a.py::slow': 12.0, 'tests/test_b.py': 0.2}
    """
    out = collections.Counter()
    for line in lines:
        t, nodeid = line.split(None, 1)
        nodeid, t = nodeid.strip(), float(t)
        out[nodeid if t >= OWN_SECONDS else nodeid.split("::")[0]] += t
    return {name: round(value, 1) for name, value in sorted(out.items())}


@contextlib.contextmanager
def fresh_plans():
    """Launch plans fix their tiles when built: a test that patches the tile settings starts and ends
    with none kept, so that it runs its settings and leaves no plan built with them behind."""
    from sparse_flash.kernels.launch import forget_plans

    forget_plans()
    try:
        yield
    finally:
        forget_plans()


class DeviceWaits(TorchDispatchMode):
    """Counts what makes the host wait for the device's results on a GPU, also when the test runs on the CPU:
    operators whose output size depends on the data (nonzero, boolean indexing, repeat_interleave without its
    size, and `ops`), and reads of tensor values on the host (`tolist`, `item`, `int`, ...), except in the
    functions named in `host`, which work on host tensors by design.

    Use: `with DeviceWaits(monkeypatch) as counter: ...`, then `monkeypatch.undo()` and read `counter.waits`.
    """

    READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")
    SIZED_BY_DATA = (torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default,
                     torch.ops.aten.repeat_interleave.Tensor, torch.ops.aten._unique2.default,
                     torch.ops.aten.unique_dim.default, torch.ops.aten.unique_consecutive.default)
    BOOL_INDEXED = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default)

    HOST = ("_causal_blocks", "run_sizes", "_host_split", "_host_butterfly", "pattern_runs", "pattern_sizes",
            "diagonal_runs", "_neighborhood_runs", "union_runs", "complement_runs")  # list blocks on the host

    def __init__(self, monkeypatch, host=HOST, ops=()):
        super().__init__()
        self.waits, self.host, self.ops = 0, frozenset(host), (*self.SIZED_BY_DATA, *ops)
        for name in self.READS:
            monkeypatch.setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name)))

    def _on_host(self) -> bool:
        """Whether a function named in `host` is running."""
        return any(frame.name in self.host for frame in traceback.extract_stack())

    def _counted(self, read):
        def counted(t, *args):
            if not self._on_host():
                self.waits += 1
            return read(t, *args)
        return counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bool_index = func in self.BOOL_INDEXED and any(t is not None and t.dtype == torch.bool for t in args[1])
        sized = func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None
        if (bool_index or (func in self.ops and not sized)) and not self._on_host():
            self.waits += 1
        return func(*args, **kwargs)


@pytest.fixture(autouse=True)
def _poison_kernel_outputs():
    """Every kernel output starts as NaN, so a tile the kernels forget to write fails the test; and no
    launch plan kept by an earlier test serves this one."""
    if not triton_usable():
        yield
        return
    from sparse_flash.testing import poison_outputs

    with poison_outputs(), fresh_plans():
        yield


def pytest_runtest_logreport(report):
    """With SPARSE_FLASH_FAILURE_LOG=path, append each failure as it is reported (its test id, then its last
    lines), so that a run killed by a time limit still says what failed and why (pytest's own summary comes
    only at the end); with SPARSE_FLASH_DURATION_LOG=path, each test's seconds as it ends. Under xdist the
    controller writes them, once per report."""
    if _IN_WORKER:
        return
    durations = os.environ.get("SPARSE_FLASH_DURATION_LOG")
    if durations and report.when == "call":
        with open(durations, "a") as f:
            f.write(f"{report.duration:8.1f} {report.nodeid}\n")
    path = os.environ.get("SPARSE_FLASH_FAILURE_LOG")
    if not path or not report.failed or hasattr(report, "wasxfail"):
        return
    text = str(report.longrepr).strip().splitlines()
    with open(path, "a") as f:
        f.write(f"FAILED {report.nodeid} ({report.when})\n" + "".join(f"    {line}\n" for line in text[-12:]))


def pytest_sessionfinish(session, exitstatus):
    """With SPARSE_FLASH_ERROR_LOG=path, write the max errors per backend and dtype seen in this run
    (under pytest-xdist each worker writes path.<worker> and the controller merges them)."""
    path = os.environ.get("SPARSE_FLASH_ERROR_LOG")
    if not path:
        return
    from sparse_flash.testing import ERROR_LOG

    mine = {
        f"{backend}/{dtype}": {"cases": e["cases"], "max_error": dict(e["max_error"]), "max_ratio": dict(e["max_ratio"])}
        for (backend, dtype), e in ERROR_LOG.items()
    }
    worker = getattr(session.config, "workerinput", {}).get("workerid")
    if worker is not None:
        with open(f"{path}.{worker}", "w") as f:
            json.dump(mine, f)
        return
    parts = [mine]
    for name in sorted(glob.glob(f"{glob.escape(path)}.*")):
        with open(name) as f:
            parts.append(json.load(f))
        os.remove(name)
    merged: dict = {}
    for part in parts:
        for key, e in part.items():
            m = merged.setdefault(key, {"cases": 0, "max_error": {}, "max_ratio_to_pytorch_same_dtype": {}})
            m["cases"] += e["cases"]
            for q, err in e["max_error"].items():
                m["max_error"][q] = max(m["max_error"].get(q, 0.0), err)
            for q, r in e["max_ratio"].items():
                m["max_ratio_to_pytorch_same_dtype"][q] = max(m["max_ratio_to_pytorch_same_dtype"].get(q, 0.0), r)
    with open(path, "w") as f:
        json.dump(dict(sorted(merged.items())), f, indent=2)

"""The cached direct launch: same signature -> direct call; anything Triton specialises on -> normal path."""

import sys
import types

import pytest
import torch

from sparse_flash.kernels import launch as launch_mod
from sparse_flash.kernels import settings


class FakeCompiled:
    packed_metadata = object()
    function = "fn"

    def __init__(self, log):
        self.log = log

    def run(self, *args):
        self.log.append(("direct", args))


class FakeKernel:
    """Stands in for a JITFunction: `kernel[grid](*args, **kw)` records a normal launch."""

    arg_names = ["X", "n", "scale", "BLOCK", "FLAG"]
    __name__ = "fake_kernel"

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.log.append(("normal", grid, args, kw))
            return FakeCompiled(self.log)
        return run


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(settings, "interpreting", lambda: False)
    monkeypatch.setattr(launch_mod, "_current_device", lambda: 0)
    monkeypatch.setattr(launch_mod, "_raw_stream", lambda device: 7)
    monkeypatch.setattr(launch_mod, "_hooks_installed", lambda: False)
    monkeypatch.setattr(launch_mod, "_bind_context", lambda device: None)  # no CUDA context on the CPU
    monkeypatch.setattr(launch_mod, "_CACHE", {})
    with settings.override(fast_launch=True):
        yield


def kinds(kernel):
    return [entry[0] for entry in kernel.log]


def test_repeat_call_goes_direct_with_constexprs_in_order(fast):
    kernel, x = FakeKernel(), torch.zeros(64)
    for scale in (0.5, 0.25):  # floats are not part of the signature
        launch_mod.launch(kernel, (3,), (x, 32, scale), {"BLOCK": 16, "FLAG": True}, 4, 3)
    assert kinds(kernel) == ["normal", "direct"]
    assert kernel.log[0][3] == {"BLOCK": 16, "FLAG": True, "num_warps": 4, "num_stages": 3}
    _, direct = kernel.log[1]
    assert direct[:4] == (3, 1, 1, 7)
    assert direct[7:] == (None, None, x, 32, 0.25, 16, True)  # no launch hooks, then args, then constexprs


def test_register_cap_reaches_triton_and_keys_the_cache(fast):
    kernel, x = FakeKernel(), torch.zeros(64)
    cx = {"BLOCK": 16, "FLAG": True}
    launch_mod.launch(kernel, (1,), (x, 32, 1.0), cx, 8, 2, 128)
    assert kernel.log[0][3] == {**cx, "num_warps": 8, "num_stages": 2, "maxnreg": 128}
    launch_mod.launch(kernel, (1,), (x, 32, 1.0), cx, 8, 2, 128)
    launch_mod.launch(kernel, (1,), (x, 32, 1.0), cx, 8, 2)  # no cap: another compiled kernel
    assert kinds(kernel) == ["normal", "direct", "normal"]
    assert "maxnreg" not in kernel.log[2][3]


class OutOfResources(Exception):
    """Shaped like Triton's: what ran out is in `name`."""

    def __init__(self, required, limit, name):
        super().__init__(f"out of resource: {name}, Required: {required}, Hardware limit: {limit}")
        self.name = name


class SmallGPUKernel(FakeKernel):
    """A kernel that needs 60 KB of shared memory per pipeline stage on a GPU with `limit` KB."""

    def __init__(self, limit, resource="shared memory"):
        super().__init__()
        self.limit, self.resource = limit, resource

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.log.append(("normal", grid, args, kw))
            if 60 * kw["num_stages"] > self.limit:
                raise OutOfResources(60 * kw["num_stages"], self.limit, self.resource)
            return FakeCompiled(self.log)
        return run


@pytest.mark.parametrize("interpreting", [False, True], ids=["fast", "normal path"])
def test_a_pipeline_too_deep_for_the_gpu_runs_with_fewer_stages(fast, monkeypatch, interpreting):
    monkeypatch.setattr(settings, "interpreting", lambda: interpreting)
    kernel, x = SmallGPUKernel(limit=130), torch.zeros(64)
    cx = {"BLOCK": 16, "FLAG": True}
    launch_mod.launch(kernel, (1,), (x, 32, 1.0), cx, 4, 3)
    assert [entry[3]["num_stages"] for entry in kernel.log] == [3, 2]  # 180 KB, then 120 KB
    launch_mod.launch(kernel, (1,), (x, 32, 1.0), cx, 4, 3)  # the kernel that fits, kept under the call's key
    assert kinds(kernel)[2:] == (["normal", "normal"] if interpreting else ["direct"])


@pytest.mark.parametrize("limit, resource", [(50, "shared memory"), (500, "threads")])
def test_launches_that_cannot_fit_raise_tritons_error(fast, limit, resource):
    """One stage that does not fit, or another resource short: Triton's error reaches the caller."""
    kernel, x = SmallGPUKernel(limit, resource), torch.zeros(64)
    with pytest.raises(OutOfResources, match=resource):
        launch_mod.launch(kernel, (1,), (x, 32, 1.0), {"BLOCK": 16, "FLAG": True}, 4, 3 if limit == 50 else 9)
    assert kernel.log[-1][3]["num_stages"] == (1 if limit == 50 else 9)


@pytest.mark.parametrize("change", ["int value", "alignment", "dtype", "constexpr", "warps", "disabled", "hook"])
def test_anything_triton_specialises_on_takes_the_normal_path(fast, monkeypatch, change):
    kernel, x = FakeKernel(), torch.zeros(64)
    args, cx, warps = (x, 32, 1.0), {"BLOCK": 16, "FLAG": True}, 4
    launch_mod.launch(kernel, (1,), args, cx, warps, 3)
    if change == "int value":
        args = (x, 1, 1.0)  # Triton turns an int equal to 1 into a constant
    elif change == "alignment":
        args = (x[1:], 32, 1.0)  # 4 bytes off a 16-byte boundary
    elif change == "dtype":
        args = (x.half(), 32, 1.0)
    elif change == "constexpr":
        cx = {"BLOCK": 32, "FLAG": True}
    elif change == "warps":
        warps = 8
    elif change == "hook":
        monkeypatch.setattr(launch_mod, "_hooks_installed", lambda: True)
    with settings.override(fast_launch=change != "disabled"):
        launch_mod.launch(kernel, (1,), args, cx, warps, 3)
    assert kinds(kernel) == ["normal", "normal"]


def test_constexprs_out_of_order_are_refused(fast):
    with pytest.raises(TypeError, match="constexprs must be its last parameters"):
        launch_mod.launch(FakeKernel(), (1,), (torch.zeros(4), 2, 1.0), {"FLAG": True, "BLOCK": 16}, 4, 3)


@pytest.mark.parametrize("change", ["none", "block shape", "shape", "strides", "dtype", "tensor instead"])
def test_descriptor_arguments_key_on_all_but_their_data(fast, change):
    """A TMA descriptor's block shape, shape, strides and dtype select the compiled kernel; its data does not."""
    TensorDescriptor = pytest.importorskip("triton.tools.tensor_descriptor").TensorDescriptor

    def desc(t, block=(1, 1, 16, 32)):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))

    kernel, x = FakeKernel(), torch.zeros(2, 3, 64, 32)
    launch_mod.launch(kernel, (1,), (desc(x), 32, 1.0), {"BLOCK": 16, "FLAG": True}, 4, 3)
    y = {"none": desc(torch.ones(2, 3, 64, 32)), "block shape": desc(x, (1, 1, 32, 32)),
         "shape": desc(torch.zeros(2, 3, 48, 32)), "strides": desc(torch.zeros(2, 64, 3, 32).transpose(1, 2)),
         "dtype": desc(x.half()), "tensor instead": x}[change]
    launch_mod.launch(kernel, (1,), (y, 32, 1.0), {"BLOCK": 16, "FLAG": True}, 4, 3)
    assert kinds(kernel) == ["normal", "direct" if change == "none" else "normal"]


def test_a_constexpr_may_name_a_launch_option(fast):
    """Gluon kernels take num_warps as their last parameter: it goes to Triton once, with the constexpr's
    value, and direct calls pass it positionally like any constexpr."""

    class GluonLike(FakeKernel):
        arg_names = ["X", "n", "scale", "BLOCK", "num_warps"]

    kernel, x = GluonLike(), torch.zeros(64)
    for _ in range(2):
        launch_mod.launch(kernel, (2,), (x, 32, 1.0), {"BLOCK": 16, "num_warps": 4}, 4, 3, 168)
    assert kinds(kernel) == ["normal", "direct"]
    assert kernel.log[0][3] == {"BLOCK": 16, "num_warps": 4, "num_stages": 3, "maxnreg": 168}
    assert kernel.log[1][1][7:] == (None, None, x, 32, 1.0, 16, 4)


def test_gluon_descriptors_key_on_their_shared_memory_layout(fast):
    """Two Gluon descriptors alike but for their layout select different compiled kernels."""
    pytest.importorskip("triton.experimental.gluon")
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    x = torch.zeros(256, 128, dtype=torch.bfloat16)
    layouts = (gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16),
               gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2))
    kernel = FakeKernel()
    for layout in layouts + layouts[1:]:
        desc = TensorDescriptor(x, [256, 128], [128, 1], [64, 128], layout)
        launch_mod.launch(kernel, (1,), (desc, 32, 1.0), {"BLOCK": 16, "FLAG": True}, 4, 3)
    assert kinds(kernel) == ["normal", "normal", "direct"]


def test_bound_launch_passes_head_then_fixed_tail_and_constexprs(fast):
    """The first call compiles through Triton with every tensor; direct calls pass the trailing (constant)
    tensors by address."""
    kernel = FakeKernel()
    index = torch.arange(8, dtype=torch.int32)
    bound = launch_mod.BoundLaunch(kernel, 5, (index, 0.5), {"BLOCK": 16, "FLAG": True}, 4, 3)
    x, y = torch.zeros(64), torch.ones(64)
    bound(x)
    bound(y)
    assert kinds(kernel) == ["normal", "direct"]
    assert kernel.log[0][1] == (5,) and kernel.log[0][2][0] is x and kernel.log[0][2][1] is index
    _, direct = kernel.log[1]
    assert direct[:4] == (5, 1, 1, 7)
    assert direct[7:] == (None, None, y, index.data_ptr(), 0.5, 16, True)


@pytest.mark.parametrize("change", ["disabled", "hook"])
def test_bound_launch_takes_the_normal_path_when_direct_calls_are_off(fast, monkeypatch, change):
    kernel = FakeKernel()
    bound = launch_mod.BoundLaunch(kernel, 1, (32, 0.5), {"BLOCK": 16, "FLAG": True}, 4, 3)
    bound(torch.zeros(64))
    if change == "hook":
        monkeypatch.setattr(launch_mod, "_hooks_installed", lambda: True)
    with settings.override(fast_launch=change != "disabled"):
        bound(torch.zeros(64))
        bound(torch.zeros(64))
    assert kinds(kernel) == ["normal", "normal", "normal"]


def test_bound_launch_under_the_interpreter_launches_normally_every_time(fast, monkeypatch):
    monkeypatch.setattr(settings, "interpreting", lambda: True)
    kernel = FakeKernel()
    bound = launch_mod.BoundLaunch(kernel, 1, (32, 0.5), {"BLOCK": 16, "FLAG": True}, 4, 3)
    for _ in range(3):
        bound(torch.zeros(64))
    assert kinds(kernel) == ["normal"] * 3


def test_plan_key_follows_everything_a_plan_fixes(fast):
    x = torch.zeros(4, 2, 64, 32)
    key = launch_mod.plan_key((x,), "fwd", True, 0.5)
    assert launch_mod.plan_key((torch.ones(4, 2, 64, 32),), "fwd", True, 0.5) == key  # the data does not count
    others = [
        launch_mod.plan_key((x,), "fwd", False, 0.5),
        launch_mod.plan_key((x,), "fwd", True, 0.25),
        launch_mod.plan_key((x.half(),), "fwd", True, 0.5),
        launch_mod.plan_key((torch.zeros(4, 2, 48, 32),), "fwd", True, 0.5),
        launch_mod.plan_key((torch.zeros(4, 64, 2, 32).transpose(1, 2),), "fwd", True, 0.5),
        launch_mod.plan_key((torch.zeros(4 * 2 * 64 * 32 + 1)[1:].view(4, 2, 64, 32),), "fwd", True, 0.5),
    ]
    assert all(other != key for other in others)
    with settings.override(tma=False):  # a plan is built under the settings in force
        assert launch_mod.plan_key((x,), "fwd", True, 0.5) != key
    launch_mod.forget_plans()
    assert launch_mod.plan_key((x,), "fwd", True, 0.5) != key


def test_cached_plan_builds_once_per_key_and_stays_bounded(monkeypatch):
    built = []
    cache = {}
    for key in ("a", "a", "b", "a"):
        launch_mod.cached_plan(cache, key, lambda: built.append(key) or len(built))
    assert built == ["a", "b"] and cache == {"a": 1, "b": 2}
    assert launch_mod.cached_plan(None, "a", lambda: "fresh") == "fresh"  # no cache: built for the call
    monkeypatch.setattr(launch_mod, "PLAN_LIMIT", 2)
    launch_mod.cached_plan(cache, "c", lambda: 3)
    assert cache == {"c": 3}


# A Triton launcher of the layout `launch._raw_launch` knows (Triton 3.6): a `CudaLauncher` whose `launch` wraps
# the C launcher in a closure that encodes the descriptor arguments (by position) with `make_tensordesc_arg`.
RAW_MODULE = "fake_triton_driver"


class Desc:
    """A host descriptor (what `DescriptorSpec.make` builds): its tensor as `base`."""

    def __init__(self, base, rows):
        self.base, self.rows = base, rows


def make_desc(t, rows):
    make_desc.built += 1
    return Desc(t, rows)


def fake_driver(monkeypatch, log, **changes):
    module = types.ModuleType(RAW_MODULE)
    module._BASE_ARGS_FORMAT_LEN = changes.get("base_len", 13)

    def make_tensordesc_arg(arg, meta):
        log.append(("encode", arg.base.data_ptr(), meta))
        return [f"map{arg.base.data_ptr()}:{arg.rows}", arg.rows, 1]

    module.make_tensordesc_arg = make_tensordesc_arg
    monkeypatch.setitem(sys.modules, RAW_MODULE, module)

    def c_launch(*args):
        log.append(("raw", args))

    def wrap(launcher, tensordesc_indices, tensordesc_meta):
        def inner(*args):
            raise AssertionError(f"the raw launch goes below this wrapper ({launcher}, {tensordesc_indices}, "
                                 f"{tensordesc_meta})")
        return inner

    class CudaLauncher:
        global_scratch_size = changes.get("scratch", 0)
        profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = False, True

        def __init__(self):
            self.launch = wrap(c_launch, changes.get("positions", {0, 2}), changes.get("metas", ["m0", "m2"]))

        def __call__(self, *args):
            log.append(("wrapped", args))

    CudaLauncher.__module__ = RAW_MODULE
    return CudaLauncher()


class RawCompiled(FakeCompiled):
    def __init__(self, log, runner):
        super().__init__(log)
        self.run = runner


class RawKernel(FakeKernel):
    arg_names = ["A", "n", "B", "X", "scale", "BLOCK", "FLAG"]

    def __init__(self, runner):
        super().__init__()
        self.runner = runner

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.log.append(("normal", grid, args, kw))
            return RawCompiled(self.log, self.runner)
        return run


def test_bound_launch_encodes_each_descriptor_once_per_data_pointer(fast, monkeypatch):
    """Below a known launcher layout, direct calls pass each descriptor argument in its encoded form, kept
    per position and data pointer: a `DescriptorSpec` is built and encoded only for an address not met
    before, and the other arguments pass as they are, then the tail and the constexprs."""
    log = []
    kernel = RawKernel(fake_driver(monkeypatch, log))
    make_desc.built = 0
    index = torch.arange(8, dtype=torch.int32)
    bound = launch_mod.BoundLaunch(kernel, 5, (index, 0.5), {"BLOCK": 16, "FLAG": True}, 4, 3)
    a, b, c = torch.zeros(64), torch.zeros(64), torch.zeros(64)

    def spec(t, rows=32):
        return launch_mod.DescriptorSpec(t, make_desc, (rows,))

    bound(spec(a), 7, spec(b, 16))  # Triton's path: descriptors built, no encoding here
    assert kinds(kernel) == ["normal"] and isinstance(kernel.log[0][2][0], Desc) and make_desc.built == 2
    for _ in range(2):
        bound(spec(a), 7, spec(b, 16))
    bound(spec(c), 7, spec(b, 16))
    raw = [entry[1] for entry in log if entry[0] == "raw"]
    encoded = [entry[1:] for entry in log if entry[0] == "encode"]
    assert len(raw) == 3 and not any(entry[0] == "wrapped" for entry in log)
    assert encoded == [(a.data_ptr(), "m0"), (b.data_ptr(), "m2"), (c.data_ptr(), "m0")]
    assert make_desc.built == 5  # two for Triton's path, then a, b once, c once
    assert raw[0][:13] == (5, 1, 1, 7, "fn", False, True, None, None, FakeCompiled.packed_metadata, None, None, None)
    assert raw[0][13:] == (f"map{a.data_ptr()}:32", 32, 1, 7, f"map{b.data_ptr()}:16", 16, 1, index.data_ptr(),
                           0.5, 16, True)
    assert raw[2][13] == f"map{c.data_ptr()}:32"


@pytest.mark.parametrize("change", [dict(base_len=14), dict(scratch=64), dict(metas=["m0", None]),
                                    dict(positions={0, 3})])
def test_bound_launch_takes_tritons_launcher_where_the_raw_call_does_not_apply(fast, monkeypatch, change):
    """Another launcher layout, a kernel needing scratch memory, a descriptor without encoding metadata or
    among the trailing arguments: direct calls go through Triton's launcher with built descriptors."""
    log = []
    kernel = RawKernel(fake_driver(monkeypatch, log, **change))
    make_desc.built = 0
    bound = launch_mod.BoundLaunch(kernel, 5, (torch.zeros(2), 0.5), {"BLOCK": 16, "FLAG": True}, 4, 3)
    a = torch.zeros(64)
    for _ in range(3):
        bound(launch_mod.DescriptorSpec(a, make_desc, (32,)), 7, launch_mod.DescriptorSpec(a, make_desc, (16,)))
    assert kinds(kernel) == ["normal"] and [entry[0] for entry in log] == ["wrapped", "wrapped"]
    assert make_desc.built == 6 and isinstance(log[0][1][9], Desc)  # built on every call

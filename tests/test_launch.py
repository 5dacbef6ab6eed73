"""The cached direct launch: same signature -> direct call; anything Triton specialises on -> normal path."""

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

"""The kernels' switches (`kernels/settings.py`) and the one place that picks a kernel family per pass
(`kernels/dispatch.py`)."""

import dataclasses

import pytest
import torch
from conftest import DEVICE, triton_usable

from sparse_flash import masks
from sparse_flash.kernels import settings


def test_environment_is_parsed_with_one_rule():
    parsed = settings.from_environment({"SPARSE_FLASH_TMA": "0", "SPARSE_FLASH_HOPPER_FWD": "off",
                                        "SPARSE_FLASH_HOPPER_BWD": "True", "UNRELATED": "x"})
    assert parsed == settings.Settings(tma=False, hopper_forward=False, hopper_backward=True)
    assert settings.from_environment({}) == settings.Settings()
    with pytest.raises(ValueError, match="SPARSE_FLASH_FAST_LAUNCH must be 1 or 0.*'maybe'"):
        settings.from_environment({"SPARSE_FLASH_FAST_LAUNCH": "maybe"})


def test_configure_and_override_set_and_restore():
    before = settings.current()
    with settings.override(tma=not before.tma, poison=True) as inside:
        assert inside.tma != before.tma and inside.poison and settings.current() is inside
    assert settings.current() == before
    previous = settings.configure(hopper_balance=False)  # every thread's settings (the tests' poison block aside)
    try:
        assert previous.hopper_balance == before.hopper_balance and not settings.current().hopper_balance
    finally:
        settings.configure(**dataclasses.asdict(previous))
    assert settings.current() == before


@pytest.mark.parametrize("changes, match", [({"tmaa": True}, "unknown kernel setting 'tmaa'"),
                                            ({"tma": 1}, "tma must be a bool, got int 1")])
def test_bad_settings_are_refused(changes, match):
    with pytest.raises(TypeError, match=match):
        settings.configure(**changes)


def test_every_variable_names_a_field():
    fields = set(settings.Settings.__dataclass_fields__)
    assert set(settings.ENVIRONMENT) <= fields and len(set(settings.ENVIRONMENT.values())) == len(settings.ENVIRONMENT)


def test_the_interpreter_runs_the_triton_family_for_every_pass():
    pytest.importorskip("triton")
    from sparse_flash.kernels import dispatch

    if not settings.interpreting():
        pytest.skip("checks the CPU under TRITON_INTERPRET=1")
    mask = masks.butterfly(1024, 128)
    q = torch.randn(1, 2, 1024, 128, dtype=torch.float16)
    chosen = dispatch.families(q, q, q, mask.kernel_index(False), mask.kernel_geometry(False), out=q, do=q)
    assert chosen == dispatch.Families("triton", "triton", "triton")
    for switches in (dict(deterministic=False), dict(hopper_one_pass=True)):  # the one-pass kernel is Gluon's
        with settings.override(**switches):
            assert dispatch.families(q, q, q, None, None, out=q, do=q) == dispatch.Families("triton", "triton",
                                                                                             "triton")


def test_an_override_holds_in_its_own_thread_and_context_only():
    """A block in one thread changes nothing another thread sees; blocks left out of order leave no change
    behind; `configure` inside a block outlives it (the block restores only what it set)."""
    import threading

    before = settings.current()
    seen, entered, release = [], threading.Event(), threading.Event()

    def inside_a_block():
        with settings.override(tma=not before.tma):
            entered.set()
            release.wait(5)

    worker = threading.Thread(target=inside_a_block)
    worker.start()
    entered.wait(5)
    seen.append(settings.current().tma)
    release.set()
    worker.join()
    assert seen == [before.tma] and settings.current() == before
    first, second = settings.override(hopper_d64=not before.hopper_d64), settings.override(tma=not before.tma)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    second.__exit__(None, None, None)
    assert settings.current() == before
    with settings.override(hopper_d64=not before.hopper_d64):
        previous = settings.configure(hopper_balance=not before.hopper_balance)
    try:
        now = settings.current()
        assert now.hopper_balance != before.hopper_balance and now.hopper_d64 == before.hopper_d64
    finally:
        settings.configure(hopper_balance=previous.hopper_balance)


def test_an_empty_variable_is_unset_and_a_bad_one_fails_at_first_use_not_at_import(tmp_path):
    import subprocess
    import sys

    assert settings.from_environment({"SPARSE_FLASH_TMA": ""}) == settings.Settings()
    code = ("import sparse_flash\n"
            "from sparse_flash.kernels import settings\n"
            "try:\n    settings.current()\nexcept ValueError as e:\n    print('refused', e)\n")
    env = {**__import__("os").environ, "SPARSE_FLASH_HOPPER_FWD": "maybe"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "refused SPARSE_FLASH_HOPPER_FWD" in run.stdout, run.stderr[-2000:]
    cli = subprocess.run([sys.executable, "-m", "sparse_flash", "info"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert cli.returncode == 2 and "SPARSE_FLASH_HOPPER_FWD" in cli.stderr and "Traceback" not in cli.stderr


def test_settings_fields_are_bools():
    with pytest.raises(TypeError, match="tma must be a bool"):
        settings.Settings(tma="no")


@pytest.mark.skipif(not triton_usable(), reason="triton is not usable here")
def test_the_backward_runs_under_the_settings_of_its_forward_in_any_thread(monkeypatch):
    """Autograd runs a CUDA backward in a thread of its own, where the forward's `override` block is not open:
    the backward's kernels are still chosen under the forward's settings (here the backward runs in another
    thread, after the block has closed)."""
    import threading

    import sparse_flash
    from sparse_flash.kernels import dispatch, function

    seen = []
    real = dispatch.attn_bwd

    def recording(*args, **kwargs):
        seen.append(settings.current())
        return real(*args, **kwargs)

    monkeypatch.setattr(function, "attn_bwd", recording)
    before = settings.current()
    q = torch.randn(1, 1, 32, 16, device=DEVICE, requires_grad=True)
    with settings.override(tma=not before.tma, hopper_d64=not before.hopper_d64) as inside:
        out = sparse_flash.flash_attention(q, q, q, backend="triton")
    worker = threading.Thread(target=lambda: out.sum().backward())
    worker.start()
    worker.join()
    assert seen == [inside] and inside != before and settings.current() == before
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_applied_takes_settings_only():
    with pytest.raises(TypeError, match="Settings"):
        with settings.applied({"tma": True}):
            pass


def test_pytorch_deterministic_mode_outranks_the_setting():
    """`dispatch.deterministic()`: the setting, or PyTorch's `use_deterministic_algorithms`, which a user who
    switched it on expects every library to honour."""
    pytest.importorskip("triton")
    from sparse_flash.kernels import dispatch

    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        assert dispatch.deterministic()
        with settings.override(deterministic=False):
            assert not dispatch.deterministic()
            torch.use_deterministic_algorithms(True)
            assert dispatch.deterministic()
    finally:
        torch.use_deterministic_algorithms(was)


def test_configure_returns_every_threads_settings_so_restoring_them_keeps_a_block_local():
    """`configure` inside an `override` block returns the settings outside every block: putting them back (the
    save-and-restore idiom) leaves the block's fields to the block."""
    before = settings.current()
    with settings.override(tma=not before.tma):
        previous = settings.configure(hopper_balance=not before.hopper_balance)
        settings.configure(**dataclasses.asdict(previous))
        assert settings.current().tma != before.tma  # the block's, while it is open
    assert settings.current() == before


def test_triton_interpret_changed_after_triton_was_imported_is_a_clear_error(monkeypatch):
    """Triton makes its functions interpreted or compiled when it is imported; a TRITON_INTERPRET set or cleared
    later is named as the reason the triton backend cannot run (it failed deep inside Triton)."""
    pytest.importorskip("triton.language")
    from sparse_flash.api import triton_unavailable_reason
    from sparse_flash.checks import triton_problem

    assert settings.interpreter_mismatch() is None
    if settings.interpreting():
        monkeypatch.delenv("TRITON_INTERPRET")
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    reason = settings.interpreter_mismatch()
    assert reason is not None and "when Triton was imported" in reason
    if triton_problem() is None:  # else that problem is the reason given first
        device = torch.device("cpu" if settings.interpreting() else "cuda")  # a device the setting would serve
        assert triton_unavailable_reason(device) == reason


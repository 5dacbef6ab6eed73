"""The kernels' switches (`kernels/settings.py`) and the one place that picks a kernel family per pass
(`kernels/dispatch.py`)."""

import pytest
import torch

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
    previous = settings.configure(hopper_balance=False)
    try:
        assert previous == before and not settings.current().hopper_balance
    finally:
        settings.configure(hopper_balance=before.hopper_balance)


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

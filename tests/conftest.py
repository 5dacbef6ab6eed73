"""Test configuration: devices, dtypes, hypothesis profiles, NaN poisoning and the error record.

Without a CUDA GPU the triton backend runs on the CPU under the Triton interpreter (TRITON_INTERPRET=1,
set here before anything imports triton); with one, it runs compiled on the GPU and bfloat16 joins the
dtypes (the interpreter computes bfloat16 wrongly, so it is tested on the GPU only).
"""

import json
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None, print_blob=True)
settings.register_profile("gpu", max_examples=150, deadline=None, print_blob=True)
settings.register_profile("dev", max_examples=8, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gpu" if HAS_CUDA else "ci"))

DEVICE = "cuda" if HAS_CUDA else "cpu"
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])


def triton_usable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _poison_kernel_outputs():
    """Every kernel output starts as NaN, so a tile the kernels forget to write fails the test."""
    if not triton_usable():
        yield
        return
    from sparse_flash.testing import poison_outputs

    with poison_outputs():
        yield


def pytest_sessionfinish(session, exitstatus):
    """With SPARSE_FLASH_ERROR_LOG=path, write the max errors per backend and dtype seen in this run."""
    path = os.environ.get("SPARSE_FLASH_ERROR_LOG")
    if not path:
        return
    from sparse_flash.testing import ERROR_LOG

    record = {
        f"{backend}/{dtype}": {
            "cases": entry["cases"],
            "max_error": dict(entry["max_error"]),
            "max_ratio_to_pytorch_same_dtype": dict(entry["max_ratio"]),
        }
        for (backend, dtype), entry in sorted(ERROR_LOG.items())
    }
    with open(path, "w") as f:
        json.dump(record, f, indent=2)

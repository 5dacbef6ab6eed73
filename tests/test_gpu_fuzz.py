"""GPU fuzz of the kernels: many drawn problems per dtype against the float64 oracle (2x rule), every call the
kernels take, the Hopper (Gluon) kernels included (D = 64 or 128, lengths a multiple of 128, fp16/bf16; fp32 problems
stay small: the Gluon kernels do not take fp32, and its IEEE dot products are the slowest).

The suite's property tests draw a few examples each; this file draws `FUZZ_EXAMPLES` per dtype (default 10)
and, with SPARSE_FLASH_FUZZ_LOG=path, appends one line per drawn problem (`dtype ok|fail problem`), so a
long run leaves its count:
    FUZZ_EXAMPLES=500 FUZZ_SHARDS=8 SPARSE_FLASH_FUZZ_LOG=fuzz.log python -m pytest -n 8 tests/test_gpu_fuzz.py
"""

import os

import pytest
import torch
from conftest import DEVICE, KERNEL_DTYPES
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from strategies import MASK_KINDS, Problem

from sparse_flash.testing import compare_to_reference, make_qkv

pytestmark = pytest.mark.gpu

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "10"))  # per dtype, over all shards
SHARDS = int(os.environ.get("FUZZ_SHARDS", "1"))  # independent draws, so that pytest-xdist spreads them


@st.composite
def gpu_problems(draw, hopper: bool):
    """Small and odd problems for the Triton kernels, and (`hopper`: for 16-bit dtypes) long D=64/128 ones for the
    Hopper kernels."""
    Hkv = draw(st.integers(1, 2))
    groups = draw(st.sampled_from([1, 2, 4]))
    if hopper and draw(st.booleans()):  # the Hopper kernels' domain
        D, block_q, block_k = draw(st.sampled_from([64, 128])), 128, 128
        Nq = 128 * draw(st.integers(1, 16))
        Nk = Nq if draw(st.booleans()) else 128 * draw(st.integers(1, 16))
    else:
        D = draw(st.sampled_from([8, 16, 40, 64, 96, 128, 256]))
        block_q, block_k = draw(st.sampled_from([32, 64, 128])), draw(st.sampled_from([32, 64, 128]))
        Nq, Nk = draw(st.integers(1, 1100)), draw(st.integers(1, 1100))
    return Problem(B=draw(st.integers(1, 2)), Hq=Hkv * groups, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, block_q=block_q,
                   block_k=block_k, kind=draw(st.sampled_from(MASK_KINDS)),
                   density=draw(st.sampled_from([0.0, 0.1, 0.3, 0.7, 1.0])), causal=draw(st.booleans()),
                   seed=draw(st.integers(0, 2**16)))


def _record(dtype, ok: bool, p: Problem) -> None:
    path = os.environ.get("SPARSE_FLASH_FUZZ_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{str(dtype).replace('torch.', '')} {'ok' if ok else 'fail'} {p!r}\n")


@pytest.mark.parametrize("shard", range(SHARDS))
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@settings(max_examples=-(-EXAMPLES // SHARDS), deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.generate])  # no shrinking: a failure prints its problem at once
@given(data=st.data())
def test_kernels_match_reference(dtype, shard, data):
    p = data.draw(gpu_problems(hopper=dtype != torch.float32), label="problem")
    q, k, v = make_qkv(p.B, p.Hq, p.Hkv, p.Nq, p.Nk, p.D, dtype=dtype, device=DEVICE, seed=p.seed)
    failures = compare_to_reference(q, k, v, p.mask(DEVICE), causal=p.causal, backend="triton").failures()
    _record(dtype, not failures, p)
    assert not failures, f"{p}: {failures}"

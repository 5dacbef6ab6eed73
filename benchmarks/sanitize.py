"""Every kernel once on small awkward problems, for compute-sanitizer (memcheck, racecheck, synccheck).

    python benchmarks/sanitize.py             # compile and check the results (no sanitizer)
    compute-sanitizer --tool memcheck python benchmarks/sanitize.py
    compute-sanitizer --tool racecheck python benchmarks/sanitize.py "hopper causal" "d256"   # some problems

Problems: causal, empty rows, split lists, GQA, D 8/96/256, ragged tails, and the Hopper (Gluon) kernels' D=128
causal and sparse calls (D=64 too). They stay small, since racecheck slows every kernel by orders of magnitude; the split
problems build their masks with the work plans cutting every list longer than 2 blocks into at most 3 chunks
(`SPLIT_EVERY`), so that chunks and merges run at any size. Each runs forward and backward in bf16 and compares
with the float64 oracle (2x rule); the script prints one line per problem, with its seconds, and exits 1 on a
mismatch.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from strategies import Problem  # noqa: E402

from sparse_flash import mask_index  # noqa: E402
from sparse_flash.testing import compare_to_reference, make_qkv  # noqa: E402

PROBLEMS = {
    "causal ragged": Problem(1, 2, 2, 300, 300, 64, 64, 64, "dense", 1.0, True, 0),
    "empty rows": Problem(1, 2, 1, 200, 190, 40, 64, 32, "empty_rows", 0.5, False, 3),
    "split lists": Problem(1, 2, 2, 1100, 1100, 64, 128, 128, "bigbird", 1.0, False, 2),
    "gqa causal": Problem(2, 4, 1, 520, 520, 64, 128, 128, "random", 0.3, True, 3),
    "d8 tail": Problem(1, 1, 1, 97, 131, 8, 32, 32, "butterfly", 1.0, False, 4),
    "d96 causal": Problem(1, 2, 2, 257, 257, 96, 64, 64, "local", 1.0, True, 5),
    "d256": Problem(1, 1, 1, 200, 200, 256, 64, 64, "random", 0.5, False, 6),
    "hopper causal": Problem(1, 2, 2, 1024, 1024, 128, 128, 128, "causal", 1.0, True, 7),
    "hopper sparse": Problem(1, 2, 1, 1024, 1024, 128, 128, 128, "bigbird", 1.0, False, 8),
    "hopper split": Problem(2, 4, 2, 1024, 1024, 128, 128, 128, "bigbird", 1.0, False, 10),
    "hopper split causal": Problem(1, 2, 2, 1024, 1024, 128, 128, 128, "bigbird", 1.0, True, 9),
    "hopper d64 causal": Problem(1, 2, 2, 1024, 1024, 64, 128, 128, "local", 1.0, True, 11),
}
SPLIT_EVERY = {"split lists", "hopper split", "hopper split causal"}


def main(names: list[str]) -> int:
    if {"-h", "--help"} & set(names):
        print(__doc__.strip() + f"\n\nProblem names: {', '.join(PROBLEMS)}")
        return 0
    unknown = sorted(set(names) - set(PROBLEMS))
    if unknown:
        print(f"unknown problems {unknown}; choose from {sorted(PROBLEMS)}", file=sys.stderr)
        return 2
    bad = 0
    for name, p in PROBLEMS.items():
        if names and name not in names:
            continue
        started = time.perf_counter()
        q, k, v = make_qkv(p.B, p.Hq, p.Hkv, p.Nq, p.Nk, p.D, dtype=torch.bfloat16, device="cuda", seed=p.seed)
        cut = dict(SPLIT_MIN_CHUNK=2, SPLIT_FACTOR=0, SPLIT_MAX_CHUNKS=3) if name in SPLIT_EVERY else {}
        with mock.patch.multiple(mask_index, **cut) if cut else contextlib.nullcontext():
            mask = p.mask("cuda")
            index = mask.kernel_index(p.causal)  # the lists and work plans are built by here
        if cut and index.row_plan.split.shape[0] == 0:
            print(f"{name:22s} FAIL no list was cut", flush=True)
            bad += 1
            continue
        failures = compare_to_reference(q, k, v, mask, causal=p.causal, backend="triton").failures()
        torch.cuda.synchronize()
        print(f"{name:22s} {'ok' if not failures else 'FAIL ' + '; '.join(failures)} "
              f"({time.perf_counter() - started:.1f} s)", flush=True)
        bad += bool(failures)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Every kernel once on small awkward problems, for compute-sanitizer (memcheck, racecheck, synccheck).

    python benchmarks/sanitize.py             # compile and check the results (no sanitizer)
    compute-sanitizer --tool memcheck python benchmarks/sanitize.py
    compute-sanitizer --tool racecheck python benchmarks/sanitize.py "hopper causal" "d256"   # some problems

Problems: causal, empty rows, split lists (a global block), GQA, D 8/96/256, ragged tails, and the Hopper
(Gluon) kernels' D=128 causal and sparse calls. Each runs forward and backward in bf16 and compares with the
float64 oracle (2x rule); the script prints one line per problem and exits 1 on a mismatch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from strategies import Problem  # noqa: E402

from sparse_flash.testing import compare_to_reference, make_qkv  # noqa: E402

PROBLEMS = {
    "causal ragged": Problem(1, 2, 2, 300, 300, 64, 64, 64, "dense", 1.0, True, 0),
    "empty rows": Problem(1, 2, 1, 200, 190, 40, 64, 32, "empty_rows", 0.5, False, 3),
    "split lists": Problem(1, 2, 2, 5170, 5170, 64, 128, 128, "bigbird", 1.0, False, 2),  # 41 blocks: split
    "gqa causal": Problem(2, 4, 1, 520, 520, 64, 128, 128, "random", 0.3, True, 3),
    "d8 tail": Problem(1, 1, 1, 97, 131, 8, 32, 32, "butterfly", 1.0, False, 4),
    "d96 causal": Problem(1, 2, 2, 257, 257, 96, 64, 64, "local", 1.0, True, 5),
    "d256": Problem(1, 1, 1, 200, 200, 256, 64, 64, "random", 0.5, False, 6),
    "hopper causal": Problem(1, 2, 2, 1024, 1024, 128, 128, 128, "causal", 1.0, True, 7),
    "hopper sparse": Problem(1, 2, 1, 2048, 2048, 128, 128, 128, "bigbird", 1.0, False, 8),
    "hopper split causal": Problem(1, 2, 2, 5120, 5120, 128, 128, 128, "bigbird", 1.0, True, 9),
}


def main(names: list[str]) -> int:
    unknown = sorted(set(names) - set(PROBLEMS))
    if unknown:
        print(f"unknown problems {unknown}; choose from {sorted(PROBLEMS)}", file=sys.stderr)
        return 2
    bad = 0
    for name, p in PROBLEMS.items():
        if names and name not in names:
            continue
        q, k, v = make_qkv(p.B, p.Hq, p.Hkv, p.Nq, p.Nk, p.D, dtype=torch.bfloat16, device="cuda", seed=p.seed)
        failures = compare_to_reference(q, k, v, p.mask("cuda"), causal=p.causal, backend="triton").failures()
        torch.cuda.synchronize()
        print(f"{name:22s} {'ok' if not failures else 'FAIL ' + '; '.join(failures)}", flush=True)
        bad += bool(failures)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

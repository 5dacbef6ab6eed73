"""The Hopper forward at D=64, allowed for this run only (`fwd_hopper.HEAD_DIMS`), against the Triton
forward: `ab_kernels.py --switch hopper` on the benchmark's D=64 rows. Step 41 measured it at 0.91-1.01x
the Triton forward, before step 44's output store; this re-measures it. Run from the repository root on a
GPU:

    PYTHONPATH=. python benchmarks/probes/probe_hopper_d64.py out/ab_d64.json
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sparse_flash.kernels import fwd_hopper  # noqa: E402

fwd_hopper.HEAD_DIMS = (64, 128)
import ab_kernels  # noqa: E402

sys.argv = ["ab_kernels.py", "--switch", "hopper", "--rows",
            "64, 'local'|64, 'butterfly'|64, 'random'|64, 'bigbird'|64, 'dense'", "--repeats", "1",
            "--out", sys.argv[1] if len(sys.argv) > 1 else "ab_d64.json"]
ab_kernels.main()

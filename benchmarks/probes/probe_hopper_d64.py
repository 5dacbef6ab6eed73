"""A/B: the Hopper forward at D=64 (allowed for this run) against the Triton forward."""
import sys
sys.path.insert(0, "benchmarks")
from sparse_flash.kernels import fwd_hopper
fwd_hopper.HEAD_DIMS = (64, 128)
import ab_kernels
sys.argv = ["ab_kernels.py", "--switch", "hopper", "--rows", "64, 'local'|64, 'butterfly'|64, 'random'|64, 'bigbird'|64, 'dense'", "--repeats", "1", "--out", sys.argv[1]]
ab_kernels.main()

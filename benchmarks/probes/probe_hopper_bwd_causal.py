"""Each Hopper backward kernel alone on small causal and non-causal calls, in its own process (a fault
must not hide the other kernel's result), against the Triton backward's gradients.

    PYTHONPATH=. python benchmarks/probes/probe_hopper_bwd_causal.py            # every case
    PYTHONPATH=. python benchmarks/probes/probe_hopper_bwd_causal.py dq dense 256 1   # one case
"""
import os
import subprocess
import sys

import torch

CASES = [(kernel, mask, 256, 1) for kernel in ("dq", "dkdv") for mask in ("dense", "butterfly")] + [
    ("dq", "dense", 256, 0), ("dkdv", "dense", 256, 0)]



def main_case(kernel, mask_name, n, causal):
    from sparse_flash import masks
    from sparse_flash.kernels import bwd, bwd_hopper, dq_hopper, fwd
    sys.path.insert(0, "benchmarks")
    from ab_kernels import kernel_args

    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    mask = masks.dense(n, 128, device="cuda") if mask_name == "dense" else masks.butterfly(n, 128, device="cuda")
    rows, index, geom = kernel_args(mask, causal)
    scale = 128 ** -0.5
    out, lse = fwd.attn_fwd(q, k, v, rows, geom, causal, scale)
    dq_ref, dk_ref, dv_ref = bwd.attn_bwd(do, q, k, v, out, lse, index, geom, causal, scale)
    delta_ref = (do.float() * out.float()).sum(-1)
    torch.cuda.synchronize()
    if kernel == "dq":
        delta = torch.full_like(delta_ref, float("nan"))
        dq = dq_hopper.DqHopperPlan(q, k, index, geom, causal, scale)(q, k, v, out, do, lse, delta)
        torch.cuda.synchronize()
        print("dq maxdiff", (dq.float() - dq_ref.float()).abs().max().item(), "delta maxdiff",
              (delta - delta_ref).abs().max().item(), "nan", dq.isnan().sum().item())
    else:
        dk, dv = bwd_hopper.DkdvHopperPlan(q, k, index, geom, causal, scale)(q, k, v, do, lse, delta_ref)
        torch.cuda.synchronize()
        print("dk maxdiff", (dk.float() - dk_ref.float()).abs().max().item(), "dv maxdiff",
              (dv.float() - dv_ref.float()).abs().max().item(), "nan", dk.isnan().sum().item() + dv.isnan().sum().item())


if __name__ == "__main__":
    if len(sys.argv) == 5:
        main_case(sys.argv[1], sys.argv[2], int(sys.argv[3]), bool(int(sys.argv[4])))
        sys.exit(0)
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    procs = [(case, subprocess.Popen([sys.executable, __file__, *map(str, case)], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)) for case in CASES]  # in parallel
    for case, p in procs:
        try:
            text, _ = p.communicate(timeout=240)
            tail = text.strip().splitlines()[-1:] or ["(no output)"]
        except subprocess.TimeoutExpired:
            p.kill()
            tail = ["TIMEOUT (hang)"]
        print(case, tail[0][:200], flush=True)

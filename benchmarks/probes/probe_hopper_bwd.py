"""Hopper backward kernels against the Triton backward on a few shapes: gradient differences, NaN counts
and backward times, each case isolated so one failure does not hide the others.

    PYTHONPATH=. python benchmarks/probes/probe_hopper_bwd.py out.json
"""
import json
import sys
import traceback

import torch
import triton

import sparse_flash
from sparse_flash import masks
from sparse_flash.kernels import configs

CASES = [  # (B, Hq, Hkv, N, mask, causal)
    (1, 1, 1, 128, "dense", False), (1, 1, 1, 256, "dense", False), (1, 2, 2, 1024, "dense", False),
    (1, 2, 2, 1024, "dense", True), (1, 2, 2, 1024, "butterfly", False), (2, 4, 2, 1024, "dense", False),
    (2, 4, 4, 1024, "random", False), (4, 16, 16, 4096, "dense", False), (4, 16, 16, 4096, "butterfly", False),
    (1, 16, 16, 16384, "dense", False), (1, 16, 16, 16384, "bigbird", False),
]


def make_mask(name, n, h):
    if name == "dense":
        return masks.dense(n, 128, device="cuda")
    if name == "butterfly":
        return masks.butterfly(n, 128, device="cuda")
    if name == "random":
        return masks.random(n, 128, density=0.1, seed=3, num_heads=h, device="cuda")
    if name == "bigbird":
        return masks.bigbird(n, 128, device="cuda")
    raise ValueError(name)


def grads(q, k, v, do, mask, causal, hopper):
    previous = configs.set_hopper_backward(hopper)
    try:
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = sparse_flash.block_sparse_attention(qq, kk, vv, mask, causal=causal, backend="triton")
        out.backward(do)
        torch.cuda.synchronize()
        g = (qq.grad, kk.grad, vv.grad)
        fn = lambda: out.backward(do, retain_graph=True)
        out = sparse_flash.block_sparse_attention(qq, kk, vv, mask, causal=causal, backend="triton")
        ms = triton.testing.do_bench(fn, warmup=5, rep=30, grad_to_none=[qq, kk, vv]) if q.shape[2] >= 4096 else None
        return g, ms
    finally:
        configs.set_hopper_backward(previous)


rows = []
for B, Hq, Hkv, N, name, causal in CASES:
    row = {"case": [B, Hq, Hkv, N, name, causal]}
    try:
        torch.manual_seed(0)
        q = torch.randn(B, Hq, N, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, N, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, Hkv, N, 128, device="cuda", dtype=torch.bfloat16)
        do = torch.randn(B, Hq, N, 128, device="cuda", dtype=torch.bfloat16)
        mask = make_mask(name, N, Hq)
        (ref, ms_ref), (new, ms_new) = (grads(q, k, v, do, mask, causal, h) for h in (False, True))
        for label, a, b in zip("qkv", ref, new):
            row["d" + label] = {"maxdiff": (a.float() - b.float()).abs().max().item(),
                                "refmax": a.float().abs().max().item(), "nan": int(b.isnan().sum())}
        row["ms_triton"], row["ms_hopper"] = ms_ref, ms_new
    except Exception:  # one case's failure must not hide the others
        row["error"] = traceback.format_exc()[-1500:]
    rows.append(row)
    print(json.dumps(row)[:400], flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
print(f"{'case':42s} {'dq':>9s} {'dk':>9s} {'dv':>9s} {'triton':>8s} {'hopper':>8s}")
for r in rows:
    if "error" in r:
        print(f"{str(r['case']):42s} ERROR {r['error'].splitlines()[-1][:80]}")
        continue
    rel = [r[g]["maxdiff"] / max(r[g]["refmax"], 1e-9) for g in ("dq", "dk", "dv")]
    ms = [f"{m:8.3f}" if m else "       -" for m in (r["ms_triton"], r["ms_hopper"])]
    print(f"{str(r['case']):42s} " + " ".join(f"{x:9.2e}" for x in rel) + " " + " ".join(ms))

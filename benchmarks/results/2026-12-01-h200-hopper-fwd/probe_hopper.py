"""GPU probe: the Gluon Hopper forward against fwd.py: results and do_bench times on the benchmark's rows."""
import json, os, sys, time
import torch
sys.path.insert(0, "benchmarks")
from triton.testing import do_bench
from bench_attention import build_mask
from sparse_flash.kernels import fwd, fwd_hopper, _fwd_hopper_v2
OUT = os.environ.get("OUT", ".")

def args_for(mask, causal=False):
    idx = mask.kernel_index(causal)
    rows = [] if mask.is_dense else idx.rows()
    geom = [*mask.shape, *mask.block_size, int(mask.has_long_lists(causal))]
    return rows, geom

ROWS = [(1, 2, 2, 512, 128, "dense"), (1, 2, 2, 1024, 64, "random"), (4, 16, 16, 4096, 128, "dense")] + [
    (4, 16, 16, 4096, 128, m) for m in ("local", "butterfly", "random", "bigbird")] + [
    (4, 32, 8, 4096, 128, "butterfly")] + [(1, 16, 16, 16384, 128, m) for m in ("dense", "local", "butterfly", "random", "bigbird", "longformer")] + [
    (1, 8, 8, 65536, 64, m) for m in ("dense", "local", "butterfly", "random", "bigbird", "longformer")] + [
    (4, 16, 16, 4096, 64, m) for m in ("butterfly", "random")]
res = []
for B, Hq, Hkv, N, D, name in ROWS:
    if name == "dense":
        rows, geom = [], [1, 1, 1, 1, 128, 128, 0]
    else:
        mask = build_mask(name, N, "cuda")[0]
        rows, geom = args_for(mask)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    assert fwd_hopper.supported(q, k, v, False, geom, name == "dense"), (B, Hq, N, D, name)
    scale = D ** -0.5
    base = lambda: fwd.attn_fwd(q, k, v, rows, geom, False, scale)
    plans, plans2 = {}, {}
    new = lambda: fwd_hopper.attn_fwd_hopper(q, k, v, rows, geom, scale, plans)
    v2 = lambda: _fwd_hopper_v2.attn_fwd_hopper(q, k, v, rows, geom, scale, plans2)
    o1, l1 = base()
    t0 = time.time(); o2, l2 = new(); torch.cuda.synchronize(); first = time.time() - t0
    o3, l3 = v2(); torch.cuda.synchronize()
    d_o2 = float((o1.float() - o3.float()).abs().max())
    d_o = float((o1.float() - o2.float()).abs().max()); d_l = float((l1 - l2).abs().nan_to_num(0).max())
    nan = bool(o2.isnan().any() or l2.isnan().any()); inf_ok = bool(((l1 == float("-inf")) == (l2 == float("-inf"))).all())
    tb, tn, t2 = [], [], []
    for f, ts in ((base, tb), (new, tn), (v2, t2), (v2, t2), (new, tn), (base, tb), (base, tb), (new, tn), (v2, t2)):
        ts.append(do_bench(f, warmup=25, rep=100, return_mode="median"))
    r = dict(row=[B, Hq, Hkv, N, D, name], base_ms=min(tb), new_ms=min(tn), gain=min(tb) / min(tn), v2_ms=min(t2), v2_gain=min(tb) / min(t2), d_out_v2=d_o2, d_out=d_o, d_lse=d_l,
             nan=nan, inf_ok=inf_ok, first_call_s=first, runs=dict(base=tb, new=tn))
    res.append(r); print(r, flush=True)
json.dump(res, open(f"{OUT}/probe_hopper.json", "w"), indent=1)
print(f"{'row':42} {'fwd.py':>8} {'2wg':>8} {'gain':>6} {'8w':>8} {'gain':>6} {'d_out':>8} {'d_lse':>8} {'d_out8w':>8}")
for r in res:
    print(f"{str(r['row']):42} {r['base_ms']:8.3f} {r['new_ms']:8.3f} {r['gain']:6.3f} {r['v2_ms']:8.3f} {r['v2_gain']:6.3f} {r['d_out']:8.1e} {r['d_lse']:8.1e} {r['d_out_v2']:8.1e} {'NAN' if r['nan'] else ''}{'' if r['inf_ok'] else 'INF!'}")

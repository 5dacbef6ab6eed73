"""Re-time chosen benchmark rows eagerly, ours and FlexAttention interleaved, several rounds: for a row whose
eager time in a benchmark run stands apart from its CUDA-graph time (host hiccups)."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_attention import Competitors, bench, build_mask  # noqa: E402

ROWS = [(4, 16, 16, 4096, 128, "random"), (4, 16, 16, 4096, 128, "butterfly"), (4, 16, 16, 4096, 128, "local")]
comp = Competitors()
res = []
for B, Hq, Hkv, N, D, name in ROWS:
    mask, causal = build_mask(name, N, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, h, N, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for h in (Hq, Hkv, Hkv))
    impls = {"sparse_flash": comp.ours, "flex": comp.flex_attention}
    times = {t: {"fwd": [], "fwd+bwd": []} for t in impls}
    for rnd in range(4):
        for tag in (list(impls) if rnd % 2 == 0 else list(impls)[::-1]):
            f = impls[tag]
            times[tag]["fwd"].append(bench(lambda: f(q, k, v, mask, causal)))
            times[tag]["fwd+bwd"].append(bench(lambda: f(q, k, v, mask, causal), grad_of=[q, k, v]))
    r = dict(row=[B, Hq, Hkv, N, D, name], times=times)
    for mode in ("fwd", "fwd+bwd"):
        r[f"{mode}_vs_flex"] = min(times["flex"][mode]) / min(times["sparse_flash"][mode])
    print(r, flush=True)
    res.append(r)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "remeasure.json"), "w"), indent=1)
for r in res:
    print(r["row"], "fwd %.3fx" % r["fwd_vs_flex"], "fwd+bwd %.3fx" % r["fwd+bwd_vs_flex"],
          {t: [round(x, 3) for x in r["times"][t]["fwd+bwd"]] for t in r["times"]})

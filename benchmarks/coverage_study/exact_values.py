import sys, json, time, torch
sys.path.insert(0, "benchmarks/coverage_study")
import torch.nn.functional as F
from cases import build, CASES
from gns_callback.exact import exact_b_simple, per_example_gradients, exact_noise_scale
torch.set_num_threads(1)
import os
os.makedirs("benchmarks/coverage_study/out", exist_ok=True)
out = json.load(open("benchmarks/coverage_study/out/exact.json")) if os.path.exists("benchmarks/coverage_study/out/exact.json") else {}
for name in (sys.argv[1:] or CASES):
    t0 = time.time()
    model, inputs, y = build(name)
    G = per_example_gradients(model, F.cross_entropy, inputs, y)
    b, g2, tr = exact_noise_scale(G)
    torch.save(G, f"benchmarks/coverage_study/out/pe_{name}.pt")
    norms = G.pow(2).sum(1)
    out[name] = dict(b_simple=b, grad_sq=g2, trace=tr, top1pct_share=float(norms.sort(descending=True).values[:18].sum() / norms.sum()))
    print(name, out[name], f"{time.time()-t0:.1f}s", flush=True)
json.dump(out, open("benchmarks/coverage_study/out/exact.json", "w"), indent=1)

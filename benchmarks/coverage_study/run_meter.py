"""Run GradientNoiseScaleMeter(per_example) at fixed parameters over many seeds; record the run interval and per-step values.

usage: python benchmarks/coverage_study/run_meter.py CASE B MAX_EXAMPLES(int|None) STEPS SEED0 SEED1 TAG
"""
import sys, json, time, warnings
sys.path.insert(0, "benchmarks/coverage_study")
import numpy as np, torch
import torch.nn.functional as F
from cases import build
from gns_callback import GradientNoiseScaleMeter
torch.set_num_threads(1)
warnings.filterwarnings("ignore")

case, B, mx, steps, s0, s1, tag = sys.argv[1:8]
B, steps, s0, s1 = int(B), int(steps), int(s0), int(s1)
mx = None if mx == "None" else int(mx)
model, inputs, labels = build(case)
for p in model.parameters():
    p.grad = None
N = len(labels)
exact = json.load(open("benchmarks/coverage_study/out/exact.json"))[case]["b_simple"]
rows, xs, ys, yps, yts, lams, idxs = [], [], [], [], [], [], []
t0 = time.time()
for seed in range(s0, s1):
    g = torch.Generator().manual_seed(seed)
    rec_xy, rec_blend, rec_idx = [], [], []
    with GradientNoiseScaleMeter(model, method="per_example", per_example_max_examples=mx) as meter:
        run = meter.run
        orig = run.update_values
        def upd(step, valid, orig=orig):
            rec_xy.append((float(step[2]), float(step[3]), bool(valid)))
            return orig(step, valid)
        run.update_values = upd
        bl = meter.blend
        orig_b = bl.blend
        def blend(mean_sq, y_pairs, y_two, use, orig_b=orig_b, bl=bl):
            from gns_callback.blend import blend_weight
            from gns_callback.scalar_ops import TORCH
            lam = float(blend_weight(bl.sums.unbind(), TORCH))
            rec_blend.append((float(y_pairs), float(y_two), lam))
            return orig_b(mean_sq, y_pairs, y_two, use)
        bl.blend = blend
        for _ in range(steps):
            idx = torch.randint(0, N, (B,), generator=g)
            rec_idx.append(idx.numpy())
            F.cross_entropy(model(inputs[idx]), labels[idx]).backward()
            meter.step()
            model.zero_grad()
        est = meter.run_estimate
    assert est.failure is None, est.failure
    rows.append([est.b_simple, est.ci_low, est.ci_high, est.trace_sigma, est.grad_sq_norm, est.effective_steps, est.steps])
    a = np.array([(x, y) for x, y, v in rec_xy]); xs.append(a[:, 0]); ys.append(a[:, 1])
    if rec_blend:
        b = np.array(rec_blend); yps.append(b[:, 0]); yts.append(b[:, 1]); lams.append(b[:, 2])
    idxs.append(np.stack(rec_idx))
rows = np.array(rows)
cov = ((rows[:, 1] <= exact) & (exact <= rows[:, 2])).mean()
print(f"{case} B={B} max={mx} steps={steps} seeds {s0}-{s1}: coverage {cov:.3f}, mean|rel|={np.mean(np.abs(rows[:,0]/exact-1)):.3f}, "
      f"{(time.time()-t0)/(s1-s0):.2f}s/run", flush=True)
np.savez(f"benchmarks/coverage_study/out/{tag}.npz", rows=rows, x=np.array(xs), y=np.array(ys), yp=np.array(yps), yt=np.array(yts),
         lam=np.array(lams), idx=np.array(idxs), exact=exact, B=B, mx=-1 if mx is None else mx)

"""Table of the meter runs (run_meter.py outputs): coverage with Clopper-Pearson 95% CI, |rel err|, width."""
import sys, numpy as np
sys.path.insert(0, "benchmarks/coverage_study")
from analyze import cp
for tag in sys.argv[1:]:
    d = np.load(f"benchmarks/coverage_study/out/{tag}.npz"); r = d["rows"]; R = float(d["exact"])
    b, lo, hi = r[:, 0], r[:, 1], r[:, 2]
    k = int(((lo <= R) & (R <= hi)).sum()); n = len(r); c = cp(k, n); fin = np.isfinite(b)
    w = np.median((hi - lo) / R)
    print(f"{tag:22s} exact {R:7.1f} B/B {R/int(d['B']):5.1f}  held {k}/{n} [{c[0]:.3f},{c[1]:.3f}]  low>R {int((lo>R).sum())} high<R {int((hi<R).sum())}  "
          f"mean|rel| finite {np.mean(np.abs(b[fin]/R-1)):.3f} ({int((~fin).sum())} inf)  median|rel| {np.median(np.abs(b/R-1)):.3f}  "
          f"median width/exact {w:.3f}  unbounded {int(np.isinf(hi).sum())}")

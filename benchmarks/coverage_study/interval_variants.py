"""Coverage of interval variants on saved per-step (x, y) arrays (replica or meter npz).
usage: python benchmarks/coverage_study/interval_variants.py FILE.npz [FILE...]"""
import sys, json, math
sys.path.insert(0, "benchmarks/coverage_study"); sys.path.insert(0, ".")
import numpy as np
from scipy import stats
from gns_callback.smoothing import summarize_ratio, moment_columns
from analyze import cp

def sums_of(x, y):
    return [float(c.sum()) for c in moment_columns(x, y, np.ones_like(x))]

def row(name, lo, hi, R, est):
    k = int(((lo <= R) & (R <= hi)).sum()); n = len(lo); c = cp(k, n)
    fin = np.isfinite(hi)
    w = np.median(np.where(fin, (hi - lo) / R, np.inf))
    b = fin
    kb = int(((lo <= R) & (R <= hi) & b).sum())
    print(f"  {name:28s} cover {k}/{n} = {k/n:.3f} [{c[0]:.3f}, {c[1]:.3f}]  low>R {int((lo>R).sum()):4d}  high<R {int((hi<R).sum()):4d}  "
          f"unbounded {int((~fin).sum()):4d}  median rel width {w:.3f}; bounded held {kb}/{int(b.sum())}")

def variants(path):
    d = np.load(path); X, Y, R = d["x"], d["y"], float(d["exact"])
    n_seeds, n = X.shape
    S = [summarize_ratio(sums_of(X[i], Y[i])) for i in range(n_seeds)]
    est = np.array([s.ratio for s in S])
    print(f"== {path.split('/')[-1]}: exact {R:.1f}, B {int(d['B'])}, {n_seeds} seeds x {n} steps; mean|rel err| (finite) "
          f"{np.mean(np.abs(est[np.isfinite(est)]/R-1)):.3f} ({int((~np.isfinite(est)).sum())} inf), median |rel err| {np.median(np.abs(est/R-1)):.3f}")
    z = X - R * Y; zbar = z.mean(1); vz = z.var(1, ddof=1) / n
    mx, my = X.mean(1), Y.mean(1)
    tz = zbar / np.sqrt(vz)
    print(f"  var across seeds / mean formula var: x̄ {mx.var(ddof=1)/(X.var(1,ddof=1)/n).mean():.3f}, ȳ {my.var(ddof=1)/(Y.var(1,ddof=1)/n).mean():.3f}, "
          f"z̄ {zbar.var(ddof=1)/vz.mean():.3f}; per-step z skew {stats.skew(z,axis=1).mean():.2f} kurt {stats.kurtosis(z,axis=1).mean():.1f}; "
          f"corr(z̄, s_z) {np.corrcoef(zbar, np.sqrt(vz))[0,1]:.2f}; studentised z̄ tails >1.968: upper {np.mean(tz>1.968):.3f} lower {np.mean(tz<-1.968):.3f}")
    row("package (kurtosis dof)", np.array([s.ci_low for s in S]), np.array([s.ci_high for s in S]), R, est)
    return d, S

if __name__ == "__main__":
    for p in sys.argv[1:]:
        variants(p)

"""Offline: the package's interval against a Cornish-Fisher skew-shifted Fieller interval (each end with its own
quantile: q = ±t − γ(2t²+1)/(6√n), γ the sample skewness of z = x − R̂·y), on saved per-step (x, y).
usage: python benchmarks/coverage_study/cf_variant.py FILE.npz [...]"""
import sys, math
sys.path.insert(0, "benchmarks/coverage_study"); sys.path.insert(0, ".")
import numpy as np
from scipy import stats
from gns_callback.smoothing import summarize_ratio, moment_columns, excess_kurtosis
from gns_callback.confidence import fieller_interval, kurtosis_dof, t_quantile
from interval_variants import row

def cf(x, y):
    n = len(x); mx, my = x.mean(), y.mean()
    vx, vy = x.var(ddof=1) / n, y.var(ddof=1) / n
    cxy = np.cov(x, y)[0, 1] / n
    r = mx / my
    z = x - r * y
    g = stats.skew(z); k = stats.kurtosis(z)
    t = t_quantile(0.95, kurtosis_dof(n, k))
    d = g * (2 * t * t + 1) / (6 * math.sqrt(n))
    q_hi, q_lo = t - d, -t - d
    low = fieller_interval(mx, my, vx, vy, cxy, max(q_hi, 0.0))[0]
    high = fieller_interval(mx, my, vx, vy, cxy, max(-q_lo, 0.0))[1]
    return low, high

for p in sys.argv[1:]:
    d = np.load(p); X, Y, R = d["x"], d["y"], float(d["exact"])
    S = [summarize_ratio([float(c.sum()) for c in moment_columns(X[i], Y[i], np.ones(X.shape[1]))]) for i in range(len(X))]
    print(f"== {p.split('/')[-1]}  exact {R:.1f}")
    row("package", np.array([s.ci_low for s in S]), np.array([s.ci_high for s in S]), R, None)
    C = np.array([cf(X[i], Y[i]) for i in range(len(X))])
    row("Cornish-Fisher ends", C[:, 0], C[:, 1], R, None)

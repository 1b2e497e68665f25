"""Coverage and diagnostics of run_meter.py outputs.  usage: python analyze.py TAG [TAG...]"""
import sys, json, math
import numpy as np
from scipy import stats
sys.path.insert(0, ".")
from gns_callback.smoothing import summarize_ratio, moment_columns

EX = json.load(open("benchmarks/coverage_study/out/exact.json"))

def cp(k, n, a=0.05):
    lo = stats.beta.ppf(a / 2, k, n - k + 1) if k > 0 else 0.0
    hi = stats.beta.ppf(1 - a / 2, k + 1, n - k) if k < n else 1.0
    return lo, hi

def sums_of(x, y):
    one = np.ones_like(x)
    return [c.sum() for c in moment_columns(x, y, one)]

def report(tag):
    d = np.load(f"benchmarks/coverage_study/out/{tag}.npz")
    case = tag.split("_1")[0].split("_None")[0]
    ex = EX[case]; R, G2, TR = ex["b_simple"], ex["grad_sq"], ex["trace"]
    rows, X, Y = d["rows"], d["x"], d["y"]
    n_seeds, n = X.shape
    b, lo, hi = rows[:, 0], rows[:, 1], rows[:, 2]
    k = int(((lo <= R) & (R <= hi)).sum())
    c = cp(k, n_seeds)
    low_miss, high_miss = int((lo > R).sum()), int((hi < R).sum())
    width = np.median((hi - lo) / R)
    mx, my = X.mean(1), Y.mean(1)
    z = X - R * Y
    zbar = z.mean(1)
    # what the interval formula uses, per seed: var of one step / n
    vx = X.var(1, ddof=1) / n; vy = Y.var(1, ddof=1) / n; vz = z.var(1, ddof=1) / n
    sk_z = stats.skew(z, axis=1).mean(); ku_z = stats.kurtosis(z, axis=1).mean()
    # per-step correlation of x and y
    rho = np.mean([np.corrcoef(X[i], Y[i])[0, 1] for i in range(n_seeds)])
    # studentised z̄ at the exact R: its spread and tails across seeds
    tz = zbar / np.sqrt(vz)
    print(f"== {tag}: exact B_simple {R:.1f} (B={int(d['B'])}, ratio {R/int(d['B']):.1f}), {n_seeds} seeds x {n} steps")
    print(f"  coverage {k}/{n_seeds} = {k/n_seeds:.3f} [95% CP {c[0]:.3f}, {c[1]:.3f}]; misses: low end above exact {low_miss}, high end below {high_miss}")
    print(f"  mean |rel err| {np.mean(np.abs(b/R-1)):.3f}; median rel width {width:.3f}; median point/exact {np.median(b)/R:.3f}; unbounded {int(np.isinf(hi).sum())}")
    print(f"  mean x̄/trΣ {mx.mean()/TR:.4f} (±{mx.std()/TR/np.sqrt(n_seeds):.4f}); mean ȳ/|G|² {my.mean()/G2:.4f} (±{my.std()/G2/np.sqrt(n_seeds):.4f})")
    print(f"  var across seeds / mean formula var: x̄ {mx.var(ddof=1)/vx.mean():.3f}, ȳ {my.var(ddof=1)/vy.mean():.3f}, z̄=x̄-Rȳ {zbar.var(ddof=1)/vz.mean():.3f}")
    print(f"  per-step corr(x,y) {rho:.3f}; per-step z: skew {sk_z:.2f}, excess kurt {ku_z:.2f}; skew of z̄ across seeds {stats.skew(zbar):.2f}")
    print(f"  studentised z̄ at exact R: P(|t|>1.97) = {np.mean(np.abs(tz) > 1.968):.3f} (upper {np.mean(tz > 1.968):.3f}, lower {np.mean(tz < -1.968):.3f})")
    return dict(tag=tag, k=k, n=n_seeds)

if __name__ == "__main__":
    for t in sys.argv[1:]:
        report(t)

"""Coverage of the run interval on the offline replica (exact per-step estimates of the meter when every example is
measured; checked against the meter to 1e-6), for many seeds.  Batches: torch.randint(0, N, (B,), generator=seed),
the same as run_meter.py.
usage: python benchmarks/coverage_study/replica_cov.py CASE B STEPS SEED0 SEED1 [MODE]
[MODE [K]]  K: examples measured per batch (first K; the meter's subset + PairBlend), default all
MODE: 'with' (default, with replacement) | 'without' (each batch B distinct examples, population=N correction)
      | 'rb' (with replacement, same-example pairs replaced by their expectation: diagnostic only)
"""
import sys, json, time
sys.path.insert(0, "benchmarks/coverage_study")
import numpy as np, torch
from replica import gram, step_parts, blend_sequence

def draws(N, B, steps, seed, mode):
    g = torch.Generator().manual_seed(seed)
    if mode == "np":  # with replacement, numpy's generator (a check of the draws)
        return np.random.default_rng(seed).integers(0, N, (steps, B))
    if mode == "without":
        return np.stack([torch.randperm(N, generator=g)[:B].numpy() for _ in range(steps)])
    return np.stack([torch.randint(0, N, (B,), generator=g).numpy() for _ in range(steps)])

def xy(K, idx, mode, N, k=None):
    B = idx.shape[1]
    k = B if k is None else k
    m, yp, yt = step_parts(K, idx, k)
    y = yp if k == B else blend_sequence(m, yp, yt)[0]
    if mode == "rb":  # replace same-example pairs g_i·g_i by their expectation share mean|g|²/N
        diag = np.diag(K)
        same = (idx[:, :, None] == idx[:, None, :]) & ~np.eye(B, dtype=bool)
        dup = (same * diag[idx][:, :, None]).sum((1, 2))
        npairs = B * (B - 1)
        distinct = (y * npairs - dup)
        n_dist = npairs - same.sum((1, 2))
        # E over distinct-example pairs times (1-1/N) plus same pairs expectation (1/N)·mean|g|²
        y = distinct / np.maximum(n_dist, 1) * (1 - 1 / N) + diag.mean() / N
    x = m - y
    if mode == "without":  # gns_callback.sampling.without_replacement
        x, y = x * (N - 1) / N, y + x / N
    return x, y

if __name__ == "__main__":
    from gns_callback.smoothing import summarize_ratio, moment_columns
    case, B, steps, s0, s1 = sys.argv[1], *map(int, sys.argv[2:6])
    mode = sys.argv[6] if len(sys.argv) > 6 else "with"
    k = int(sys.argv[7]) if len(sys.argv) > 7 else None
    K = gram(case); N = K.shape[0]
    R = json.load(open("benchmarks/coverage_study/out/exact.json"))[case]["b_simple"]
    X, Y = [], []
    for s in range(s0, s1):
        x, y = xy(K, draws(N, B, steps, s, mode), mode, N, k)
        X.append(x); Y.append(y)
    np.savez(f"benchmarks/coverage_study/out/rep_{case}_{B}_{steps}_{mode}_{s0}_{s1}" + ("" if k is None else f"_k{k}") + ".npz", x=np.array(X), y=np.array(Y), exact=R, B=B)
    print("saved", f"benchmarks/coverage_study/out/rep_{case}_{B}_{steps}_{mode}_{s0}_{s1}" + ("" if k is None else f"_k{k}") + ".npz")

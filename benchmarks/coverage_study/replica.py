"""Offline replica of the meter's per-step (x, y) at fixed parameters, from the exact per-example Gram matrix.

step_parts(K, idx, k): per-step m (measured mean square), y_pairs, y_two for batches idx (S, B), first k measured.
blend_sequence(m, yp, yt): the meter's PairBlend weights and blended y (gns_callback/blend.py), step by step.
"""
import numpy as np, torch

def gram(case):
    G = torch.load(f"benchmarks/coverage_study/out/pe_{case}.pt")
    return (G @ G.T).numpy()

def step_parts(K, idx, k):
    S, B = idx.shape
    diag = np.diag(K)
    sub = K[idx[:, :, None], idx[:, None, :]]  # (S, B, B)
    big = sub.sum((1, 2)) / B**2
    D = diag[idx[:, :k]].sum(1)
    m = D / k
    Rb = sub[:, k:, k:].sum((1, 2))
    yt = (B * big - m) / (B - 1)
    yp = (big - (D + Rb) / B**2) / (1 - (k + (B - k) ** 2) / B**2)
    return m, yp, yt

def blend_sequence(m, yp, yt, min_steps=10, fixed=None):
    """Replicates PairBlend: λ from moments of earlier steps' z_pairs, z_two (z = m − c·y, c = 1 + running ratio)."""
    n = len(m); y = np.empty(n); lam_out = np.empty(n)
    s = np.zeros(8)
    for t in range(n):
        cnt, zp, zt, zpp, ztt, zpt, xs, ys = s
        c1 = max(cnt, 1.0)
        mp, mt = zp / c1, zt / c1
        vp, vt = zpp / c1 - mp * mp, ztt / c1 - mt * mt
        cov = zpt / c1 - zp * zt / (c1 * c1)
        den = vp + vt - 2 * cov
        lam = min(max((vt - cov) / max(den, 1e-300), 0.0), 1.0) if (cnt >= min_steps and den > 0) else 0.5
        if fixed is not None:
            lam = fixed
        yb = lam * yp[t] + (1 - lam) * yt[t]
        xsum, ysum = xs + (m[t] - yb), ys + yb
        c = 1 + max(xsum / max(ysum, 1e-300) if ysum > 0 else 0.0, 0.0)
        a, bb = m[t] - c * yp[t], m[t] - c * yt[t]
        s += np.array([1, a, bb, a * a, bb * bb, a * bb, m[t] - yb, yb])
        y[t] = yb; lam_out[t] = lam
    return y, lam_out

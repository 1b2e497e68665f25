"""Check the offline replica against the meter's recorded per-step values.  usage: check_replica.py TAG CASE K"""
import sys; sys.path.insert(0, "benchmarks/coverage_study")
import numpy as np
from replica import gram, step_parts, blend_sequence
tag, case, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
d = np.load(f"benchmarks/coverage_study/out/{tag}.npz")
K = gram(case)
print("blend recorded:", d["yp"].shape)
for s in range(min(3, d["idx"].shape[0])):
    idx = d["idx"][s]
    m, yp, yt = step_parts(K, idx, k)
    if d["yp"].size:
        y, lam = blend_sequence(m, yp, yt)
        print(" lam diff", np.max(np.abs(lam - d["lam"][s])))
    else:
        y = yp
    x = m - y
    print(s, "y", np.max(np.abs(y - d["y"][s])) / np.abs(d["y"][s]).max(), "x", np.max(np.abs(x - d["x"][s])) / np.abs(d["x"][s]).max())

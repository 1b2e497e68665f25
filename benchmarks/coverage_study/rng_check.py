"""Are torch.randint batches (one generator per seed) i.i.d. across steps? Duplicate-pair counts per step, 300 steps,
3000 seeds: across-seed variance of the run mean against the within-run variance / n."""
import numpy as np, torch
torch.set_num_threads(1)
N, B, n = 1797, 32, 300
for name, gen in [("torch.randint", lambda s: (lambda g: np.stack([torch.randint(0, N, (B,), generator=g).numpy() for _ in range(n)]))(torch.Generator().manual_seed(s))),
                  ("numpy integers", lambda s: np.random.default_rng(s).integers(0, N, (n, B)))]:
    means, within = [], []
    for s in range(1000, 4000):
        idx = gen(s)
        srt = np.sort(idx, 1)
        # duplicate ordered pairs per step: sum over values of c(c-1)
        dup = np.array([(np.unique(r, return_counts=True)[1] * (np.unique(r, return_counts=True)[1] - 1)).sum() for r in srt])
        means.append(dup.mean()); within.append(dup.var(ddof=1) / n)
    means = np.array(means)
    print(name, "mean dup ordered pairs/step", means.mean(), "expected", B * (B - 1) / N, "Var ratio", means.var(ddof=1) / np.mean(within))

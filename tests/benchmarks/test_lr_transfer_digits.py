"""``benchmarks/lr_transfer_digits.py``: its stacked trainer is the plain PyTorch loop, model by model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gns_callback.recommendation import warmup_lr


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("lr_transfer_digits")


def _reference(bench, data, cfg, batch_size, spec, optimizer, steps):
    """One nn.Module, torch.optim.SGD/Adam, the same batches and LR schedule."""
    x, y = data
    net = bench.mlp_module(bench.init_params(cfg.hidden))
    opt = (torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam)(net.parameters(), lr=spec.lr)
    gen = torch.Generator().manual_seed(10_000 + spec.seed)
    start = spec.lr if spec.start_lr is None else spec.start_lr
    for step in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = warmup_lr(step, start_lr=start, target_lr=spec.lr, warmup_steps=spec.warmup_steps)
        idx = torch.randint(0, len(x), (batch_size,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(net(x[idx]), y[idx]).backward()
        opt.step()
    return [net[0].weight.T, net[0].bias, net[2].weight.T, net[2].bias]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_stacked_models_match_the_plain_loop(bench, optimizer):
    data = bench.load_data()
    lr = 0.3 if optimizer == "sgd" else 0.01
    specs = [bench.RunSpec(lr, 0), bench.RunSpec(lr * 2, 1, start_lr=lr / 2, warmup_steps=7)]
    cfg = bench.Config(target=0.0, max_steps=12, max_examples=10**9, evals=1)
    res = bench.train_stack(data, cfg, 16, specs, optimizer, checkpoint_steps=(12,))
    for k, spec in enumerate(specs):  # each model with its own LR, seed and warmup
        want = _reference(bench, data, cfg, 16, spec, optimizer, 12)
        for got, ref in zip(res.params_at[12], want):
            torch.testing.assert_close(got[k], ref.detach(), rtol=1e-5, atol=1e-6)
    assert res.params_at[12][0].shape[0] == 2 and not any(res.diverged)


def test_exact_parts_and_b_crit_fit(bench):
    data = bench.load_data()
    params = bench.init_params(64)
    trace, grad_sq = bench.exact_parts(params, *data)
    from gns_callback.exact import exact_b_simple

    b, g2, tr = exact_b_simple(bench.mlp_module(params), F.cross_entropy, *data)
    assert (trace, grad_sq) == pytest.approx((tr, g2), rel=1e-9)
    tuned = {b: bench.Tuned(b, 1.0, 100.0 * (1 + 40.0 / b), {}) for b in (8, 16, 64, 512)}
    assert bench.fit_b_crit(tuned) == pytest.approx(40.0)


def test_transfer_rows_follow_the_recommendation_policy_and_render(bench):
    tuned = {8: bench.Tuned(8, 0.5, 1000.0, {}), 64: bench.Tuned(64, 1.2, 300.0, {})}
    along = {b: bench.Along(40.0, 10.0, 0.9, 0.5, 2.5, 1.0, [1.0]) for b in tuned}
    rows = {(r["b0"], r["b1"], r["rule"]): r["lr"] for r in bench.transfers(tuned, along, "sgd")}
    early = "default with the early-phase B_noise"
    assert rows[(8, 64, f"{early}, no sharpness")] == pytest.approx(0.5 * (1 + 10 / 8) / (1 + 10 / 64))  # smaller
    assert rows[(64, 8, f"{early}, no sharpness")] == pytest.approx(1.2 * (1 + 40 / 64) / (1 + 40 / 8))  # larger
    assert rows[(8, 64, "linear")] == pytest.approx(4.0)
    assert rows[(8, 64, "noise_linear")] == pytest.approx(0.5 * (1 + 40 / 8) / (1 + 40 / 64))
    assert rows[(8, 64, "default, no sharpness (holds increases)")] == 0.5
    assert rows[(8, 64, "default, sharpness = largest λ_max along the run")] == pytest.approx(2 / 2.5)
    assert rows[(64, 8, "default, no sharpness (holds increases)")] == pytest.approx(1.2 * (1 + 40 / 64) / (1 + 40 / 8))
    # Rendering reads only what a run stores.
    out = {"config": {"hidden": 64, "target": 0.05, "seeds": 3}}
    for family in ("sgd", "adam"):
        rows = bench.transfers(tuned, along, family)
        for r in rows:
            r.update(steps=500.0, diverged=0, ratio=500.0 / tuned[r["b1"]].steps)
        out[family] = dict(tuned={b: vars(t) for b, t in tuned.items()}, along={b: vars(a) for b, a in along.items()},
                           transfers=rows, b_crit=30.0)
    text = bench.render(out, "python benchmarks/lr_transfer_digits.py", None)
    assert "Reading (SGD)" in text and "| noise_linear | up | 1 |" in text and "**Adam:**" in text
    assert "The callback's default" in text

"""``benchmarks/peers_gns.py``: each re-implemented peer against its source's formulas, step by step, and its
long-run estimate against the exact ``B_simple`` of a synthetic distribution (tolerance from the spread over streams).
"""

from __future__ import annotations

import math

import pytest
import torch

from gns_callback.estimators import grad_sq_norm_estimate, trace_sigma_estimate
from gns_callback.exact import exact_noise_scale


@pytest.fixture(scope="module")
def peers(load_benchmark):
    return load_benchmark("peers_gns")


def _grads(count: int, size: int = 6, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=generator, dtype=torch.float64) + 0.5 for _ in range(count)]


def _ewm_without_adjustment(values: list[float], alpha: float) -> float:
    """pandas ``Series.ewm(alpha=alpha, adjust=False).mean().iloc[-1]`` in closed form:
    ``(1 − α)^t·x_0 + Σ_{k≥1} α(1 − α)^{t−k}·x_k``."""
    t = len(values) - 1
    return (1 - alpha) ** t * values[0] + sum(alpha * (1 - alpha) ** (t - k) * values[k] for k in range(1, t + 1))


def test_nanogns_is_the_b1_pair_under_ewm_without_adjustment(peers):
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 5, generator=generator, dtype=torch.float64) + 1.0 for _ in range(7)]
    nano = peers.NanoGNS()
    traces, grads = [], []
    for rows in batches:
        nano.update(rows.mean(0), rows.pow(2).sum(1))
        big, small = rows.mean(0).pow(2).sum().item(), rows.pow(2).sum(1).mean().item()
        traces.append(trace_sigma_estimate(small, big, 1, 8))
        grads.append(grad_sq_norm_estimate(small, big, 1, 8))
    trace_ema, grad_ema = _ewm_without_adjustment(traces, 0.01), _ewm_without_adjustment(grads, 0.01)
    assert nano.value == pytest.approx(trace_ema / max(grad_ema, 1e-6), rel=1e-12)
    first = peers.NanoGNS()
    first.update(batches[0].mean(0), batches[0].pow(2).sum(1))
    assert first.value == pytest.approx(traces[0] / grads[0], rel=1e-12)  # adjust=False: the first value itself


def test_gpt_neox_estimates_once_per_five_steps_from_the_last_and_the_mean(peers):
    grads = _grads(10)
    neox = peers.GptNeoxGNS(batch_size_small=4)
    values = []
    for g in grads:
        neox.update(g)
        values.append(neox.value)
    assert all(math.isnan(v) for v in values[:4])
    small, big = grads[4].pow(2).sum().item(), torch.stack(grads[:5]).mean(0).pow(2).sum().item()
    assert values[4] == pytest.approx(trace_sigma_estimate(small, big, 4, 20) / grad_sq_norm_estimate(small, big, 4, 20))
    assert values[5:9] == [values[4]] * 4  # nothing new until the next fifth step
    small2, big2 = grads[9].pow(2).sum().item(), torch.stack(grads[5:]).mean(0).pow(2).sum().item()
    trace = 0.99 * 0.01 * trace_sigma_estimate(small, big, 4, 20) + 0.01 * trace_sigma_estimate(small2, big2, 4, 20)
    grad = 0.99 * 0.01 * grad_sq_norm_estimate(small, big, 4, 20) + 0.01 * grad_sq_norm_estimate(small2, big2, 4, 20)
    assert values[9] == pytest.approx(trace / grad)


def test_adaptdl_differences_consecutive_steps_in_units_of_its_batch(peers):
    grads = _grads(3)
    adaptdl = peers.AdaptDLGNS(batch_size=16)
    adaptdl.update(grads[0])
    assert math.isnan(adaptdl.value)  # one gradient: nothing to difference yet
    adaptdl.update(grads[1])
    small = (grads[0].pow(2).sum() + grads[1].pow(2).sum()).item() / 2
    big = ((grads[0] + grads[1]) / 2).pow(2).sum().item()
    # two batches of 16 against their mean (32): tr Σ/16 is AdaptDL's var, |G|² its sqr
    expected = trace_sigma_estimate(small, big, 16, 32) / grad_sq_norm_estimate(small, big, 16, 32)
    assert adaptdl.value == pytest.approx(expected)
    adaptdl.update(grads[2])
    theta = 0.999**2  # smoothing ** scale, scale = 2
    assert adaptdl.state["sqr_avg_unbias"] == pytest.approx(theta * (1 - theta) + (1 - theta), rel=1e-12)


def test_adaptdl_clamps_as_shipped(peers):
    adaptdl = peers.AdaptDLGNS(batch_size=8)
    adaptdl.update(torch.tensor([1.0, 0.0]))
    adaptdl.update(torch.tensor([-1.0, 0.0]))  # opposite gradients: |G|² estimate −1 < 0
    assert adaptdl.state["sqr_avg"] < 0 and adaptdl.value == math.inf
    same = peers.AdaptDLGNS(batch_size=8)
    same.update(torch.tensor([1.0, 2.0]))
    same.update(torch.tensor([1.0, 2.0]))  # identical gradients: variance 0, clamped to 1e-6
    assert same.value == pytest.approx(8 * 1e-6 / 5.0)


def test_each_peer_is_close_to_the_exact_value_over_long_streams(peers):
    """A synthetic population (N = 4000, P = 40, B_simple ≈ 16, batches of 32): over 24 streams of 1000 steps the
    mean estimate of each peer is within 4 standard errors (spread over streams) plus 3% (ratio bias) of the exact
    ``B_simple``. A wrong batch-size factor or swapped parts would be off by far more."""
    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(4000, 40, generator=generator, dtype=torch.float64) * 0.6 + 0.15
    exact = exact_noise_scale(rows)[0]
    estimates: dict[str, list[float]] = {"nano": [], "neox": [], "adaptdl": []}
    for stream in range(24):
        draws = torch.Generator().manual_seed(100 + stream)
        nano, neox, adaptdl = peers.NanoGNS(), peers.GptNeoxGNS(32), peers.AdaptDLGNS(32)
        for index in torch.randint(0, rows.shape[0], (1000, 32), generator=draws):
            batch = rows[index]
            nano.update(batch.mean(0), batch.pow(2).sum(1))
            neox.update(batch.mean(0))
            adaptdl.update(batch.mean(0))
        for key, peer in (("nano", nano), ("neox", neox), ("adaptdl", adaptdl)):
            estimates[key].append(peer.value)
    for key, values in estimates.items():
        values_t = torch.tensor(values)
        se = values_t.std().item() / math.sqrt(len(values))
        assert abs(values_t.mean().item() - exact) < 4 * se + 0.03 * exact, (key, values_t.mean().item(), exact, se)

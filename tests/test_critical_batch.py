"""Critical batch from one run: closed forms, the array function against the online accumulator, fallbacks,
resume, interval coverage in simulation, and the estimate against the exact noise scale on real data."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gns_callback.critical_batch import (
    BLOCKS,
    LOSS_WINDOWS,
    RUN_AVERAGE,
    CriticalBatchAccumulator,
    critical_batch_size,
    critical_batch_target,
    geometric_mean_interval,
    summarize_blocks,
    window_edges,
)
from gns_callback.estimators import grad_sq_norm_estimate, trace_sigma_estimate
from gns_callback.exact import exact_noise_scale, per_example_gradients
from gns_callback.smoothing import SECOND_ORDER_FIELDS, RatioSummary, moment_columns, summarize_ratio
from tests.helpers import mlp


def _geometric_loss(steps, start=2.3, fall=100.0):
    return start * np.exp(-np.linspace(0.0, math.log(fall), steps))


def _feed(acc, x, y, loss, valid=None):
    for i, (a, b, c) in enumerate(zip(x, y, loss)):
        ok = True if valid is None else valid[i]
        acc.update(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                   torch.tensor(c, dtype=torch.float64), torch.tensor(ok))


def _expected_midpoint(x, y, loss, windows=2, trim=0.25):
    """Independent reference for one step per block and no smoothing: each step at its first-passage log-loss
    depth, ratio of sums in each window, geometric mean over the windows."""
    assert len(x) <= BLOCKS
    depth = np.log(loss[0]) - np.minimum.accumulate(np.log(loss))
    ratios = []
    for k, (lo, hi) in enumerate(window_edges(depth.max(), windows, trim)):
        inside = (depth >= lo) & ((depth <= hi) if k == windows - 1 else (depth < hi))
        ratios.append(x[inside].sum() / y[inside].sum())
    return math.exp(np.mean(np.log(ratios)))


def test_constant_noise_scale_is_recovered_exactly():
    loss = _geometric_loss(1000)  # 4 steps per block, smoothed
    grad_sq = np.linspace(2.0, 0.01, 1000)
    est = critical_batch_size(37.0 * grad_sq, grad_sq, loss)
    assert est.method == LOSS_WINDOWS
    assert est.b_crit == pytest.approx(37.0, rel=1e-12)
    assert est.window_values == pytest.approx((37.0, 37.0), rel=1e-12)


def test_power_law_noise_scale_gives_its_value_at_the_geometric_mid_loss():
    loss = _geometric_loss(BLOCKS, fall=100.0)
    grad_sq = np.full(BLOCKS, 0.1)
    x = 10.0 * (2.3 / loss) ** 0.5 * grad_sq
    est = critical_batch_size(x, grad_sq, loss, smoothing=0)
    assert est.b_crit == pytest.approx(_expected_midpoint(x, grad_sq, loss), rel=1e-12)
    assert est.b_crit == pytest.approx(10.0 * 100.0**0.25, rel=0.03)  # B at √(L_start·L_end)
    assert (est.loss_start, est.loss_end) == pytest.approx((loss[0], loss[-1]))
    long_run = np.repeat(loss, 16), np.repeat(x, 16), np.repeat(grad_sq, 16)  # 16 steps per block, smoothed
    assert critical_batch_size(long_run[1], long_run[2], long_run[0]).b_crit == pytest.approx(est.b_crit, rel=0.03)


def test_window_options_select_the_log_loss_range():
    loss = _geometric_loss(BLOCKS)
    grad_sq = np.ones(BLOCKS)
    x = 5.0 * (2.3 / loss) ** 0.3
    for windows, trim in [(1, 0.0), (4, 0.0), (3, 0.2)]:
        est = critical_batch_size(x, grad_sq, loss, smoothing=0, windows=windows, trim=trim)
        assert len(est.window_values) == windows
        assert est.b_crit == pytest.approx(_expected_midpoint(x, grad_sq, loss, windows, trim), rel=1e-12)


def test_array_function_equals_the_online_accumulator():
    rng = np.random.default_rng(3)
    loss = _geometric_loss(700) * np.exp(rng.normal(0.0, 0.3, 700))  # noisy batch losses, smoothed inside
    x, y = rng.normal(40.0, 30.0, 700), rng.normal(1.0, 0.8, 700)  # single steps may be negative
    acc = CriticalBatchAccumulator()
    _feed(acc, x, y, loss)
    online, batch = acc.summary(), critical_batch_size(x, y, loss)
    assert online.b_crit == pytest.approx(batch.b_crit, rel=1e-10)
    assert (online.ci_low, online.ci_high) == pytest.approx((batch.ci_low, batch.ci_high), rel=1e-10)
    assert (online.loss_start, online.loss_end, online.steps) == pytest.approx(
        (batch.loss_start, batch.loss_end, batch.steps))


def test_loss_spikes_do_not_move_steps_back():
    loss = _geometric_loss(BLOCKS)
    spiked = loss.copy()
    spiked[120:126] *= 5.0  # a catapult: the loss jumps up and comes back
    frozen = loss.copy()
    frozen[120:126] = loss[119]  # the spike's steps stay where the run had got to before it
    y = np.ones(BLOCKS)
    x = np.linspace(5.0, 80.0, BLOCKS)
    expected = critical_batch_size(x, y, frozen, smoothing=0)
    assert critical_batch_size(x, y, spiked, smoothing=0).b_crit == pytest.approx(expected.b_crit, rel=1e-12)


def test_invalid_and_non_finite_steps_change_nothing():
    loss, rng = _geometric_loss(200), np.random.default_rng(0)  # one step per block: skipped steps leave gaps
    x, y = rng.normal(30.0, 5.0, 200), rng.normal(1.0, 0.2, 200)
    clean, noisy = CriticalBatchAccumulator(), CriticalBatchAccumulator()
    _feed(clean, x, y, loss)
    xs, ys, ls = list(x), list(y), list(loss)
    valid = [True] * 200
    for i in (0, 50, 120):  # skipped steps with garbage, and a NaN loss on a "valid" step
        xs.insert(i, math.nan), ys.insert(i, math.inf), ls.insert(i, 1e9), valid.insert(i, False)
    xs.insert(7, 1e6), ys.insert(7, 1e6), ls.insert(7, math.nan), valid.insert(7, True)
    _feed(noisy, xs, ys, ls, valid)
    a, b = clean.summary(), noisy.summary()
    assert (a.b_crit, a.ci_low, a.ci_high, a.loss_start, a.loss_end, a.steps) == pytest.approx(
        (b.b_crit, b.ci_low, b.ci_high, b.loss_start, b.loss_end, b.steps), rel=1e-12)
    assert noisy.calls == 204 and a.steps == 200


def test_too_little_loss_fall_gives_the_run_average_and_says_why():
    x, y = np.array([10.0, 30.0, 20.0]), np.array([1.0, 1.0, 2.0])
    est = critical_batch_size(x, y, [1.0, 0.9, 0.8])
    assert est.method.startswith(RUN_AVERAGE) and "less than 2" in est.method
    assert est.b_crit == pytest.approx(x.sum() / y.sum())


def test_non_positive_loss_gives_the_run_average_and_says_why():
    x, y = np.array([10.0, 30.0, 20.0]), np.array([1.0, 1.0, 2.0])
    for est in (critical_batch_size(x, y, [2.0, -1.0, -3.0]), _online(x, y, [2.0, -1.0, -3.0])):
        assert est.method.startswith(RUN_AVERAGE) and "not positive" in est.method
        assert est.b_crit == pytest.approx(x.sum() / y.sum())


def _online(x, y, loss):
    acc = CriticalBatchAccumulator()
    _feed(acc, x, y, loss)
    return acc.summary()


def test_an_unresolved_window_falls_back_to_one_window_over_the_middle():
    loss = _geometric_loss(BLOCKS)  # one step per block, even in log-loss: window 1 = steps 64–127, 2 = 128–191
    x, y = np.full(BLOCKS, 20.0), np.ones(BLOCKS)
    y[64:128] = -0.5  # |G|² not resolved in the first window
    est = critical_batch_size(x, y, loss, smoothing=0)
    assert "one window" in est.method
    assert est.b_crit == pytest.approx(x[64:192].sum() / y[64:192].sum())


def test_nothing_measured():
    est = CriticalBatchAccumulator().summary()
    assert est.steps == 0 and math.isnan(est.b_crit) and est.ci_high == math.inf


def test_state_dict_round_trip_continues_exactly():
    loss, rng = _geometric_loss(300), np.random.default_rng(1)
    x, y = rng.normal(30.0, 8.0, 300), rng.normal(1.0, 0.3, 300)
    whole, first = CriticalBatchAccumulator(blocks=64), CriticalBatchAccumulator(blocks=64)
    _feed(whole, x, y, loss)
    _feed(first, x[:120], y[:120], loss[:120])  # blocks already merged once (2 steps per block)
    resumed = CriticalBatchAccumulator()
    resumed.load_state_dict(first.state_dict())
    _feed(resumed, x[120:], y[120:], loss[120:])
    assert resumed.summary().b_crit == pytest.approx(whole.summary().b_crit, rel=1e-12)
    assert resumed.block_size == whole.block_size == 8
    assert torch.allclose(resumed.blocks, whole.blocks)


def test_a_state_saved_before_the_fourth_moments_resumes_with_its_estimate():
    """Blocks of eight columns (seven sums and the loss, the state before this change) resume: the same estimate and
    interval as the second-order sums give, with the fourth moments unknown."""
    loss, rng = _geometric_loss(200), np.random.default_rng(3)
    x, y = rng.normal(30.0, 8.0, 200), rng.normal(1.0, 0.3, 200)
    acc = CriticalBatchAccumulator(blocks=64)
    _feed(acc, x, y, loss)
    state = acc.state_dict()
    state["blocks"] = [row[:SECOND_ORDER_FIELDS] + row[-1:] for row in state["blocks"]]
    resumed = CriticalBatchAccumulator()
    resumed.load_state_dict(state)
    assert resumed.blocks.shape == acc.blocks.shape
    assert torch.isnan(resumed.blocks[:, SECOND_ORDER_FIELDS:-1]).all()
    assert torch.equal(resumed.blocks[:, -1], acc.blocks[:, -1])
    unknown = acc.blocks.clone()
    unknown[:, SECOND_ORDER_FIELDS:-1] = math.nan
    assert resumed.summary() == summarize_blocks(unknown)


def test_geometric_mean_interval_adds_log_half_widths_in_quadrature():
    a = RatioSummary(0, 0, 10.0, 10.0 / math.e, 10.0 * math.e**2, 50)
    b = RatioSummary(0, 0, 40.0, 40.0 / math.e**2, 40.0 * math.e, 50)
    g, low, high = geometric_mean_interval([a, b])
    assert g == pytest.approx(20.0)
    assert low == pytest.approx(20.0 * math.exp(-math.sqrt(1 + 4) / 2))
    assert high == pytest.approx(20.0 * math.exp(math.sqrt(4 + 1) / 2))
    unresolved = RatioSummary(0, 0, 40.0, 5.0, math.inf, 50)
    assert geometric_mean_interval([a, unresolved])[2] == math.inf


def test_bad_options_name_the_argument():
    with pytest.raises(ValueError, match="windows"):
        CriticalBatchAccumulator(windows=0)
    with pytest.raises(ValueError, match="trim"):
        critical_batch_size([1.0], [1.0], [1.0], trim=0.5)
    with pytest.raises(ValueError, match="blocks"):
        CriticalBatchAccumulator(blocks=3)
    with pytest.raises(ValueError, match="smoothing"):
        critical_batch_size([1.0], [1.0], [1.0], smoothing=-1)
    with pytest.raises(ValueError, match="same length"):
        critical_batch_size([1.0, 2.0], [1.0], [1.0, 2.0])


def test_interval_coverage_in_simulation_is_near_nominal():
    """Known per-step noise scale B(L) along a falling loss; per-step estimates with independent noise. The
    estimand is the same estimator on the noise-free values."""
    steps, reps, rng = 300, 120, np.random.default_rng(7)
    loss = _geometric_loss(steps, fall=30.0)
    grad_sq = 0.5 * (loss / loss[0]) ** 0.5
    x_true = 8.0 * (loss[0] / loss) ** 0.6 * grad_sq
    truth = critical_batch_size(x_true, grad_sq, loss, smoothing=0).b_crit
    hits = 0
    for _ in range(reps):
        x = x_true + rng.normal(0.0, 0.5 * x_true.mean(), steps)
        y = grad_sq + rng.normal(0.0, 0.5 * grad_sq.mean(), steps)
        est = critical_batch_size(x, y, loss, smoothing=0)
        hits += est.ci_low <= truth <= est.ci_high
    assert 0.87 <= hits / reps <= 1.0, hits / reps


def test_on_digits_at_fixed_parameters_the_estimate_brackets_the_exact_noise_scale(digits):
    """Real data, brute force: per-step per-example estimates (b = 1, B = 32) at fixed parameters are unbiased
    for the exact tr Σ and |G|² over all 1797 images, so every loss window, and the estimate, must cover the exact
    B_simple whatever loss path places the steps."""
    x, y = digits
    g = per_example_gradients(mlp(), F.cross_entropy, x, y)
    exact, _, _ = exact_noise_scale(g)
    gram = g @ g.T  # |G_B|² of a batch = mean of its Gram block; |g_i|² on the diagonal
    idx = torch.randint(0, len(g), (600, 32), generator=torch.Generator().manual_seed(0))
    small = gram.diagonal()[idx].mean(1)
    big = gram[idx[:, :, None], idx[:, None, :]].mean((1, 2))
    traces = trace_sigma_estimate(small, big, 1.0, 32.0)
    grads = grad_sq_norm_estimate(small, big, 1.0, 32.0)
    est = critical_batch_size(traces, grads, _geometric_loss(600, fall=20.0))
    assert est.method == LOSS_WINDOWS
    assert est.ci_low <= exact <= est.ci_high, (est, exact)
    assert est.ci_high / est.ci_low < 2.0, est


def test_early_noise_scale_is_the_ratio_of_sums_over_the_first_quarter_of_the_loss_range():
    loss = _geometric_loss(BLOCKS, fall=100.0)
    depth = np.log(loss[0]) - np.log(loss)
    grad_sq = np.linspace(3.0, 0.1, BLOCKS)
    x = np.where(depth <= 0.25 * depth[-1], 6.0, 50.0) * grad_sq
    est = critical_batch_size(x, grad_sq, loss, smoothing=0)
    early = depth <= 0.25 * depth[-1]
    assert est.early_noise_scale == pytest.approx(x[early].sum() / grad_sq[early].sum(), rel=1e-12)
    assert est.early_noise_scale == pytest.approx(6.0, rel=1e-12) and est.b_crit == pytest.approx(50.0, rel=1e-12)
    assert critical_batch_target(est)["lr_noise_scale"] == est.early_noise_scale
    unresolved = critical_batch_size(x, np.where(early, -grad_sq, grad_sq), loss, smoothing=0)
    assert math.isnan(unresolved.early_noise_scale)
    flat = critical_batch_size(x, grad_sq, np.full(BLOCKS, 1.0))  # no loss fall: no early phase either
    assert math.isnan(flat.early_noise_scale)
    assert math.isnan(unresolved.early_noise_scale_low) and math.isnan(flat.early_noise_scale_low)


def _noisy_early_phase(rng, ratio=6.0, steps=BLOCKS):
    """Per-step unbiased estimates whose early-quarter ratio of means is ``ratio`` (noise as on a real run: the
    |Ĝ|² estimate's spread about its mean is about its mean)."""
    loss = _geometric_loss(steps, fall=100.0)
    depth = np.log(loss[0]) - np.log(loss)
    grad_sq = 1.0 + rng.normal(0.0, 1.0, steps)
    x = np.where(depth <= 0.25 * depth[-1], ratio, 50.0) * (1.0 + rng.normal(0.0, 0.3, steps))
    return x, grad_sq, loss, depth <= 0.25 * depth[-1]


def test_early_noise_scale_low_is_the_fieller_lower_end_over_the_early_steps():
    x, grad_sq, loss, early = _noisy_early_phase(np.random.default_rng(0))
    est = critical_batch_size(x, grad_sq, loss, smoothing=0)
    xe, ye = x[early], grad_sq[early]
    want = summarize_ratio([column.sum() for column in moment_columns(xe, ye, np.ones_like(xe))])
    assert est.early_noise_scale == pytest.approx(want.ratio, rel=1e-9)
    assert est.early_noise_scale_low == pytest.approx(want.ci_low, rel=1e-9)
    assert 0.0 < est.early_noise_scale_low < est.early_noise_scale
    assert critical_batch_target(est)["lr_noise_scale_low"] == est.early_noise_scale_low


def test_early_noise_scale_low_lies_below_the_true_value_at_the_nominal_rate():
    """The lower end of a 95% two-sided interval: the true early ratio lies at or above it in about 97.5% of runs."""
    rng = np.random.default_rng(1)
    lows = [critical_batch_size(*_noisy_early_phase(rng)[:3], smoothing=0).early_noise_scale_low for _ in range(400)]
    below = np.mean([low <= 6.0 for low in lows])
    assert 0.95 <= below <= 0.995, below  # binomial sd at 0.975 over 400 runs: 0.008


def test_a_critical_batch_not_measured_says_so():
    """Before: "B_crit ≈ nan (95% CI nan – nan; with the model error ×2: nan – nan; not measured (...)"."""
    from gns_callback.critical_batch import CriticalBatchEstimate

    nan = math.nan
    stopped = CriticalBatchEstimate(nan, nan, nan, 0.95, (), 2.3, 2.2, 20, "not measured (hooks stopped)")
    assert str(stopped) == "B_crit not measured (hooks stopped), 20 steps"
    no_step = CriticalBatchEstimate(nan, 0.0, math.inf, 0.95, (), nan, nan, 0, "run average (no training loss was "
                                    "passed to step())")
    assert str(no_step) == "B_crit not measured (no optimizer step measured), 0 steps"

"""The pure search: linear fit, prediction, verification and bisection plan (no torch)."""

import math
import random

import pytest

from gns_callback.probe.memory_model import (
    BACKOFF,
    BISECT,
    EXTEND,
    FIT,
    VERIFY,
    LinearMemoryModel,
    bracket,
    fit_linear,
    next_trial,
    throughput_ladder,
)
from gns_callback.probe.result import Trial

MEMORY_PHASES = {FIT, VERIFY, EXTEND, BACKOFF, BISECT}


def run_search(measure, *, limit, cap=65536, fit_sizes=(2, 8, 32), rel_tol=0.05):
    """Drive the planner with ``measure(size) -> bytes | None`` (None: OOM); return (answer, trials)."""
    trials = []
    while (proposal := next_trial(trials, fit_sizes=fit_sizes, limit_bytes=limit, cap=cap, rel_tol=rel_tol)):
        size, phase = proposal
        assert 1 <= size <= cap and size not in {t.size for t in trials}, (size, trials)
        measured = measure(size)
        ok = measured is not None and measured <= limit
        trials.append(Trial(size, ok, measured if ok else None, phase=phase))
        assert len(trials) < 60
    return bracket(trials, cap)[0], trials


def true_max(measure, limit, cap):
    return max((b for b in range(1, cap + 1) if (m := measure(b)) is not None and m <= limit), default=0)


def test_fit_linear_recovers_an_exact_line_and_least_squares():
    model = fit_linear([2, 8, 32], [1000 + 50 * b for b in (2, 8, 32)])
    assert model.fixed_bytes == pytest.approx(1000) and model.bytes_per_sample == pytest.approx(50)
    # least squares: symmetric noise around the line leaves the slope
    noisy = fit_linear([1, 2, 3, 4], [10 + 1, 20 - 1, 30 - 1, 40 + 1])
    assert noisy.bytes_per_sample == pytest.approx(10.0) and noisy.fixed_bytes == pytest.approx(0.0, abs=1e-9)


def test_fit_linear_degenerate_cases_stay_on_the_safe_side():
    one = fit_linear([8], [800])  # fixed part charged per sample: can only under-predict
    assert (one.fixed_bytes, one.bytes_per_sample) == (0.0, 100.0)
    flat = fit_linear([2, 8], [500, 400])  # negative slope from noise
    assert flat.bytes_per_sample == 0.0 and flat.fixed_bytes == pytest.approx(450)
    through_origin = fit_linear([2, 4], [10, 30])  # intercept would be −10
    assert through_origin.fixed_bytes == 0.0 and through_origin.bytes_per_sample > 0
    with pytest.raises(ValueError):
        fit_linear([], [])


def test_max_batch_formula_cap_and_no_room():
    model = LinearMemoryModel(fixed_bytes=1000, bytes_per_sample=30)
    assert model.max_batch(4000, cap=1000) == 100  # ⌊(4000 − 1000)/30⌋
    assert model.max_batch(4000, cap=64) == 64
    assert model.max_batch(999, cap=64) == 0
    assert LinearMemoryModel(10, 0).max_batch(100, cap=77) == 77


@pytest.mark.parametrize("fixed, per_sample, limit", [(40_000, 432, 170_000), (31_000, 4_900, 800_000), (10, 1, 300)])
def test_linear_memory_is_found_exactly_in_four_trials(fixed, per_sample, limit):
    measure = lambda b: fixed + per_sample * b
    answer, trials = run_search(measure, limit=limit)
    assert answer == true_max(measure, limit, 65536)
    assert len(trials) <= 4 and [t.phase for t in trials][-1] == VERIFY


def test_cap_limits_the_answer():
    answer, trials = run_search(lambda b: 100 + b, limit=1e12, cap=500)
    assert answer == 500 and len(trials) == 4


@pytest.mark.parametrize("seed", range(40))
def test_oom_threshold_and_nonlinear_memory_bisect_to_a_tried_size_within_tolerance(seed):
    rng = random.Random(seed)
    threshold = rng.randint(1, 3000)
    quad = rng.choice([0.0, 0.05, 2.0])
    cap = rng.choice([4096, 65536])
    limit = rng.choice([1e12, 2e6])

    def measure(b):  # superlinear memory the linear fit under-estimates, and a hard OOM above the threshold
        return None if b > threshold else 1000 + 300 * b + quad * b * b

    answer, trials = run_search(measure, limit=limit, cap=cap)
    best = true_max(measure, limit, cap)
    assert answer <= best
    assert answer >= math.floor(best / 1.05) - 1  # rel_tol=0.05
    assert answer == 0 or any(t.size == answer and t.ok for t in trials)  # always a size that really ran
    assert {t.phase for t in trials} <= MEMORY_PHASES
    assert len(trials) <= 25


def test_nothing_fits_tries_one_then_gives_up():
    answer, trials = run_search(lambda b: None, limit=1e9)
    assert answer == 0 and [t.size for t in trials] == [2, 1]


def test_a_failed_verification_backs_off_a_little_then_more():
    """Near the limit (fragmentation) one small back-off lands within the tolerance; a larger miss takes the
    second, larger back-off before any bisection."""
    answer, trials = run_search(lambda b: None if b > 990 else 10 * b, limit=1e12, cap=1000)
    phases = [(t.phase, t.size, t.ok) for t in trials]
    assert phases[3:] == [(VERIFY, 1000, False), (BACKOFF, 975, True)] and answer == 975
    answer, trials = run_search(lambda b: None if b > 950 else 10 * b, limit=1e12, cap=1000)
    phases = [(t.phase, t.size, t.ok) for t in trials]
    assert phases[3:6] == [(VERIFY, 1000, False), (BACKOFF, 975, False), (BACKOFF, 877, True)]
    assert 905 <= answer <= 950


#: EfficientNet-B0 at 32×32 on an H200 (benchmarks/gpu_results/probe_truth_h200.json): the allocator's peak at
#: the three fit sizes, the straight line through the verified step at 17,040 (125.96 GB), the budget, and the
#: largest size that ran (found by doubling and bisection to a real CUDA OOM).
B0_FIT_BYTES = {2: 143_908_352, 8: 190_487_552, 32: 404_670_464}
B0_BUDGET, B0_TRUTH = 149_370_830_848, 20_448


def b0_measure(b):
    if b > B0_TRUTH:
        return None
    return B0_FIT_BYTES.get(b, 142_970_037 + 7_383_704 * b)


def test_a_verified_prediction_far_under_the_limit_is_extended_by_the_secant():
    """The fit over 2, 8 and 32 samples charges 8.8 MB a sample where large batches take 7.4: the verified
    prediction (17,040) is 16.7% under the truth. One extension lands within 5% of it."""
    answer, trials = run_search(b0_measure, limit=B0_BUDGET)
    phases = [(t.phase, t.size, t.ok) for t in trials]
    assert phases[3] == (VERIFY, 17_040, True)
    assert phases[4][:2] == (EXTEND, answer) and len(trials) - 3 <= 3
    assert 0.95 * B0_TRUTH <= answer <= B0_TRUTH


#: The same model on an H100 (benchmarks/gpu_results/probe_truth_h100_extend.json): the peaks of the sizes that ran
#: after the fit, read between them linearly, and the largest size that ran. Between 9,608 and 10,482 the peak
#: grew 1.2 MB a sample (cuDNN's workspaces shrinking to fit), where the activations take 7.4.
H100_PEAKS = {9_608: 76_486_747_136, 10_482: 77_538_188_288, 11_236: 83_119_470_080}
H100_BUDGET, H100_TRUTH = 84_278_444_032, 11_507


def h100_measure(b):
    if b > H100_TRUTH:
        return None
    if b in B0_FIT_BYTES:
        return B0_FIT_BYTES[b]
    points = sorted({32: B0_FIT_BYTES[32], **H100_PEAKS, H100_TRUTH: H100_BUDGET}.items())
    (b1, m1), (b2, m2) = next(pair for pair in zip(points, points[1:]) if pair[0][0] <= b <= pair[1][0])
    return m1 + (m2 - m1) * (b - b1) / (b2 - b1)


def test_a_slope_that_falls_near_the_limit_does_not_throw_the_extension_past_it():
    """The local secant alone (1.2 MB a sample) sent the second extension to 15,384, and five more trials found
    11,236; the long secant from the smallest size bounds the slope, and the third trial lands within 5%."""
    answer, trials = run_search(h100_measure, limit=H100_BUDGET)
    assert [(t.phase, t.size, t.ok) for t in trials[3:5]] == [(VERIFY, 9_608, True), (EXTEND, 10_482, True)]
    assert len(trials) - 3 <= 3 and all(t.ok for t in trials)
    assert 0.95 * H100_TRUTH <= answer <= H100_TRUTH


@pytest.mark.parametrize("seed", range(40))
def test_memory_that_is_dearer_per_sample_at_small_sizes_is_found_within_5_percent_in_three_trials(seed):
    """A workspace that stops growing at ``k`` samples makes small sizes dearer per sample than large ones
    (the linear fit over-charges, the verified prediction falls short); extensions close the gap."""
    rng = random.Random(seed)
    fixed, per_sample = rng.uniform(1e6, 1e9), rng.uniform(1e4, 1e7)
    workspace, k = rng.uniform(0.0, 0.5) * per_sample, rng.choice([4, 16, 32, 64, 256])
    limit = fixed + per_sample * rng.uniform(200, 50_000)

    def measure(b):
        return fixed + per_sample * b + workspace * min(b, k)

    answer, trials = run_search(measure, limit=limit, cap=10**6)
    best = true_max(measure, limit, 10**6) if limit < fixed + per_sample * 70_000 else None
    assert best is not None and 0.95 * best <= answer <= best
    assert len(trials) - 3 <= 3 and {t.phase for t in trials} <= MEMORY_PHASES


def test_an_extension_that_fails_backs_off_below_it():
    """An OOM the memory does not foretell, above the verified size: the extension fails and the search backs
    off and bisects below it, within the tolerance, never answering a size that did not run."""
    def measure(b):
        return None if b > 5000 else 1000 + 100 * b + 200 * min(b, 32)

    answer, trials = run_search(measure, limit=1e6)
    phases = [t.phase for t in trials]
    assert phases[3] == VERIFY and phases[4] == EXTEND and not trials[4].ok
    assert phases[5] == BACKOFF and phases[-1] in (BACKOFF, BISECT)
    assert 5000 / 1.05 - 1 <= answer <= 5000 and any(t.size == answer and t.ok for t in trials)


def test_throughput_ladder():
    assert throughput_ladder(12) == [2, 4, 8, 12]
    assert throughput_ladder(16) == [2, 4, 8, 16]
    assert throughput_ladder(3, count=4) == [1, 2, 3]
    assert throughput_ladder(1) == [1] and throughput_ladder(0) == []

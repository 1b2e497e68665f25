"""The probe on CPU under a memory budget, against an exhaustive search with the same accounting."""

import time

import pytest
import torch
import torch.nn.functional as F

from gns_callback.probe import measure_micro_batch, probe_micro_batch
from gns_callback.probe.memory_model import BACKOFF, BISECT, EXTEND, FIT, VERIFY
from tests.helpers import bn_mlp, mlp, small_cnn, token_model

MEMORY_PHASES = {FIT, VERIFY, EXTEND, BACKOFF, BISECT}
HEADROOM = 0.85


def make(kind, digits):
    x, y = digits
    if kind == "token":
        net = token_model()
        tokens = (x[:16].reshape(16, 8, 8).sum(-1) % 17).long()  # (16, 8) token ids from real images
        batch = (tokens, y[:16])
    else:
        net = {"mlp": mlp, "cnn": small_cnn, "bn_mlp": bn_mlp}[kind]()
        batch = (x[:16], y[:16])
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    step = lambda b: F.cross_entropy(net(b[0]), b[1])
    return net, opt, batch, step


def exhaustive_max(net, opt, batch, step, limit, upto):
    """Largest size whose accounted bytes are within ``limit``, trying every size 2..upto (BatchNorm cannot
    train on one sample)."""
    sizes = range(2, upto + 1)
    measured = measure_micro_batch(net, opt, batch, sizes, step)
    fitting = [b for b, m in zip(sizes, measured) if m <= limit]
    assert measured[-1] > limit, "exhaustive range too small"
    return max(fitting, default=0)


@pytest.mark.parametrize("kind, target", [("mlp", 300), ("cnn", 150), ("token", 150), ("bn_mlp", 200)])
def test_prediction_within_ten_percent_of_exhaustive_in_at_most_four_trials(digits, kind, target):
    net, opt, batch, step = make(kind, digits)
    # a budget whose largest micro-batch is around ``target`` (keeps the exhaustive search short)
    b2, b8 = measure_micro_batch(net, opt, batch, [2, 8], step)
    per_sample = (b8 - b2) / 6
    budget = int((b2 + per_sample * (target - 2) + per_sample / 2) / HEADROOM)

    result = probe_micro_batch(net, opt, batch, step, memory_budget_bytes=budget, headroom=HEADROOM,
                               throughput=False, progress_bar=False)
    truth = exhaustive_max(net, opt, batch, step, HEADROOM * budget, upto=int(target * 1.3))

    assert abs(result.max_micro_batch - truth) <= 0.1 * truth, (result.max_micro_batch, truth)
    assert result.max_micro_batch <= truth  # never above what fits
    memory_trials = [t for t in result.trials if t.phase in MEMORY_PHASES]
    assert len(memory_trials) <= 4, result.trials
    assert any(t.size == result.max_micro_batch and t.ok for t in result.trials)
    assert result.budget_bytes == budget and result.measure == "accounting" and result.device == "cpu"
    assert result.bytes_per_sample == pytest.approx(per_sample, rel=0.01)


def test_every_trial_obeys_the_budget_and_failures_carry_a_reason(digits):
    net, opt, batch, step = make("mlp", digits)
    result = probe_micro_batch(net, opt, batch, step, memory_budget_bytes=60_000, fit_sizes=(2, 8, 1024),
                               throughput=False, progress_bar=False)
    for trial in result.trials:
        if trial.ok:
            assert trial.measured_bytes <= result.limit_bytes
        else:  # stopped early in forward (no bytes), or over after gradients and Adam state were added
            assert trial.error == "over budget"
            assert trial.measured_bytes is None or trial.measured_bytes > result.limit_bytes
    assert not [t for t in result.trials if t.size == 1024][0].ok
    assert 0 < result.max_micro_batch < 1024


def test_throughput_is_measured_in_steady_state_only(digits):
    """A first step per size that is slow (a warm-up: allocation, autotuning) must not enter samples/s."""
    net, opt, batch, _ = make("mlp", digits)
    seen = set()
    calls = []

    def step(b):
        calls.append(b[0].shape[0])
        if b[0].shape[0] not in seen:
            seen.add(b[0].shape[0])
            time.sleep(0.2)
        return F.cross_entropy(net(b[0]), b[1])

    result = probe_micro_batch(net, opt, batch, step, memory_budget_bytes=150_000, throughput_sizes=[16, 64],
                               warmup_steps=2, timed_steps=3, timing_budget_s=0.1,
                               progress_bar=False)
    timed = [t for t in result.trials if t.phase == "throughput"]
    assert [t.size for t in timed] == sorted({16, 64, result.max_micro_batch})
    for trial in timed:
        assert trial.ok and trial.step_seconds < 0.1 and trial.samples_per_s > 0
        assert trial.samples_per_s == pytest.approx(trial.size / trial.timing.seconds)  # the median step time
        assert trial.timing.repeats >= 3
        assert calls.count(trial.size) >= 2 + 3  # 2 warm-up steps (the measured one first), 3 timed
    assert set(result.throughput) == {t.size for t in timed}
    assert result.fastest_micro_batch in result.throughput


def test_cap_and_no_budget_on_cpu_uses_available_memory(digits):
    net, opt, batch, step = make("mlp", digits)
    result = probe_micro_batch(net, opt, batch, step, max_batch_size=100, throughput=False, progress_bar=False)
    assert result.max_micro_batch == 100 and result.capped
    assert result.budget_bytes > 10**8  # this machine's available memory, plus the model


def test_nothing_fits(digits):
    net, opt, batch, step = make("mlp", digits)
    result = probe_micro_batch(net, opt, batch, step, memory_budget_bytes=1000, progress_bar=False)
    assert result.max_micro_batch == 0 and result.throughput == {}
    assert [t.size for t in result.trials] == [2, 1] and not any(t.ok for t in result.trials)


def test_on_cuda_a_size_that_may_be_the_answer_must_run_two_steps(digits, monkeypatch):
    """The allocator's peak is faked on the CPU: from 300 examples up the second step of a trial goes over the
    limit (fragmentation), the first never does. The fit's small sizes run one step; every later trial runs two,
    so the answer is a size whose second step fitted, where one step each answered 1000."""
    import gns_callback.probe.session as session
    import gns_callback.probe.trial as trial

    steps_since_start: list[int] = []

    def fake_start(device):
        steps_since_start.clear()

    def fake_peak(device):
        return max(1e6 * b + (1e9 if i >= 1 and b >= 300 else 0) for i, b in enumerate(steps_since_start))

    net = mlp()
    forward = net.forward
    net.forward = lambda x: (steps_since_start.append(x.shape[0]), forward(x))[1]
    monkeypatch.setattr(session, "resolve_measure", lambda measure, device: "cuda")
    monkeypatch.setattr(trial, "cuda_peak_start", fake_start)
    monkeypatch.setattr(trial, "cuda_peak_bytes", fake_peak)
    x, y = digits
    result = probe_micro_batch(net, torch.optim.SGD(net.parameters(), lr=0.1), (x[:32], y[:32]),
                               lambda b: F.cross_entropy(net(b[0]), b[1]), memory_budget_bytes=1e9, headroom=1.0,
                               max_batch_size=1000, throughput=False, progress_bar=False)
    assert 280 <= result.max_micro_batch < 300
    assert all(t.ok == (t.size < 300) for t in result.trials)

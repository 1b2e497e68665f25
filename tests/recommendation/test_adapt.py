import math

import pytest

from gns_callback.recommendation import AdaptPolicy, recommend
from tests.recommendation.synthetic import synthetic_estimate


def decide_all(policy, targets, accum=4, micro=16, devices=1):
    """Feed recommended global batch sizes, applying changes; returns the accumulate after each check."""
    out = []
    for t in targets:
        d = policy.decide(accum, t, micro_batch_size=micro, num_devices=devices)
        if d.change:
            accum = d.accumulate_grad_batches
        out.append(accum)
    return out


def test_no_change_inside_the_band():
    # current global = 4 × 16 = 64; 1.4× and 1/1.4× stay inside the 1.5× band.
    assert decide_all(AdaptPolicy(patience=1), [89, 46, 64, 90, 50] * 4) == [4] * 20


def test_change_after_persistence():
    policy = AdaptPolicy(patience=3)
    decisions = [policy.decide(4, 256, micro_batch_size=16) for _ in range(3)]
    assert [d.change for d in decisions] == [False, False, True]
    assert "pending (2/3)" in decisions[1].reason
    last = decisions[-1]
    assert last.accumulate_grad_batches == 16 and last.batch_size == 256 and last.batch_ratio == 4.0
    assert last.new_lr(0.1, "linear") == pytest.approx(0.4)
    assert last.new_lr(0.1, "sqrt") == pytest.approx(0.2)


def test_median_of_the_streak_and_bounds():
    policy = AdaptPolicy(patience=3, max_accumulate=12)
    assert decide_all(policy, [256, 320, 192]) == [4, 4, 12]  # median 16 clipped to 12
    assert decide_all(AdaptPolicy(patience=3), [256, 1024, 192]) == [4, 4, 16]  # median ignores the spike


def test_no_oscillation_on_alternating_inputs():
    policy = AdaptPolicy(patience=2)
    assert decide_all(policy, [256, 16] * 20) == [4] * 40
    # Even a patience of 2 with a spike in between restarts the streak.
    assert decide_all(AdaptPolicy(patience=2), [256, 64, 256, 256]) == [4, 4, 4, 16]


def test_an_unresolved_recommendation_resets_and_never_changes():
    est = synthetic_estimate(b=1000.0, lo=30.0, hi=None)  # unbounded, and its interval holds the current 64
    unresolved = recommend(est, current_batch_size=64, current_lr=0.1)
    assert not unresolved.actionable and unresolved.status == "unbounded"
    trusted = recommend(synthetic_estimate(b=256.0, lo=220.0, hi=300.0), current_batch_size=64, current_lr=0.1)
    assert trusted.actionable and trusted.batch_size == 256
    policy = AdaptPolicy(patience=2)
    seq = [trusted, unresolved, trusted, unresolved, trusted, trusted]
    assert decide_all(policy, seq) == [4, 4, 4, 4, 4, 16]


def test_an_interval_wholly_above_the_batch_moves_it_to_the_near_end():
    """An unbounded interval whose lower end lies above the current batch: every value it holds says grow, so adapt
    grows to that end (before, it waited for a narrow interval, which a run far below the knee never measured)."""
    toward = recommend(synthetic_estimate(b=1000.0, lo=200.0, hi=None), current_batch_size=64, current_lr=0.1)
    assert toward.status == "toward_interval" and not toward.trusted and toward.actionable
    assert decide_all(AdaptPolicy(patience=2), [toward, toward]) == [4, round(toward.batch_size / 16)]
    assert toward.batch_size == 200


def test_cooldown_after_change_and_state_dict():
    policy = AdaptPolicy(patience=1, cooldown=2)
    assert decide_all(policy, [256, 16, 16, 16]) == [16, 16, 16, 1]
    p = AdaptPolicy(patience=3)
    p.decide(4, 256, micro_batch_size=16)
    p.decide(4, 256, micro_batch_size=16)
    q = AdaptPolicy(patience=3)
    q.load_state_dict(p.state_dict())
    assert q.decide(4, 256, micro_batch_size=16).change


def test_lr_schedule_ramps_increases_and_drops_decreases():
    policy = AdaptPolicy(patience=1)
    up = policy.decide(4, 256, micro_batch_size=16)
    lr = up.lr_schedule(0.1, "linear", warmup_steps=10)
    assert [lr(0), lr(5), lr(10), lr(50)] == pytest.approx([0.1, 0.25, 0.4, 0.4])
    down = policy.decide(16, 64, micro_batch_size=16)
    lr = down.lr_schedule(0.4, "linear", warmup_steps=10)
    assert lr(0) == pytest.approx(0.1)


def test_invalid_policy():
    with pytest.raises(ValueError):
        AdaptPolicy(factor=1.0)
    with pytest.raises(ValueError):
        AdaptPolicy(patience=0)


def test_new_lr_uses_the_noise_scale_and_ceiling_of_the_recommendation():
    est = synthetic_estimate(b=256.0, lo=220.0, hi=300.0)
    rec = recommend(est, current_batch_size=64, current_lr=0.1, optimizer="SGD", lr_rule="noise_linear")
    d = AdaptPolicy(patience=1).decide(4, rec, micro_batch_size=16)
    assert d.change and d.batch_size == 256 and d.b_noise == 256.0 and d.lr_ceiling_factor == math.inf
    # From 64 to 256 at B_noise 256: (1 + 4)/(1 + 1) = 2.5, as recommend() says; the plain rules as before.
    assert d.new_lr(0.1, "noise_linear") == pytest.approx(0.25) and rec.learning_rate == pytest.approx(0.25)
    assert d.new_lr(0.1, "noise_sqrt") == pytest.approx(0.1 * 2.5**0.5)
    assert d.new_lr(0.1, "linear") == pytest.approx(0.4)
    # The SGD default without a sharpness holds the LR; with one, it stops at the stability limit.
    held = recommend(est, current_batch_size=64, current_lr=0.1, optimizer="SGD")
    d = AdaptPolicy(patience=1).decide(4, held, micro_batch_size=16)
    assert d.lr_ceiling_factor == 1.0 and d.new_lr(1.0, held.lr_rule) == 1.0
    capped = recommend(est, current_batch_size=64, current_lr=0.1, optimizer="SGD", sharpness=10.0)  # limit 0.2
    d = AdaptPolicy(patience=1).decide(4, capped, micro_batch_size=16)
    assert d.new_lr(1.0, capped.lr_rule) == pytest.approx(2.0) and capped.learning_rate == pytest.approx(0.2)
    # A plain batch size carries no noise scale: the noise-aware rules take their small-batch limit.
    assert AdaptPolicy(patience=1).decide(4, 256, micro_batch_size=16).new_lr(0.1, "noise_linear") == pytest.approx(0.4)

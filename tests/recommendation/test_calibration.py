import torch

from gns_callback.recommendation import recommend
from gns_callback.recommendation.calibration import MEASURED, may_move, uncalibrated_reason
from tests.recommendation.synthetic import synthetic_estimate


def est(b, lo=None, hi=None):
    return synthetic_estimate(b=b, lo=b / 1.3 if lo is None else lo, hi=b * 1.3 if hi is None else hi, steps=400)


def _optimizer(cls=torch.optim.SGD, **kw):
    return cls([torch.nn.Parameter(torch.zeros(1))], lr=0.1, **kw)


def test_only_plain_sgd_is_calibrated():
    assert uncalibrated_reason(_optimizer()) is None
    assert uncalibrated_reason(torch.optim.SGD) is None and uncalibrated_reason("SGD") is None  # momentum unknown
    assert "momentum 0.9" in uncalibrated_reason(_optimizer(momentum=0.9))
    assert "Adam" in uncalibrated_reason(_optimizer(torch.optim.Adam))
    assert "lower bound" in uncalibrated_reason(torch.optim.AdamW)


def test_the_reason_gives_the_optimizers_own_measurement_or_says_it_was_not_measured():
    # Before: every optimizer but plain SGD read "with <it> the slow-way B_crit on digits was 1.9–17× the reading",
    # measured or not; RMSprop and Adagrad, measured since, read near their slow-way B_crit instead.
    for name in ("Lion", "Adadelta"):
        assert f"{name} was not measured" in uncalibrated_reason(name)
    assert "momentum 0.5 was not measured" in uncalibrated_reason(_optimizer(momentum=0.5))
    nesterov = uncalibrated_reason(_optimizer(momentum=0.9, nesterov=True))
    assert "with Nesterov momentum 0.9 the slow-way B_crit on digits was 4.6–6× the noise-scale reading" in nesterov
    assert nesterov.endswith("which is then a lower bound")
    for optimizer, label in ((_optimizer(torch.optim.RMSprop), "RMSprop"), (torch.optim.Adagrad, "Adagrad")):
        reason = uncalibrated_reason(optimizer)
        low, high = MEASURED[label]
        assert high < 1.0 and f"with {label} the slow-way B_crit on digits was {low:g}–{high:g}×" in reason
        assert "may overstate it (not a lower bound" in reason


def test_uncalibrated_optimizers_only_move_up():
    assert may_move(40.0, 512, _optimizer()) is None
    assert may_move(400.0, 64, torch.optim.Adam) is None
    assert "keeping the current batch 512" in may_move(40.0, 512, torch.optim.Adam)


def test_recommend_keeps_a_decrease_for_adam_and_momentum_and_raises_for_all():
    for optimizer in (_optimizer(torch.optim.Adam), _optimizer(momentum=0.9)):
        down = recommend(est(40.0), current_batch_size=512, current_lr=0.1, optimizer=optimizer)
        assert down.status == "not_calibrated" and down.batch_size == 512 and not down.changed
        assert down.learning_rate == 0.1 and "lower bound" in down.reason
        up = recommend(est(40.0), current_batch_size=8, current_lr=0.1, optimizer=optimizer)
        assert up.status == "ok" and up.batch_size == 40
    plain = recommend(est(40.0), current_batch_size=512, current_lr=0.1, optimizer=_optimizer())
    assert plain.status == "ok" and plain.batch_size == 40
    wide = recommend(est(40.0, lo=10.0, hi=90.0), current_batch_size=512, current_lr=0.1,
                     optimizer=torch.optim.Adam)
    assert wide.status == "not_calibrated" and wide.batch_size == 512


def test_momentum_range_includes_the_batch_norm_cnn():
    """With momentum 0.9 the slow-way B_crit was 1.2–9.1× the reading on the digits BatchNorm CNN (RESULTS.md,
    "Critical batch on a BatchNorm CNN"), nearer than the digits MLP's 4–17×; before, the reason said 4–17×."""
    reason = uncalibrated_reason(_optimizer(momentum=0.9))
    assert "with momentum 0.9 the slow-way B_crit on digits was 1.2–17× the noise-scale reading" in reason
    assert reason.endswith("which is then a lower bound")

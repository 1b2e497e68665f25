"""``gns_callback.overflows``: the steps a GradScaler skips once the scale has settled, and when the estimate is
withheld for them."""

import pytest

from gns_callback.overflows import MAX_SHARE, MIN_OVERFLOWS, OverflowCount


def counted(steps: str, scaled: bool = True) -> OverflowCount:
    """``steps``: one character a step, ``x`` overflowed, ``.`` finite; ``scaled``: under a GradScaler."""
    count = OverflowCount(scaled=scaled)
    for step in steps:
        count.update(step == ".")
    return count


def test_overflows_before_the_first_finite_step_are_the_scale_settling_not_counted():
    count = counted("x" * 40 + "." * 100)
    assert (count.settled, count.overflowed) == (100, 0) and count.problem() is None


def test_a_few_overflows_after_it_are_tolerated_and_more_withhold_until_their_share_falls():
    assert counted("." * 50 + "x" * (MIN_OVERFLOWS - 1)).problem() is None  # a fresh scaler settling again
    count = counted("." * 97 + "x" * MIN_OVERFLOWS)
    assert "3 of the 100 steps" in count.problem() and "growth_interval" in count.problem()
    steps_to_clear = int(MIN_OVERFLOWS / MAX_SHARE)
    for _ in range(steps_to_clear - 100):
        count.update(True)
    assert count.problem() is None  # 3 in 1,500: the share the default scaler's own doubling gives


def test_the_count_survives_a_checkpoint():
    count = counted(".x.x.x")
    again = OverflowCount()
    again.load_state_dict(count.state_dict())
    assert again == count and again.problem() == count.problem()


@pytest.mark.parametrize("steps", ["x", "xx.", "...."])
def test_without_overflows_after_settling_there_is_no_problem(steps):
    assert counted(steps).problem() is None


def test_without_a_loss_scale_non_finite_gradients_read_as_a_diverged_run_not_a_scaler():
    """Before, a run without AMP whose gradients turned NaN (a learning rate too high) was told to change its
    GradScaler's growth_interval."""
    problem = counted("." * 97 + "x" * MIN_OVERFLOWS, scaled=False).problem()
    assert "3 of the 100 steps" in problem and "diverged" in problem and "Lower the learning rate" in problem
    assert "growth_interval" not in problem


def test_a_checkpoint_from_before_the_scaled_flag_reads_as_scaled():
    count = OverflowCount()
    count.load_state_dict({"settled": 100, "overflowed": 3})
    assert count.scaled and "growth_interval" in count.problem()

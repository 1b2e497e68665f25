"""The callback logs to every logger at its own ``log_every_n_steps``, whatever the Trainer's, plus one point at
fit end; nothing else (no stale repeats). Checked in a CSVLogger of either namespace, against the callback's own
history and its final estimate."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from gns_callback import GradientNoiseScaleCallback

STEPS = 46  # one epoch of 46 optimizer steps: the last is not on any interval below


def csv_rows(log_dir: str, column: str) -> list[tuple[int, float]]:
    with open(Path(log_dir) / "metrics.csv", newline="") as handle:
        return [(int(row["step"]), float(row[column])) for row in csv.DictReader(handle) if row.get(column)]


def same(logged: float, reported) -> bool:
    """A CSV value and a history value (``None`` there stands for a non-finite one)."""
    return not math.isfinite(logged) if reported is None else logged == pytest.approx(reported, rel=1e-12)


@pytest.mark.parametrize("every, trainer_every", [(5, 50), (20, 5)])
def test_csv_rows_follow_the_callback_interval_with_a_fit_end_point(namespace, tmp_path, every, trainer_every):
    cb = GradientNoiseScaleCallback(method="per_example", log_every_n_steps=every, verbose=False)
    logger = namespace.sub("loggers").CSVLogger(tmp_path, name="run")
    trainer = namespace.trainer(callbacks=[cb], logger=logger, log_every_n_steps=trainer_every)
    trainer.fit(namespace.classifier(lr=0.05, micro_batches=STEPS))

    rows = csv_rows(logger.log_dir, "gns/b_simple")
    # Lightning's step convention: the row after optimizer step k (1-based) is at step k - 1, as its own rows are.
    assert [step for step, _ in rows] == [k - 1 for k in range(every, STEPS + 1, every)] + [STEPS - 1]
    assert [step for step, _ in csv_rows(logger.log_dir, "train_loss")] == [
        k - 1 for k in range(trainer_every, STEPS + 1, trainer_every)]
    # each row is the history point of that step: nothing repeated from an earlier one
    history = cb.history
    assert [point["step"] - 1 for point in history] == [step for step, _ in rows]
    assert all(same(value, point["b_simple"]) for (_, value), point in zip(rows, history))
    assert history[-1].get("final") and not any(point.get("final") for point in history[:-1])
    # the last point is the final value the callback prints and reports
    assert same(rows[-1][1], cb.estimate.to_dict()["b_simple"])
    assert same(csv_rows(logger.log_dir, "gns/b_simple_run")[-1][1], cb.run_estimate.to_dict()["b_simple"])


def test_the_trainer_interval_is_the_default(namespace, tmp_path):
    cb = GradientNoiseScaleCallback(method="per_example", verbose=False, recommend=False)
    logger = namespace.sub("loggers").CSVLogger(tmp_path, name="run")
    namespace.trainer(callbacks=[cb], logger=logger, log_every_n_steps=20).fit(
        namespace.classifier(lr=0.05, micro_batches=STEPS))
    assert [step for step, _ in csv_rows(logger.log_dir, "gns/b_simple")] == [19, 39, 45]

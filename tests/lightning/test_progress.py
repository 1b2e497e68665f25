"""Progress feedback where the callback takes seconds: the probe shows a progress bar when the Trainer shows one
(as Lightning's tuner does), a start line when it does not, its summary when done; ``verbose=False`` is silent."""

from __future__ import annotations

import logging

import pytest

from gns_callback import GradientNoiseScaleCallback


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def said(namespace):
    """What the callback says through the namespace's console logger (which does not propagate to the root), at
    INFO whatever another test left the namespace's level at."""
    handler = Lines()
    logger = logging.getLogger(f"{namespace.name}.callbacks.gns")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def probing_fit(namespace, verbose: bool, enable_progress_bar: bool) -> GradientNoiseScaleCallback:
    cb = GradientNoiseScaleCallback(method="per_example", probe=True, memory_budget_bytes=20_000_000,
                                    verbose=verbose, recommend=False)
    namespace.trainer(callbacks=[cb], enable_progress_bar=enable_progress_bar).fit(namespace.classifier(micro_batches=4))
    assert cb.probe is not None and cb.probe.measured, cb.probe  # the probe runs under either namespace
    return cb


def test_probe_shows_a_progress_bar_with_the_trainer_s(namespace, said, capsys):
    probing_fit(namespace, verbose=True, enable_progress_bar=True)
    assert "Probing micro-batch" in capsys.readouterr().err
    assert any(line.startswith("GradientNoiseScaleCallback: probe on cpu") for line in said)


@pytest.mark.parametrize("namespace", ["lightning.pytorch"], indirect=True)
def test_probe_says_it_starts_without_a_progress_bar(namespace, said, capsys):
    probing_fit(namespace, verbose=True, enable_progress_bar=False)
    assert "Probing micro-batch" not in capsys.readouterr().err
    starts = [i for i, line in enumerate(said) if line.startswith("GradientNoiseScaleCallback: probing")]
    done = [i for i, line in enumerate(said) if line.startswith("GradientNoiseScaleCallback: probe on cpu")]
    assert len(starts) == 1 and len(done) == 1 and starts[0] < done[0]


@pytest.mark.parametrize("namespace", ["lightning.pytorch"], indirect=True)
def test_verbose_false_is_silent(namespace, said, capsys):
    probing_fit(namespace, verbose=False, enable_progress_bar=True)
    captured = capsys.readouterr()
    assert "Probing micro-batch" not in captured.err
    assert "GradientNoiseScaleCallback" not in captured.out + captured.err
    assert said == []

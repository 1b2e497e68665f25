"""Issue 10 item 6: silent partial coverage. An LSTM + Linear model under ``auto`` got ``per_example``, which measured
the Linear only, and nothing was printed. LSTMs are measured whole since; one with projected hidden states
(``proj_size``) is not, and is the partly covered model here (its Linear is 4.2% of the parameters). ``auto``
prefers ``micro_batch`` (which covers every parameter) when per-example norms would cover less than
``MIN_COVERAGE`` (90%) and the run has several micro-batches; otherwise it measures the covered share and says
so: a warning at fit start with the fraction, a line in the fit-end summary, and ``coverage`` in the report. The
value is then exactly the noise scale of the covered parameters, and no batch size is recommended from it (status
``partial_coverage``)."""

import json

import pytest
import torch.nn.functional as F

from gns_callback import GradientNoiseScaleCallback
from gns_callback.collectors import MIN_COVERAGE
from tests.helpers import Classifier, assert_matches_exact, with_replacement_loader
from tests.trust.models import ProjectedLstmClassifier, ScaledLogits
from tests.trust.setups import messages, single, with_and_without

STEPS = 150

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap over LSTM in the exact value


def run(digits, accumulate, batch_size, tmp_path, monkeypatch):
    x, y = digits
    printed = []
    monkeypatch.setattr("gns_callback.lightning.trainer_facts.say", lambda trainer, message: printed.append(message))
    callback = GradientNoiseScaleCallback(report_path=str(tmp_path / "report.json"))  # auto, verbose
    _, caught = with_and_without(
        lambda: Classifier(ProjectedLstmClassifier()),
        lambda: with_replacement_loader(x, y, batch_size, batch_size * accumulate * STEPS, seed=0),
        callback, accumulate_grad_batches=accumulate,
    )
    return callback, caught, printed, json.loads((tmp_path / "report.json").read_text())


def test_auto_prefers_micro_batch_which_covers_the_whole_model(digits, exact_gns, tmp_path, monkeypatch):
    callback, caught, printed, report = run(digits, 4, 8, tmp_path, monkeypatch)
    assert callback.run_estimate.method == "micro_batch" and report["coverage"]["fraction"] == 1.0
    assert any("uses 'micro_batch' (per-example norms would cover only 4.2%" in line for line in printed)
    assert not messages(caught, "cover only")
    assert_matches_exact(callback.run_estimate, exact_gns(ProjectedLstmClassifier(), F.cross_entropy, *digits)[0])


def test_one_micro_batch_measures_the_covered_share_and_says_so(digits, exact_gns, tmp_path, monkeypatch):
    callback, caught, printed, report = run(digits, 1, 32, tmp_path, monkeypatch)
    assert "cover only 4.2% of the trainable parameters" in single(messages(caught, "cover only"))
    assert any("B_simple is that of 4.2% of the trainable parameters" in line for line in printed)
    assert report["coverage"]["fraction"] == pytest.approx(0.0424, abs=1e-4)
    assert report["coverage"]["fraction"] < MIN_COVERAGE
    assert set(report["coverage"]["excluded"]) == {"net.lstm.weight_ih_l0", "net.lstm.weight_hh_l0", "net.lstm.bias_ih_l0",
                                                   "net.lstm.bias_hh_l0", "net.lstm.weight_hr_l0"}
    covered = ProjectedLstmClassifier()
    covered.lstm.requires_grad_(False)  # the exact noise scale of the head's parameters alone
    assert_matches_exact(callback.run_estimate, exact_gns(covered, F.cross_entropy, *digits)[0])
    # ... which is not the model's: no batch size is recommended from it (the current one is kept, with the fix)
    assert callback.recommendation.status == "partial_coverage" and not callback.recommendation.changed
    assert "4.2% of the trainable parameters" in callback.recommendation.reason


def test_a_temperature_left_out_widens_the_intervals_to_hold_the_whole_models_value(digits, exact_gns, tmp_path):
    """A learned logit scale is one parameter of 2,411, so ``auto`` measures the rest with per-example norms and says
    nothing; but that one parameter doubles the whole model's noise scale (171 against 82). Before, both estimates
    read about 83 with intervals of about [74, 96] and [75, 152], and so did the critical batch the recommendation
    aims at: confidently wrong. Now their intervals make room for what the left-out parameter's share of the step
    gradient allows (``gns_callback/left_out.py``)."""
    x, y = digits
    callback = GradientNoiseScaleCallback(verbose=False, report_path=str(tmp_path / "report.json"))
    _, caught = with_and_without(lambda: Classifier(ScaledLogits()),
                                 lambda: with_replacement_loader(x, y, 32, 32 * 300, seed=0), callback)
    assert not messages(caught, "cover only")
    exact = exact_gns(ScaledLogits(), F.cross_entropy, *digits)[0]
    assert exact > 2 * callback.run_estimate.b_simple  # the measured parameters' value is far from the model's ...
    for estimate in (callback.run_estimate, callback.estimate):
        assert estimate.method == "per_example" and estimate.ci_low <= exact <= estimate.ci_high  # ... and now held
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["coverage"]["fraction"] > 0.999 and report["coverage"]["left_out_gradient_share"] > 0.1
    critical = report["critical_batch"]  # what the recommendation aims at: the run average here (a flat loss)
    assert critical["ci_low"] <= exact <= critical["ci_high"]
    # Before, B = 80 was recommended from the measured parameters' 83 [74, 96]; now the batch is kept, with the fix
    assert callback.recommendation.status == "too_wide" and not callback.recommendation.changed
    assert "which more steps don't remove: method='micro_batch'" in callback.recommendation.reason

"""A table tied between the token embedding and the output head (GPT-2, nanoGPT) used to be left out of both norms
under ``per_example`` (a parameter shared by two modules), so ``auto`` measured a share of the model or needed
``micro_batch``. Its per-example norm is now measured exactly (:mod:`gns_callback.per_example.tied`): with one
micro-batch per step, ``auto`` measures the whole model and the exact value lies inside the interval. (The cross
term between the table's two uses moves this model's B_simple by only 0.1%; its exactness is pinned against
``torch.func`` in tests/per_example/test_tracker.py, where leaving it out is 2–7% off.)"""

import torch.nn.functional as F

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, assert_matches_exact, with_replacement_loader
from tests.trust.models import TiedLanguageModel
from tests.trust.setups import messages, with_and_without

STEPS = 150


def test_one_micro_batch_measures_the_whole_tied_model(digits, exact_gns):
    x, y = digits
    tokens = (x * 16).round().long()  # 64 pixel intensities per image as tokens 0..16
    callback = GradientNoiseScaleCallback(verbose=False)  # method="auto"
    _, caught = with_and_without(lambda: Classifier(TiedLanguageModel()),
                                 lambda: with_replacement_loader(tokens, y, 32, 32 * STEPS, seed=0), callback)
    assert not messages(caught, "cover only") and not messages(caught, "stopped measuring")
    assert callback.meter.coverage["fraction"] == 1.0
    run = callback.run_estimate
    assert run.method == "per_example" and run.steps == STEPS
    assert_matches_exact(run, exact_gns(TiedLanguageModel(), F.cross_entropy, tokens, y)[0])

"""Issue 10 item 15: one callback object used by two Trainers. The second fit wrote into the first fit's report path
(the first fit had stored its resolved path in ``report_path``). ``report_path`` is never changed now; each fit
resolves its own (``cb.report_file``), starts from zero, and leaves the first fit's report as it was."""

import torch.nn.functional as F

from gns_callback import GradientNoiseScaleCallback, load_estimate
from tests.helpers import Classifier, assert_matches_exact, mlp, small_cnn, with_replacement_loader
from tests.trust.setups import fit, trains_without_callback

STEPS = 150


def test_second_fit_gets_its_own_report_and_its_own_estimate(digits, exact_gns, tmp_path):
    x, y = digits
    loader = lambda: with_replacement_loader(x, y, 32, 32 * STEPS, seed=0)  # noqa: E731
    nets = {"a": mlp, "b": small_cnn}
    for name, net in nets.items():
        trains_without_callback(lambda: Classifier(net()), loader, default_root_dir=str(tmp_path / f"plain_{name}"))

    callback = GradientNoiseScaleCallback(method="per_example", verbose=False)  # default report path
    reports = {}
    for name, net in nets.items():
        fit(Classifier(net()), loader(), (callback,), default_root_dir=str(tmp_path / name))
        reports[name] = callback.report_file
        assert callback.report_path is None
        assert callback.run_estimate.steps == STEPS  # this fit's steps only
        assert load_estimate(reports[name], "run_estimate") == callback.run_estimate
    assert reports == {name: str(tmp_path / name / "gns_report.json") for name in nets}
    for name, net in nets.items():  # each report holds its own fit's value, the first one untouched
        assert_matches_exact(load_estimate(reports[name], "run_estimate"), exact_gns(net(), F.cross_entropy, x, y)[0])

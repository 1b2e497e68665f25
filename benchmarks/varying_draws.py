"""Examples that vary between draws on shuffled epochs: wine with Gaussian jitter added as the data set loads an
example (``tests/trust/test_varying_draws.py``'s setup), the callback at its defaults over several data orders,
against the exact ``B_simple`` over the examples and the jitter. RESULTS.md, "Examples that vary between draws".

    python benchmarks/varying_draws.py --seeds 5
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import warnings

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gns_callback import GradientNoiseScaleCallback  # noqa: E402
from gns_callback.exact import exact_b_simple  # noqa: E402
from tests.helpers import Classifier, quiet_trainer  # noqa: E402
from tests.trust.test_shuffled_small_data import EPOCHS, wine  # noqa: E402
from tests.trust.test_varying_draws import Jittered, exact_over_jitter, net  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    seeds = parser.parse_args().seeds
    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    x, y = wine()
    exact = exact_over_jitter(net(), x, y)
    print(f"exact B_simple over the jitter {exact:.1f}, without it {exact_b_simple(net(), F.cross_entropy, x, y)[0]:.1f}")
    held = 0
    for seed in range(seeds):
        callback = GradientNoiseScaleCallback(report_path=tempfile.mktemp(suffix=".json"), verbose=False)
        torch.manual_seed(seed)
        loader = DataLoader(Jittered(x, y), batch_size=16, shuffle=True, drop_last=True,
                            generator=torch.Generator().manual_seed(seed))
        quiet_trainer(max_epochs=EPOCHS, callbacks=[callback]).fit(Classifier(net()), loader)
        est = callback.run_estimate
        holds = est.ci_low <= exact <= est.ci_high
        held += holds
        print(f"seed {seed}: {est.b_simple:.1f} [{est.ci_low:.1f}, {est.ci_high:.1f}] holds: {holds}", flush=True)
    print(f"held {held} of {seeds}")


if __name__ == "__main__":
    main()

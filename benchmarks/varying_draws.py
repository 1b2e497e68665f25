"""Examples that vary between draws on shuffled epochs, over several data orders, against the exact ``B_simple`` over
the examples and their draws (``tests/trust/test_varying_draws.py``'s setups). RESULTS.md, "Examples that vary
between draws".

    python benchmarks/varying_draws.py --seeds 5                  # wine, jitter in the data set, the callback
    python benchmarks/varying_draws.py --seeds 5 --case loop      # wine, dropout masks drawn in a loop of one's own
    python benchmarks/varying_draws.py --seeds 5 --case own       # the same, from a numpy generator the loop keeps

``--case loop`` and ``--case own`` also run the meter with its watch of the steps' random draws off (the draws taken as fixed, as
before 2026-11-28).
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
from tests.trust.test_varying_draws import (Jittered, MaskedDropout, exact_over_draws, exact_over_jitter,  # noqa: E402
                                            meter_loop, net)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--case", choices=["jitter", "loop", "own"], default="jitter")
    options = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    if options.case == "jitter":
        jitter(options.seeds)
    else:
        loop(options.seeds, masks=True if options.case == "loop" else "own")


def loop(seeds: int, masks) -> None:
    x, y = wine()
    model = MaskedDropout()
    exact = exact_over_draws(model, x, y, lambda gen: torch.cat([x, torch.rand(len(x), 32, generator=gen)], 1))
    print(f"exact B_simple over the masks {exact:.1f}")
    for watch in (True, False):
        held = 0
        for seed in range(seeds):
            meter = meter_loop(model, x, y, masks=masks, seed=seed, watch=watch)
            est = meter.run_estimate
            holds = est.ci_low <= exact <= est.ci_high
            held += holds
            print(f"watch {watch}, seed {seed}: {est.b_simple:.1f} [{est.ci_low:.1f}, {est.ci_high:.1f}] "
                  f"holds: {holds}", flush=True)
        print(f"watch {watch}: held {held} of {seeds}")


def jitter(seeds: int) -> None:
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

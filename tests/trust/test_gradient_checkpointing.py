"""Gradient checkpointing (``torch.utils.checkpoint``), in real fits against the exact value.

Reentrant checkpointing (``use_reentrant=True``, still torch's default when the argument is left out, and Hugging
Face's ``gradient_checkpointing_enable()`` default before transformers 5) runs each checkpointed segment's backward as
a backward pass of its own, from inside the outer pass. Before, each was counted as a micro-batch of its own, holding
part of the model: ``per_example`` read 137 (95% CI 121–159) on a digits MLP whose exact B_simple is 68, a confident
wrong number, and ``micro_batch`` stopped measuring (8 passes for 4 micro-batches). Now the nested passes are one pass
(``gns_callback/backward_passes.py``): every arrangement reads what the same fit reads without reentrancy, and the
exact value lies in its interval. A parameter used in two segments can't be measured that way by either method: it
stops, with the fix.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, assert_matches_exact, with_replacement_loader
from tests.trust.setups import assert_withheld, fit

STEPS = 150


def deep_mlp(seed: int = 0) -> nn.Sequential:
    """64 → 32 → 32 → 32 → 10, tanh."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 10))


#: Which layers run inside checkpoints (the first always outside: a reentrant segment needs an input that requires
#: grad). "last": the outer pass reaches no hook before the segment; "middle": it does; "each": three segments.
SEGMENTS = {"last": [(1, 7)], "middle": [(1, 5)], "each": [(1, 3), (3, 5), (5, 7)]}


class Checkpointed(nn.Module):
    def __init__(self, net: nn.Sequential, segments: list[tuple[int, int]], reentrant: bool) -> None:
        super().__init__()
        self.net, self.segments, self.reentrant = net, segments, reentrant

    def forward(self, x):
        position = 0
        for start, stop in self.segments:
            x = self.net[position:start](x)
            x = checkpoint(self.net[start:stop], x, use_reentrant=self.reentrant)
            position = stop
        return self.net[position:](x)


def measured(digits, method: str, segments: list[tuple[int, int]], reentrant: bool, net=None):
    x, y = digits
    accumulate, batch_size = (4, 8) if method == "micro_batch" else (1, 32)
    callback = GradientNoiseScaleCallback(method=method, verbose=False)
    module = Classifier(Checkpointed(net or deep_mlp(), segments, reentrant))
    fit(module, with_replacement_loader(x, y, batch_size, batch_size * accumulate * STEPS, seed=0), (callback,),
        accumulate_grad_batches=accumulate)
    return callback.run_estimate


@pytest.fixture(scope="module")
def exact(digits, exact_gns):
    x, y = digits
    return exact_gns(deep_mlp(), F.cross_entropy, x, y)[0]


@pytest.mark.parametrize("method", ["per_example", "micro_batch"])
@pytest.mark.parametrize("arrangement", list(SEGMENTS))
def test_reentrant_checkpointing_reads_what_plain_checkpointing_reads(digits, exact, method, arrangement):
    reentrant = measured(digits, method, SEGMENTS[arrangement], reentrant=True)
    plain = measured(digits, method, SEGMENTS[arrangement], reentrant=False)
    assert reentrant.steps == plain.steps == STEPS
    assert reentrant.b_simple == pytest.approx(plain.b_simple, rel=1e-6)
    assert_matches_exact(reentrant, exact, max_ci_ratio=3.0)  # B_simple ≈ 170 at batch 32: a wider interval


def test_a_layer_in_two_reentrant_segments_stops_micro_batch_with_the_fix(digits):
    """Its parameters get a gradient from each segment's pass: the sum of their squares is not the square of their
    sum. (``per_example`` refuses any layer applied twice, checkpointed or not.)"""
    shared = nn.Linear(32, 32)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 32), shared, nn.Tanh(), shared, nn.Tanh(), nn.Linear(32, 10))
    estimate = measured(digits, "micro_batch", [(1, 3), (3, 5)], reentrant=True, net=net)
    assert_withheld(estimate, "two parts of one backward pass", "use_reentrant=False")


def cnn(seed: int = 0) -> nn.Sequential:
    """Digits as 1×8×8 images: Conv 1 → 8, Conv 8 → 64 (stride 2), Conv 64 → 64, Linear 1024 → 10."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(8, 64, 3, padding=1, stride=2), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(64 * 4 * 4, 10))


def test_a_subset_of_examples_is_measured_across_reentrant_segments(digits, exact_gns):
    """Two reentrant segments end the model, so both run before the outer pass reaches any hook and are recorded
    apart, then merged: both must measure the same examples. The subset of 16 (chosen at batch 64 for these widths)
    is decided once per micro-batch; before, the second segment decided again from its own recomputed forward, and
    the run stopped ("measured differently") in 9 of the 15 widths and arrangements tried."""
    x, y = (t[:500] for t in digits)  # the exact value's per-example gradients of 500 examples: 200 MB
    callback = GradientNoiseScaleCallback(method="per_example", verbose=False)
    module = Classifier(Checkpointed(cnn(), [(3, 5), (5, 10)], reentrant=True))
    fit(module, with_replacement_loader(x, y, 64, 64 * STEPS, seed=0), (callback,))
    estimate = callback.run_estimate
    assert estimate.steps == STEPS and callback.meter.failure is None
    assert_matches_exact(estimate, exact_gns(cnn(), F.cross_entropy, x, y)[0], max_ci_ratio=3.0)


def test_hugging_face_gradient_checkpointing_reads_what_no_checkpointing_reads():
    """The real GPT-2 (tiny config, 3 blocks, float64) with ``gradient_checkpointing_enable(use_reentrant=True)``:
    per-example norms and micro-batch norms equal those without checkpointing. Runs where ``transformers`` is
    installed (not in the test extra)."""
    from gns_callback.collectors.micro_batch import MicroBatchCollector
    from gns_callback.per_example import PerExampleNormTracker

    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=23, n_positions=8, n_embd=16, n_layer=3, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager", use_cache=False)
    ids = torch.randint(23, (6, 8), generator=torch.Generator().manual_seed(0))

    def norms(checkpointed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).double().train()
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
            model.enable_input_require_grads()
        with PerExampleNormTracker(model) as tracker, warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # the position table is read at its broadcast, not left out
            model(input_ids=ids, labels=ids).loss.backward()
            per_example = tracker.pop()
            assert tracker.coverage_fraction() == 1.0
        collector = MicroBatchCollector(model)
        collector.attach()
        for half in (ids[:3], ids[3:]):
            model(input_ids=half, labels=half).loss.backward()
        return per_example, torch.stack(collector.pop())

    (plain_examples, plain_passes), (examples, passes) = norms(False), norms(True)
    torch.testing.assert_close(examples, plain_examples, rtol=1e-6, atol=0)
    torch.testing.assert_close(passes, plain_passes, rtol=1e-6, atol=0)

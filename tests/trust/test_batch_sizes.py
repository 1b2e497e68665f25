"""Issue 10 items 2 and 9: the micro-batch size of batches that are not ``(x, y)``.

Item 2: ``micro_batch`` read the size from the first tensor: ``(meta_3vec, x, y)`` gave 3 and 6.1 [5.5, 6.7]
against an exact 32.6. The size is now the leading dim most of the batch's tensors share, and ``per_example``
checks it against what its layers see. Item 9: raw string batches tokenized inside ``training_step`` crashed in
``extract_batch_size``. Now ``per_example`` measures (it reads sizes off its layers) and ``micro_batch`` withholds
with the reason and the fix. A size that can't be told (no tensor, or a tie) is never guessed.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, assert_matches_exact, mlp, token_model
from tests.trust.setups import assert_withheld, fit, messages, single, with_and_without

STEPS = 150


def loader(dataset, batch_size, num_samples, collate_fn=None, seed=0):
    sampler = RandomSampler(range(len(dataset)), replacement=True, num_samples=num_samples,
                            generator=torch.Generator().manual_seed(seed))
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn)


def with_metadata(items):
    """``(meta_3vec, x, y)``: one metadata vector per batch in front of the data."""
    x, y = torch.utils.data.default_collate(items)
    return torch.tensor([float(len(items)), 0.0, 1.0]), x, y


class MetaFirst(Classifier):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch[1:3], batch_idx)


def run_meta(digits, method, accumulate, batch_size):
    callback = GradientNoiseScaleCallback(method=method, verbose=False)
    trainer, caught = with_and_without(
        lambda: MetaFirst(mlp()),
        lambda: loader(TensorDataset(*digits), batch_size, batch_size * accumulate * STEPS,
                       collate_fn=with_metadata),
        callback, accumulate_grad_batches=accumulate,
    )
    return callback, caught


@pytest.fixture(scope="module")
def mlp_exact(digits, exact_gns):
    return exact_gns(mlp(), F.cross_entropy, *digits)[0]


@pytest.mark.parametrize("method, accumulate, batch_size", [("micro_batch", 4, 8), ("per_example", 1, 32)])
def test_metadata_in_front_of_the_data(digits, mlp_exact, method, accumulate, batch_size):
    callback, _ = run_meta(digits, method, accumulate, batch_size)
    assert callback.run_estimate.steps == STEPS and callback.run_estimate.method == method
    assert_matches_exact(callback.run_estimate, mlp_exact)


def probed(digits, module, collate_fn=None):
    callback = GradientNoiseScaleCallback(probe=True, memory_budget_bytes=4_000_000, verbose=False)
    fit(module, loader(TensorDataset(*digits), 32, 32 * 5, collate_fn=collate_fn), (callback,))
    return callback.probe_result


def test_the_probe_tiles_the_data_not_the_metadata_in_front(digits):
    """The probe read the first tensor's dim 0 (3) and tiled only the metadata: 0 bytes per example and the largest
    micro-batch it allows, for any model. It now counts the examples as the estimate does."""
    plain = probed(digits, Classifier(mlp()))
    meta = probed(digits, MetaFirst(mlp()), collate_fn=with_metadata)
    assert plain.measured and plain.bytes_per_sample > 0
    assert meta.bytes_per_sample == plain.bytes_per_sample and meta.max_micro_batch == plain.max_micro_batch


class TiedSizes(Classifier):
    """The batch is ``{"pixels": x (B, 64), "meta": (3,)}`` with the labels inside a list of ints: one tensor of
    each size, so the batch size can't be read off the batch."""

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch["pixels"]), torch.tensor(batch["labels"]))


def tied_collate(items):
    x, y = torch.utils.data.default_collate(items)
    return {"pixels": x, "meta": torch.zeros(3), "labels": y.tolist()}


def run_tied(digits, method, accumulate, batch_size, steps=STEPS):
    callback = GradientNoiseScaleCallback(method=method, verbose=False)
    trainer, caught = with_and_without(
        lambda: TiedSizes(mlp()),
        lambda: loader(TensorDataset(*digits), batch_size, batch_size * accumulate * steps, collate_fn=tied_collate),
        callback, accumulate_grad_batches=accumulate,
    )
    return callback, caught


def test_tied_sizes_withhold_micro_batch_with_the_reason(digits):
    callback, caught = run_tied(digits, "micro_batch", 4, 8, steps=10)
    assert_withheld(callback.run_estimate, "could not be read off the batch", "per_example", "collate_fn")
    single(messages(caught, "stopped measuring"))
    single(messages(caught, "micro-batch size could not be read"))  # and no recommendation is made


def test_tied_sizes_per_example_reads_the_size_off_its_layers(digits, mlp_exact):
    callback, _ = run_tied(digits, "per_example", 1, 32)
    assert callback.run_estimate.steps == STEPS
    assert_matches_exact(callback.run_estimate, mlp_exact)


# ---------------------------------------------------------------- item 9: raw strings, tokenized in training_step
ALPHABET = "abcdefghijklmnopq"  # pixel intensity 0..16 → one letter


def digit_strings(digits):
    """Each digit as ``"<label><64 letters>"``: the batch is a list of str, no tensor at all."""
    x, y = digits
    tokens = (x * 16).round().long()
    return [str(label) + "".join(ALPHABET[t] for t in row) for row, label in zip(tokens.tolist(), y.tolist())]


class Tokenizing(Classifier):
    """Tokenizes inside ``training_step`` (a byte-level tokenizer: letter → 0..16, the first char is the label)."""

    def training_step(self, batch, batch_idx):
        codes = torch.frombuffer(bytearray("".join(batch).encode()), dtype=torch.uint8).reshape(len(batch), 65).long()
        return F.cross_entropy(self.net(codes[:, 1:] - ord("a")), codes[:, 0] - ord("0"))


def run_strings(digits, method, accumulate, batch_size, steps=STEPS):
    callback = GradientNoiseScaleCallback(method=method, verbose=False)
    strings = digit_strings(digits)
    trainer, caught = with_and_without(
        lambda: Tokenizing(token_model()),
        lambda: loader(strings, batch_size, batch_size * accumulate * steps, collate_fn=list),
        callback, accumulate_grad_batches=accumulate,
    )
    return callback, caught


def test_string_batches_per_example_measures(digits, exact_gns):
    x, y = digits
    exact = exact_gns(token_model(), F.cross_entropy, (x * 16).round().long(), y)[0]
    callback, _ = run_strings(digits, "per_example", 1, 64, steps=300)
    assert callback.run_estimate.steps == 300
    assert_matches_exact(callback.run_estimate, exact)


def test_string_batches_micro_batch_withholds_with_the_reason(digits):
    callback, caught = run_strings(digits, "micro_batch", 2, 16, steps=10)
    assert_withheld(callback.run_estimate, "raw strings", "per_example")
    single(messages(caught, "stopped measuring"))


@pytest.mark.parametrize("given, measured", [(8, True), (32, False)])
def test_a_loop_that_gives_the_steps_batch_as_the_micro_batchs_is_stopped_with_the_fix(digits, exact_gns, given,
                                                                                       measured):
    """``micro_batch`` in a loop of one's own, 4 backward passes of 8 examples per step: ``micro_batch_size=32``
    (the step's batch) read B_simple = 247 [209, 299] against an exact 68.0. Each pass's forward pass shows 8
    examples in dim 0: now the meter stops with the size to pass."""
    from gns_callback import GradientNoiseScaleMeter

    x, y = digits
    exact = exact_gns(mlp(), F.cross_entropy, x, y)[0]
    net, g = mlp(), torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught, GradientNoiseScaleMeter(net, method="micro_batch") as meter:
        warnings.simplefilter("always")
        for _ in range(150):
            for _ in range(4):
                rows = torch.randint(0, len(x), (8,), generator=g)
                (F.cross_entropy(net(x[rows]), y[rows]) / 4).backward()
            meter.step(micro_batch_size=given)
            net.zero_grad()
    estimate = meter.run_estimate
    assert len(caught) == (0 if measured else 1)
    if measured:
        assert estimate.ci_low <= exact <= estimate.ci_high
    else:
        assert not estimate.measured and "meter.step(micro_batch_size=8)" in estimate.failure

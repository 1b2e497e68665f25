"""Weight-normalised layers (``W = g·v/‖v‖``): per-example norms of ``g`` and ``v`` against ``torch.func``, in both
of torch's forms (``parametrizations.weight_norm`` and the older hook-based ``weight_norm``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from gns_callback.per_example import PerExampleNormTracker
from gns_callback.per_example.weight_norm import weight_normed, weight_normed_summed_grads


def normed(layer: nn.Module, dim: int | None, form: str) -> nn.Module:
    """``layer`` weight-normalised, its magnitudes ``g`` moved off ``‖v‖`` (where they start: there ``W = v``, and
    the norms of ``g`` and ``v`` would add up to ``W``'s whatever the scale ``g/‖v‖`` does in the formula)."""
    if form == "parametrized":
        layer = parametrizations.weight_norm(layer, dim=dim)
    else:
        with warnings.catch_warnings():  # the hook-based form is deprecated, still used (e.g. by older audio models)
            warnings.simplefilter("ignore")
            layer = torch.nn.utils.weight_norm(layer, dim=dim)
    with torch.no_grad():
        g = layer.get_parameter(weight_normed(layer).g_name)
        g.mul_(torch.rand_like(g) * 3 + 0.2)
    return layer


LAYERS = {  # name → (layer, input shape, weight_norm's dim)
    "Linear": (lambda: nn.Linear(6, 4), (5, 6), 0),
    "Linear, norm over the whole weight": (lambda: nn.Linear(6, 4), (5, 6), None),
    "Linear, norm per input column": (lambda: nn.Linear(6, 4), (5, 6), 1),
    "Linear on sequences": (lambda: nn.Linear(6, 4), (5, 3, 6), 0),
    "Linear on sequences, norm per input column": (lambda: nn.Linear(6, 4), (5, 3, 6), 1),
    "Linear on 2-D sequences, norm over the whole weight": (lambda: nn.Linear(6, 4), (5, 3, 2, 6), None),
    "Conv1d, grouped, norm per kernel position (wav2vec 2.0's positional convolution)":
        (lambda: nn.Conv1d(4, 6, 3, padding=1, groups=2), (5, 4, 7), 2),
    "Conv2d, stride 2, no bias": (lambda: nn.Conv2d(3, 4, 3, stride=2, bias=False), (5, 3, 7, 7), 0),
    "Conv3d": (lambda: nn.Conv3d(2, 3, 2), (5, 2, 4, 3, 4), 0),
    "ConvTranspose1d, grouped, upsampling (HiFi-GAN's)":
        (lambda: nn.ConvTranspose1d(4, 6, 4, stride=2, padding=1, groups=2), (5, 4, 7), 0),
    "ConvTranspose2d, output padding, norm per output channel":
        (lambda: nn.ConvTranspose2d(3, 4, 3, stride=2, output_padding=1), (5, 3, 4, 4), 1),
}


@pytest.mark.parametrize("form", ["parametrized", "hook"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_matches_per_example_gradients_of_g_and_v(name: str, form: str, tracked_whole) -> None:
    build, shape, dim = LAYERS[name]
    model = nn.Sequential(normed(build().double(), dim, form), nn.Tanh())
    tracked_whole(model, torch.randn(shape, dtype=torch.float64), 1e-6)


@pytest.mark.parametrize("form", ["parametrized", "hook"])
def test_a_frozen_magnitude_leaves_the_direction_s_norms(form: str, reference_sq_norms) -> None:
    layer = normed(nn.Linear(6, 4).double(), 0, form)
    layer.get_parameter(weight_normed(layer).g_name).requires_grad_(False)
    inputs = torch.randn(5, 6, dtype=torch.float64)
    weights = torch.randn(5, 4, dtype=torch.float64)
    with PerExampleNormTracker(layer) as tracker:
        (layer(inputs) * weights).sum().backward()
        got = tracker.pop()
    torch.testing.assert_close(got.double(), reference_sq_norms(layer, inputs, weights), rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", list(LAYERS))
def test_the_summed_gradient_is_autograd_s(name: str) -> None:
    """What the first step's sum check and a subset's unmeasured gradient rest on: the examples' summed gradient
    of ``g``, ``v`` and the bias equals the one autograd accumulates."""
    build, shape, dim = LAYERS[name]
    layer = normed(build().double(), dim, "parametrized")
    inputs = torch.randn(shape, dtype=torch.float64)
    output = layer(inputs)
    weights = torch.randn_like(output)
    (output * weights).sum().backward()
    names = {name for name, param in layer.named_parameters()}
    base = type(layer).__bases__[0]
    with torch.no_grad():  # as the tracker and the sum check call it: the parametrized weight then needs no grad
        summed = weight_normed_summed_grads(_summed_of(base), layer, inputs, weights, param_names=names)
    assert set(summed) == names
    for param_name, param in layer.named_parameters():
        torch.testing.assert_close(summed[param_name], param.grad, rtol=1e-9, atol=1e-12)


def test_the_first_batch_check_runs_on_weight_normalised_layers(digits) -> None:
    """The check's sum compares each layer's summed gradient under no_grad; there the parametrized weight was read as
    not trainable, the hook failed (KeyError: 'weight') and the check said only "not checked"."""
    from gns_callback.per_example.checks import check_per_example
    from tests.trust.models import WeightNormed

    model, (x, y) = WeightNormed(), digits
    run = lambda: torch.nn.functional.cross_entropy(model(x[:32]), y[:32]).backward()  # noqa: E731
    assert check_per_example(model, run, 32, reset=lambda: None).status == "independent"


def _summed_of(base: type):
    from gns_callback.per_example.tracker import SUMMED_GRADIENTS

    return SUMMED_GRADIENTS[base]


@pytest.mark.parametrize("parametrize", [parametrizations.spectral_norm, parametrizations.orthogonal])
def test_other_parametrizations_stay_left_out_and_untouched(parametrize) -> None:
    """A spectral norm updates its power-iteration vectors at each training forward: the tracker never reads the
    weight, so they move exactly as without it; its originals stay left out, the bias is still read."""
    def run(track: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(parametrize(nn.Linear(5, 5)), nn.Tanh(), nn.Linear(5, 2))
        inputs = torch.randn(8, 5)
        tracker = PerExampleNormTracker(model).attach() if track else None
        for _ in range(3):
            model(inputs).square().sum().backward()
        if tracker is not None:
            uncovered = [name for name, _ in tracker.uncovered_parameters()]
            assert uncovered and all(".parametrizations.weight." in name for name in uncovered)
            tracker.detach()
        return {**{k: v.detach().clone() for k, v in model.state_dict().items()},
                **{f"{k}.grad": v.grad.clone() for k, v in model.named_parameters()}}

    without, with_tracker = run(False), run(True)
    assert with_tracker.keys() == without.keys()
    for key, value in without.items():
        assert torch.equal(with_tracker[key], value), key
    assert weight_normed(parametrize(nn.Linear(3, 3))) is None

"""A convolutional autoencoder (``nn.ConvTranspose2d`` in its decoder) in a real fit. Before, per-example norms
left the transposed convolutions out; with one micro-batch per step the estimate was of the encoder alone and no
batch was recommended (``partial_coverage``). They are now measured as the convolution whose input gradient they
are (:mod:`gns_callback.per_example.conv_transpose`)."""

import copy

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import assert_matches_exact, with_replacement_loader
from tests.trust.setups import with_and_without


def autoencoder(seed: int = 0) -> nn.Module:
    """Digits 8×8 → 8 channels at 4×4 → back to 8×8."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 8, 3, stride=2, padding=1), nn.Tanh(),
                         nn.ConvTranspose2d(8, 8, 3, stride=2, padding=1, output_padding=1), nn.Tanh(),
                         nn.ConvTranspose2d(8, 1, 3, padding=1), nn.Flatten())


def reconstruction(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def trained_autoencoder(pixels: torch.Tensor) -> nn.Module:
    """:func:`autoencoder` after 100 Adam steps at batch 32: partway through training, where B_simple ≈ 21 on
    digits (at initialisation the reconstructions all share one error and B_simple ≈ 0.1)."""
    net = autoencoder()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    draws = torch.Generator().manual_seed(0)
    for _ in range(100):
        index = torch.randint(0, len(pixels), (32,), generator=draws)
        optimizer.zero_grad()
        reconstruction(net(pixels[index]), pixels[index]).backward()
        optimizer.step()
    return net


class Reconstructs(pl.LightningModule):
    """Mean squared reconstruction error; lr 0 holds the parameters (the exact value is of them)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return reconstruction(self.net(x), x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_one_micro_batch_per_step_measures_the_whole_autoencoder(digits, exact_gns, tmp_path):
    x, y = digits
    net = trained_autoencoder(x)
    callback = GradientNoiseScaleCallback(report_path=str(tmp_path / "report.json"), verbose=False)
    with_and_without(lambda: Reconstructs(copy.deepcopy(net)), lambda: with_replacement_loader(x, y, 32, 32 * 150),
                     callback)
    assert callback.run_estimate.method == "per_example" and callback.meter.coverage["fraction"] == 1.0
    assert_matches_exact(callback.run_estimate, exact_gns(net, reconstruction, x, x)[0])
    assert callback.recommendation.status != "partial_coverage"

"""Subclasses of ``torch.nn`` layers that change only how the layer is built run as that layer and are measured as
it, against ``torch.func``; a subclass that defines anything a forward may reach is not read as its base."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gns_callback.per_example import PerExampleNormTracker
from gns_callback.per_example.subclass import runs_as


class OneGroup(nn.GroupNorm):  # transformers' PoolFormerGroupNorm
    def __init__(self, channels: int) -> None:
        super().__init__(1, channels)


class Initialised(nn.Linear):
    scale = 0.5  # class-level data

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.scale)
        nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return "initialised"


class Doubled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


class PaddedConv(nn.Conv2d):
    def _conv_forward(self, x, weight, bias):
        return super()._conv_forward(nn.functional.pad(x, (1, 1, 1, 1)), weight, bias)


class WeightProperty(nn.Linear):
    @property
    def scaled(self) -> torch.Tensor:
        return self.weight * 2


class SubOfSub(OneGroup):
    pass


@pytest.mark.parametrize("cls, expected", [
    (OneGroup, nn.GroupNorm), (Initialised, nn.Linear), (SubOfSub, nn.GroupNorm), (nn.Linear, nn.Linear),
    (Doubled, Doubled), (PaddedConv, PaddedConv), (WeightProperty, WeightProperty), (nn.Module, nn.Module),
])
def test_runs_as_its_torch_base_only_where_it_changes_how_it_is_built(cls, expected):
    assert runs_as(cls) is expected


class BuiltOnly(nn.Module):
    """Build-only subclasses of a Linear, a convolution, a GroupNorm, a LayerNorm, an embedding and an LSTM."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = type("Table", (nn.Embedding,), {})(17, 6)
        self.rnn = type("Lstm", (nn.LSTM,), {})(6, 6, batch_first=True)
        self.conv = type("Conv", (nn.Conv1d,), {})(6, 4, 3)
        self.norm, self.layer_norm = OneGroup(4), type("Norm", (nn.LayerNorm,), {})(4)
        self.head = Initialised(4, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.rnn(self.embed(tokens))[0].transpose(1, 2))
        return self.head(self.layer_norm(self.norm(h).transpose(1, 2)).mean(1))


def test_build_only_subclasses_are_measured_whole_as_their_base(tracked_whole):
    tracked_whole(BuiltOnly(), torch.randint(0, 17, (5, 7)), rtol=1e-4)


def test_a_subclass_with_its_own_forward_is_not_read_as_its_base():
    model = nn.Sequential(Doubled(4, 3))
    tracker = PerExampleNormTracker(model)
    assert "0.weight" in dict(tracker.uncovered_parameters()) or tracker.bare_parameter_fraction() > 0

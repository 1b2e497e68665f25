"""A batch of one tensor per example (``collate_fn=lambda b: tuple(zip(*b))``, sequences padded inside the model), in a
real fit at the defaults. Before, 32 token sequences cut to 16 tokens read as 16 examples, every layer's input
``(32, 16, ...)`` was measured along dim 1 as if sequence-first, and B_simple read 19.2 (95% CI 18.1–20.4) against an
exact 44.8 with a batch recommended from it; sequences of varying lengths stopped the measurement ("neither dim 0
nor dim 1 holds the batch of 27 examples")."""

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, RandomSampler

from gns_callback import GradientNoiseScaleCallback
from gns_callback.exact import exact_noise_scale
from tests.helpers import quiet_trainer


class Tagger(nn.Module):
    """Token tags: an embedding, a Linear and a Linear head on every token of a list of sequences, padded here."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.hidden, self.head = nn.Embedding(64 * 17, 16), nn.Linear(16, 16), nn.Linear(16, 10)

    def forward(self, tokens) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(pad_sequence(list(tokens), batch_first=True)))))


def tag_loss(net: nn.Module, tokens, tags) -> torch.Tensor:
    """Each sequence's mean over its tokens, then the mean over the sequences: one term per example."""
    labels = pad_sequence(list(tags), batch_first=True, padding_value=-100)
    per_token = F.cross_entropy(net(tokens).transpose(1, 2), labels, reduction="none")
    mask = (labels != -100).to(per_token.dtype)
    return ((per_token * mask).sum(1) / mask.sum(1)).mean()


class Tagging(pl.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        return tag_loss(self.net, *batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def sequences(digits, length: int):
    """Each digit's pixels of value ≥ 4 as tokens (position·17 + value), cut to ``length``; each token's tag is the
    digit's class shifted by the pixel's value."""
    x, y = digits
    pairs = []
    for row, label in zip(x[:600], y[:600]):
        values = (row * 16).round().long()
        where = torch.nonzero(values >= 4).squeeze(1)[:length]
        pairs.append((where * 17 + values[where], (label + values[where]) % 10))
    return pairs


def exact(net: nn.Module, pairs) -> float:
    rows = []
    for tokens, tags in pairs:
        net.zero_grad(set_to_none=True)
        tag_loss(net, [tokens], [tags]).backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in net.parameters()]))
    net.zero_grad(set_to_none=True)
    return exact_noise_scale(torch.stack(rows).double())[0]


@pytest.mark.parametrize("length", [16, 30])  # every sequence cut to 16 tokens; lengths of 11-30
def test_a_batch_of_one_tensor_per_example_is_measured_over_its_examples(digits, length, tmp_path):
    pairs = sequences(digits, length)
    torch.manual_seed(0)
    net = Tagger()
    value = exact(net, pairs)
    sampler = RandomSampler(range(len(pairs)), replacement=True, num_samples=32 * 150,
                            generator=torch.Generator().manual_seed(0))
    loader = DataLoader(pairs, batch_size=32, sampler=sampler, collate_fn=lambda items: tuple(zip(*items)))
    callback = GradientNoiseScaleCallback(verbose=False, report_path=str(tmp_path / "report.json"))
    quiet_trainer(callbacks=[callback]).fit(Tagging(net), loader)  # at 16 tokens, no batch size: it can't be told
    run = callback.run_estimate
    assert run.measured and run.method == "per_example", run.failure
    assert run.ci_low <= value <= run.ci_high, (run, value)
    assert run.ci_high / run.ci_low < 1.5


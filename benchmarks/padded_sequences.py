"""Sequence models trained on padded batches, as people write them in plain PyTorch and Lightning, against exact values.

    python benchmarks/padded_sequences.py [--seeds 5] [--steps 400] [--only NAME] [--lengths by-class,apart]

scikit-learn's digits read as sequences: each image's 8 rows as 8 tokens (a row of 8 pixels each), or its 4×4
average-pooled pixels quantised to 8 levels as 16 token ids (0 the padding id). Each example keeps its first
``L_i`` positions, the rest zero (padding at the end); ``L_i`` drawn apart from the content, or set by the class.
Two losses: per-token cross entropy over the positions kept, written with the constant divisor the first batch's
check asks for, ``cross_entropy(..., ignore_index=-100, reduction="sum") / (batch_size * c)`` with ``c`` the mean
count of kept targets over the training set; and sequence classification from a mean over the positions kept
(each example divides by its own length), ``cross_entropy`` mean over the batch.

Models (every parameter fixed, lr 0; dropout 0): ``nn.TransformerEncoderLayer`` with ``src_key_padding_mask`` and a
learned position table on ``arange(T)`` (batch first and sequence first); ``nn.MultiheadAttention`` with
``key_padding_mask`` and a causal ``attn_mask``; causal attention written by hand with ``masked_fill(-inf)`` on
padded keys; ``nn.LSTM``/``nn.GRU`` over padded tensors and over ``pack_padded_sequence``; a sequence-first batch,
``(T, B, ...)`` as ``pad_sequence`` returns it by default, into a sequence-first ``nn.LSTM``; ``nn.Embedding`` with
``padding_idx=0``.

Exact: ``B_simple`` of each example's gradient (its token sum, or its classification loss) over the whole data set,
float64, one backward pass per example (:func:`gns_callback.exact.exact_noise_scale`). Readings, batches of 32 drawn
with replacement: the plain-loop meter (``method="per_example"``) after ``meter.check_batch(loss_of, batch)`` on the
first batch; the Lightning callback at its defaults (``method="auto"``) with 1 and 2 micro-batches per step (16
examples each at 2, the loss divided by ``accumulate_grad_batches`` as Lightning does). "held": intervals holding
the exact value.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gns_callback import GradientNoiseScaleMeter  # noqa: E402
from gns_callback.exact import exact_noise_scale  # noqa: E402
from gns_callback.per_example.tracker import MISREAD_BATCH_SIZE  # noqa: E402

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
D = 32


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits
    data = load_digits()
    return torch.tensor(data.data, dtype=torch.float32) / 16, torch.tensor(data.target)


def lengths_of(y: torch.Tensor, positions: int, how: str) -> torch.Tensor:
    """Positions kept per example, 1..positions: drawn apart from the examples, or set by the class."""
    if how == "apart":
        return torch.randint(1, positions + 1, y.shape, generator=torch.Generator().manual_seed(7))
    return 1 + (y * (positions - 1)) // 9


def row_data(x: torch.Tensor, y: torch.Tensor, how: str) -> Batch:
    """(rows (N, 8, 8) zeroed past L_i, L_i, per-position targets (N, 8) with -100 past L_i)."""
    lengths = lengths_of(y, 8, how)
    kept = torch.arange(8)[None, :] < lengths[:, None]
    rows = x.reshape(-1, 8, 8) * kept[..., None]
    return rows, lengths, torch.where(kept, y[:, None], -100)


def token_data(x: torch.Tensor, y: torch.Tensor, how: str) -> Batch:
    """(token ids (N, 16): 4×4 pooled pixels quantised to 1..8, 0 past L_i; L_i; per-position targets)."""
    pooled = F.avg_pool2d(x.reshape(-1, 1, 8, 8), 2).reshape(-1, 16)
    tokens = 1 + (pooled * 7.999).long().clamp(0, 7)
    lengths = lengths_of(y, 16, how)
    kept = torch.arange(16)[None, :] < lengths[:, None]
    return tokens * kept, lengths, torch.where(kept, y[:, None], -100)


def padding(lengths: torch.Tensor, positions: int) -> torch.Tensor:
    """True at padded positions (B, T)."""
    return torch.arange(positions, device=lengths.device)[None, :] >= lengths[:, None]


def pooled_mean(h: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each example's mean over its own kept positions (B, T, D) -> (B, D)."""
    kept = (~padding(lengths, h.shape[1])).to(h.dtype)[..., None]
    return (h * kept).sum(1) / lengths.to(h.dtype)[:, None]


class Encoder(nn.Module):
    """Rows -> Linear + position table -> nn.TransformerEncoderLayer(src_key_padding_mask) -> per-token head."""

    def __init__(self, batch_first: bool = True, pool: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.batch_first, self.pool = batch_first, pool
        self.embed, self.position = nn.Linear(8, D), nn.Embedding(8, D)
        self.layer = nn.TransformerEncoderLayer(D, 4, 64, dropout=0.0, batch_first=batch_first)
        self.head = nn.Linear(D, 10)

    def forward(self, rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = self.embed(rows) + self.position(torch.arange(rows.shape[1], device=rows.device))
        mask = padding(lengths, rows.shape[1])
        if self.batch_first:
            h = self.layer(h, src_key_padding_mask=mask)
        else:
            h = self.layer(h.transpose(0, 1), src_key_padding_mask=mask).transpose(0, 1)
        return self.head(pooled_mean(h, lengths) if self.pool else h)


class CausalMha(nn.Module):
    """Rows -> Linear -> nn.MultiheadAttention(key_padding_mask, causal attn_mask) -> per-token head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Linear(8, D), nn.Linear(D, 10)
        self.attention = nn.MultiheadAttention(D, 4, batch_first=True)

    def forward(self, rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h, t = torch.tanh(self.embed(rows)), rows.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=rows.device).triu(1)
        a = self.attention(h, h, h, key_padding_mask=padding(lengths, t), attn_mask=causal, need_weights=False)[0]
        return self.head(h + a)


class HandCausal(nn.Module):
    """Causal single-head attention written by hand, ``masked_fill(-inf)`` on future and padded keys."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.qkv, self.head = nn.Linear(8, D), nn.Linear(D, 3 * D), nn.Linear(D, 10)

    def forward(self, rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h, t = torch.tanh(self.embed(rows)), rows.shape[1]
        q, k, v = self.qkv(h).chunk(3, -1)
        scores = q @ k.transpose(1, 2) / math.sqrt(D)
        future = torch.ones(t, t, dtype=torch.bool, device=rows.device).triu(1)
        scores = scores.masked_fill(future[None] | padding(lengths, t)[:, None, :], float("-inf"))
        return self.head(h + scores.softmax(-1) @ v)


class Recurrent(nn.Module):
    """Rows -> nn.LSTM/GRU (batch first), over the padded tensor or a PackedSequence -> per-token head."""

    def __init__(self, cell: type = nn.LSTM, packed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn, self.head, self.packed = cell(8, D, batch_first=True), nn.Linear(D, 10), packed

    def forward(self, rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return self.head(self.rnn(rows)[0])
        packed = pack_padded_sequence(rows, lengths.cpu(), batch_first=True, enforce_sorted=False)
        h = pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=rows.shape[1])[0]
        return self.head(h)


class TokenEncoder(nn.Module):
    """Token ids -> nn.Embedding(padding_idx=0) + position table -> TransformerEncoderLayer -> per-token head, or a
    mean over the kept positions -> head."""

    def __init__(self, pool: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pool = pool
        self.embed, self.position = nn.Embedding(9, D, padding_idx=0), nn.Embedding(16, D)
        self.layer = nn.TransformerEncoderLayer(D, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(D, 10)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        h = self.layer(h, src_key_padding_mask=padding(lengths, tokens.shape[1]))
        return self.head(pooled_mean(h, lengths) if self.pool else h)


class TokenBag(nn.Module):
    """Token ids -> nn.Embedding(padding_idx=0) -> mean over the kept positions -> tanh MLP head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(9, D, padding_idx=0)
        self.head = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 10))

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.head(pooled_mean(self.embed(tokens), lengths))


class SequenceFirstLstm(nn.Module):
    """A sequence-first batch, ``(T, B, 8)`` rows as ``pad_sequence`` returns them by default, into ``nn.LSTM``
    (``batch_first=False``, its default) -> per-token head ``(T, B, 10)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn, self.head = nn.LSTM(8, D), nn.Linear(D, 10)

    def forward(self, rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(rows)[0])


def batch_first(batch: Batch) -> Batch:
    return batch


def sequence_first(batch: Batch) -> Batch:
    """The batch as ``pad_sequence`` lays it out by default: rows ``(T, B, 8)``, lengths ``(B,)``, targets
    ``(T, B)``."""
    x, lengths, targets = batch
    return x.transpose(0, 1).contiguous(), lengths, targets.T.contiguous()


def token_loss(c: float) -> Callable[[nn.Module, Batch], torch.Tensor]:
    """Per-token cross entropy with the constant divisor: ``sum / (batch_size * c)``."""
    def loss(net: nn.Module, batch: Batch) -> torch.Tensor:
        x, lengths, targets = batch
        logits = net(x, lengths)
        return F.cross_entropy(logits.reshape(-1, 10), targets.reshape(-1), ignore_index=-100,
                               reduction="sum") / (lengths.shape[0] * c)
    return loss


def class_loss(net: nn.Module, batch: Batch) -> torch.Tensor:
    """Sequence classification: the class is the per-position target at position 0."""
    x, lengths, targets = batch
    return F.cross_entropy(net(x, lengths), targets[:, 0])


#: name -> (model, data, per-token loss?, the batch's layout)
SETUPS: dict[str, tuple] = {
    "TransformerEncoderLayer, batch first, per token": (lambda: Encoder(True), row_data, True),
    "TransformerEncoderLayer, sequence first, per token": (lambda: Encoder(False), row_data, True),
    "TransformerEncoderLayer, mean pooled, class": (lambda: Encoder(True, pool=True), row_data, False),
    "MultiheadAttention, key padding + causal mask": (CausalMha, row_data, True),
    "hand-written causal attention, masked_fill(-inf)": (HandCausal, row_data, True),
    "LSTM, padded tensor": (lambda: Recurrent(nn.LSTM), row_data, True),
    "GRU, padded tensor": (lambda: Recurrent(nn.GRU), row_data, True),
    "LSTM, pack_padded_sequence": (lambda: Recurrent(nn.LSTM, packed=True), row_data, True),
    "LSTM (batch_first=False), sequence-first batch": (SequenceFirstLstm, row_data, True, sequence_first),
    "Embedding(padding_idx=0) + positions, encoder, per token": (TokenEncoder, token_data, True),
    "Embedding(padding_idx=0) + positions, encoder, mean pooled": (lambda: TokenEncoder(pool=True), token_data, False),
    "Embedding(padding_idx=0), mean pooled MLP": (TokenBag, token_data, False),
}


def exact_value(make: Callable[[], nn.Module], data: Batch, loss: Callable, layout: Callable = batch_first) -> float:
    """``B_simple`` of each example's gradient over the data set, float64, one backward pass per example."""
    net = make().double()
    x, lengths, targets = data
    x = x.double() if x.is_floating_point() else x
    params = [p for p in net.parameters() if p.requires_grad]
    rows = []
    for i in range(len(x)):
        grads = torch.autograd.grad(loss(net, layout((x[i:i + 1], lengths[i:i + 1], targets[i:i + 1]))), params,
                                    allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)]))
    return exact_noise_scale(torch.stack(rows))[0]


def plain_reading(make: Callable[[], nn.Module], data: Batch, loss: Callable, seed: int, steps: int,
                  layout: Callable = batch_first, batch: int = 32) -> tuple[Any, str]:
    """(the run estimate, the first batch's check) of the plain-loop meter, ``check_batch`` on the first batch."""
    net, generator = make(), torch.Generator().manual_seed(seed)
    with GradientNoiseScaleMeter(net) as meter:
        for step in range(steps):
            i = torch.randint(0, len(data[0]), (batch,), generator=generator)
            b = layout(tuple(t[i] for t in data))
            if step == 0:
                check = meter.check_batch(lambda bb: loss(net, bb), b)
            meter.expect_batch_size(batch)
            loss(net, b).backward()
            meter.step()
            net.zero_grad()
    return meter.run_estimate, check.status


def lightning_reading(make: Callable[[], nn.Module], data: Batch, loss: Callable, seed: int, steps: int,
                      accumulate: int, layout: Callable = batch_first, batch: int = 32,
                      method: str = "auto") -> tuple[Any, str]:
    """(the run estimate, the first batch's check) of the Lightning callback at its defaults."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, RandomSampler, TensorDataset
    from gns_callback import GradientNoiseScaleCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make()

        def training_step(self, b, batch_idx):
            return loss(self.net, tuple(b))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    micro = batch // accumulate
    sampler = RandomSampler(range(len(data[0])), replacement=True, num_samples=steps * batch,
                            generator=torch.Generator().manual_seed(seed))
    loader = DataLoader(TensorDataset(*data), batch_size=micro, sampler=sampler,
                        collate_fn=lambda items: layout(tuple(torch.stack(field) for field in zip(*items))))
    callback = GradientNoiseScaleCallback(method=method, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=accumulate,
                         callbacks=[callback])
    trainer.fit(Module(), loader)
    check = callback.meter.per_example_check if callback.meter is not None else None
    method = callback.meter.method if callback.meter is not None else "?"
    status = f"{check.status if check is not None else 'none'} ({method})"
    return callback.run_estimate, status


def _short(failure: str) -> str:
    """The reason a reading stopped, shortened for the table."""
    if MISREAD_BATCH_SIZE in failure:
        return "the batch's size misread"
    return failure.split("): ")[-1].split("; ")[0][:80]


def summary(readings: list, exact: float) -> tuple[str, str]:
    shown = "; ".join("not measured" if not math.isfinite(r.b_simple)
                      else f"{r.b_simple:.1f} [{r.ci_low:.1f}, {r.ci_high:.1f}]" for r in readings)
    measured = sum(math.isfinite(r.b_simple) for r in readings)
    held = sum(math.isfinite(r.b_simple) and r.ci_low <= exact <= r.ci_high for r in readings)
    failures = sorted({_short(r.failure) for r in readings if getattr(r, "failure", None)})
    return shown + (f" (stopped: {' / '.join(failures)})" if failures else ""), f"{held}/{measured}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--only", default="", help="run the setups whose name contains this")
    parser.add_argument("--lengths", default="by-class,apart")
    parser.add_argument("--drivers", default="plain,lightning-1,lightning-2",
                        help="plain, lightning-<micro-batches per step>[-<method>] (default method auto)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    x, y = digits()
    print("| model / setup | lengths | exact | driver | run average [95% CI] per seed | held k/n | the check |")
    print("|---|---|---|---|---|---|---|")
    for name, (make, data_of, per_token, *rest) in SETUPS.items():
        layout = rest[0] if rest else batch_first
        if args.only not in name:
            continue
        for how in args.lengths.split(","):
            data = data_of(x, y, how)
            c = float(data[1].double().mean())
            loss = token_loss(c) if per_token else class_loss
            exact = exact_value(make, data, loss, layout)
            for driver in args.drivers.split(","):
                runs = [plain_reading(make, data, loss, s, args.steps, layout) if driver == "plain"
                        else lightning_reading(make, data, loss, s, args.steps, int(driver.split("-")[1]), layout,
                                               method=driver.split("-")[2] if driver.count("-") == 2 else "auto")
                        for s in range(args.seeds)]
                shown, held = summary([r for r, _ in runs], exact)
                checks = ", ".join(sorted({status for _, status in runs}))
                print(f"| {name} | {how} | {exact:.2f} | {driver} | {shown} | {held} | {checks} |", flush=True)


if __name__ == "__main__":
    main()

"""Cost of per-example norms on recurrent layers, which are recomputed step by step
(:mod:`gns_callback.per_example.recurrent`): a token model, embedding (vocabulary 512, width 128) → a 2-layer LSTM
or GRU of width 256 → an LM head of 512, batch 32, 64 positions. Plain loop, one thread, baseline and
:class:`~gns_callback.per_example.PerExampleNormTracker` on copies of one model, alternating step by step; CPU time
(``time.thread_time``) of zero_grad + forward + backward (+ pop), as ``attention_cost.py``.

    python benchmarks/recurrent_cost.py [--steps 30] [--kind LSTM]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.attention_cost import compare  # noqa: E402

BATCH, LENGTH, WIDTH, HIDDEN, VOCAB = 32, 64, 128, 256, 512


class TokenRnn(nn.Module):
    def __init__(self, kind: type) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(VOCAB, WIDTH), nn.Linear(HIDDEN, VOCAB)
        self.rnn = kind(WIDTH, HIDDEN, num_layers=2, batch_first=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(tokens))[0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each (after 10 warm-up)")
    parser.add_argument("--kind", choices=["LSTM", "GRU", "both"], default="both")
    args = parser.parse_args(argv)
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(0))
    for kind in ([nn.LSTM, nn.GRU] if args.kind == "both" else [getattr(nn, args.kind)]):
        print(f"{kind.__name__}: {compare(lambda: TokenRnn(kind), tokens, tokens.roll(-1, 1), args.steps)}")


if __name__ == "__main__":
    main()

"""Per-example gradients of a bare table looked up at each example's own indices: ``F.embedding(tokens, W)`` or
``W[tokens]`` with ``W`` an ``nn.Parameter`` of the model's own code, not an ``nn.Embedding``.

The lookup's output gradient ``δ`` (the indices' shape plus the row's) holds each example's part: example ``i``'s
gradient of ``W`` is ``δ_{i,t}`` added into row ``x_{i,t}`` for each of its positions ``t``, as for an
``nn.Embedding`` (:func:`~.embedding.lookup_sq_norms`: ``|∇W_i|² = Σ_rows |Σ_{t: x_{i,t}=row} δ_{i,t}|²``, no
``(B, rows, D)`` tensor). ``F.embedding``'s ``padding_idx`` row receives nothing; a negative index of ``W[tokens]``
counts from the end. Read only where the indices hold the batch (:mod:`.broadcast` reads a table looked up on
positions shared by the examples, Swin's and nanoGPT's, at the broadcast after it). Torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .embedding import lookup_sq_norms
from .matmul import Factors
from .param_path import lookup_indices
from .tied import logits_at_tokens

__all__ = ["LookupGrads", "TiedGrads", "lookup_example_grads"]

#: ``F.embedding``'s ``padding_idx`` when it has none, as autograd saves it (-1 as an unsigned 64-bit value).
_NO_PADDING = (-1, 2**64 - 1)


@dataclass(frozen=True)
class LookupGrads:
    """A looked-up table's per-example gradients, unmaterialised: ``tokens`` (B, N) rows in ``0..rows-1`` and their
    gradients ``grads`` (B, N, row numel), float32. The reads of :class:`~.broadcast.Rows`."""

    tokens: Tensor
    grads: Tensor
    rows: int

    @property
    def examples(self) -> int:
        return self.tokens.shape[0]

    def joined(self, other: LookupGrads) -> LookupGrads:
        """Both lookups' gradients: each example's positions of both."""
        return LookupGrads(torch.cat([self.tokens, other.tokens], 1), torch.cat([self.grads, other.grads], 1),
                           self.rows)

    def first(self, count: int) -> LookupGrads:
        return LookupGrads(self.tokens[:count], self.grads[:count], self.rows)

    def sq_norms(self) -> Tensor:
        """``|g_i|²`` (B,)."""
        return lookup_sq_norms(self.tokens, self.grads)

    def rows(self) -> Tensor:
        """The gradients materialised (B, rows·row numel): for tests and small tables."""
        batch_size, width = self.examples, self.grads.shape[-1]
        offsets = torch.arange(batch_size, device=self.tokens.device).unsqueeze(1) * self.rows
        table = self.grads.new_zeros(batch_size * self.rows, width)
        table.index_add_(0, (self.tokens + offsets).reshape(-1), self.grads.reshape(-1, width))
        return table.reshape(batch_size, -1)

    def summed(self) -> Tensor:
        """``Σ_i g_i`` (numel,): the gradient these examples contribute."""
        width = self.grads.shape[-1]
        table = self.grads.new_zeros(self.rows, width)
        return table.index_add_(0, self.tokens.reshape(-1), self.grads.reshape(-1, width)).reshape(-1)


@dataclass(frozen=True)
class TiedGrads:
    """A table both looked up (``lookup``) and applied as a matrix product's weight (``product``: a head tied to
    subclassed token tables, BART's ``lm_head`` and ``shared``). Example ``i``'s gradient is ``E_i + H_i``, and
    ``|E_i + H_i|² = |E_i|² + |H_i|² + 2⟨E_i, H_i⟩`` with the cross term read at the example's own tokens
    (:mod:`.tied`: ``⟨E_i, H_i⟩ = Σ_t' u_t'·δ_t'``), nothing of the table's size per example."""

    lookup: LookupGrads
    product: Factors

    @property
    def examples(self) -> int:
        return self.lookup.examples

    def first(self, count: int) -> TiedGrads:
        return TiedGrads(self.lookup.first(count), self.product.first(count))

    def sq_norms(self) -> Tensor:
        """``|g_i|²`` (B,)."""
        rows, other = ((self.product.delta, self.product.left) if self.product.transposed
                       else (self.product.left, self.product.delta))  # the table's rows, its columns
        u = logits_at_tokens(self.lookup.tokens, other, rows)
        cross = 2.0 * (self.lookup.grads * u).sum(dim=(1, 2))
        return self.lookup.sq_norms() + self.product.sq_norms() + cross

    def summed(self) -> Tensor:
        return self.lookup.summed() + self.product.summed()

    def rows(self) -> Tensor:
        return self.lookup.rows() + self.product.rows()


def lookup_example_grads(node: Any, grad_output: Tensor, dim: int, rows: int) -> LookupGrads:
    """The per-example gradients of the table (``rows`` rows) that the lookup ``node`` read, from its output
    gradient with the examples along ``dim`` of its indices."""
    tokens = lookup_indices(node).movedim(dim, 0)
    batch_size = tokens.shape[0]
    grads = grad_output.float().movedim(dim, 0).reshape(batch_size, tokens[0].numel(), -1)
    tokens = tokens.reshape(batch_size, -1) % rows
    padding = getattr(node, "_saved_padding_idx", -1)
    if int(padding) not in _NO_PADDING:
        grads = grads.masked_fill((tokens == int(padding) % rows).unsqueeze(-1), 0)
    return LookupGrads(tokens, grads, rows)

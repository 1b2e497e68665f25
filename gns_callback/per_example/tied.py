"""A table tied between an ``nn.Embedding`` and an ``nn.Linear`` (a language model's input and output embeddings).

GPT-2, nanoGPT and many language models use one ``(V, D)`` matrix ``W`` both to look tokens up
(``wte(tokens)``) and to produce the logits (``lm_head(h)``, with ``lm_head.weight = wte.weight``). Example ``i``'s
gradient of ``W`` is then the sum of both uses' contributions, ``E_i + H_i``:

* ``E_i`` (the lookup): row ``x_{t'}`` receives ``δ^emb_{t'}``, the gradient reaching the embedding's output;
* ``H_i = Σ_t δ^out_t h_tᵀ`` (the logits): ``h`` the Linear's input, ``δ^out`` the gradient of its output.

``|E_i + H_i|² = |E_i|² + |H_i|² + 2⟨E_i, H_i⟩``. The two squares are what each layer's own function gives
(:mod:`.embedding`, :mod:`.linear`); the cross term is

    ⟨E_i, H_i⟩ = Σ_{t'} u_{t'}·δ^emb_{t'},   u_{t'} = Σ_t δ^out_t[x_{t'}] · h_t,

the logits' gradient read at the example's own tokens: ``O(T_out·T_emb·D)`` per example, nothing of size ``V·D``
per example. The Linear's backward usually runs first (the head is last in the forward), so it computes ``u`` from
the tokens its embedding saw in the forward, and the embedding finishes the sum; in the other order the
embedding's side waits for the Linear's. The ``padding_idx`` row receives nothing from the lookup, so its positions
add no cross term.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .embedding import embedding_unsupported_reason, without_padding
from .linear import upcast

__all__ = ["cross_term", "logits_at_tokens", "same_table", "tied_pair"]


def tied_pair(modules: list[tuple[nn.Module, str]]) -> Optional[tuple[list[nn.Embedding], nn.Linear]]:
    """``(embeddings, linear)`` when a parameter's owners are one ``nn.Linear`` and one or more ``nn.Embedding``
    (BART's and T5 v1.0's ``shared``, ``encoder.embed_tokens`` and ``decoder.embed_tokens`` with a tied head), each
    holding it as ``weight``, the embeddings with the same options, which per-example norms support; else None. The
    embeddings are one table looked up by several modules (:func:`same_table`)."""
    if len(modules) < 2 or any(name != "weight" for _, name in modules):
        return None
    linears = [m for m, _ in modules if type(m) is nn.Linear]
    rest = [(m, name) for m, name in modules if type(m) is not nn.Linear]
    if len(linears) != 1:
        return None
    embeddings = same_table(rest) if len(rest) > 1 else [m for m, _ in rest if type(m) is nn.Embedding]
    if not embeddings or len(embeddings) != len(rest) or embedding_unsupported_reason(embeddings[0]) is not None:
        return None
    return embeddings, linears[0]


def same_table(modules: list[tuple[nn.Module, str]]) -> Optional[list[nn.Embedding]]:
    """The embeddings, when a parameter's owners are several ``nn.Embedding`` holding it as ``weight`` with the same
    options, all of which per-example norms support (T5's ``shared``, ``encoder.embed_tokens`` and
    ``decoder.embed_tokens``): one table looked up by several modules is one module applied several times, each
    example's gradient the sum over all their positions. Else None."""
    if len(modules) < 2 or any(name != "weight" or type(m) is not nn.Embedding for m, name in modules):
        return None
    embeddings = [m for m, _ in modules]
    options = {(m.padding_idx, m.max_norm, m.norm_type, m.scale_grad_by_freq, m.sparse) for m in embeddings}
    if len(options) != 1 or embedding_unsupported_reason(embeddings[0]) is not None:
        return None
    return embeddings


def logits_at_tokens(tokens: Tensor, linear_input: Tensor, linear_grad_output: Tensor) -> Tensor:
    """``u_{i,t'} = Σ_t δ^out_{i,t}[x_{i,t'}] · h_{i,t}`` (module docstring), shape ``(B, T_emb, D)``.

    ``tokens`` (B, *) the embedding's input; ``linear_input`` (B, *, D) and ``linear_grad_output`` (B, *, V), all
    batch-first. Float32 (float64 kept)."""
    h, grads = upcast(linear_input, linear_grad_output)
    batch = tokens.shape[0]
    tokens = tokens.reshape(batch, 1, -1)
    h = h.reshape(batch, -1, h.shape[-1])
    grads = grads.reshape(batch, -1, grads.shape[-1])
    at_tokens = grads.gather(2, tokens.expand(batch, grads.shape[1], tokens.shape[2]))  # (B, T_out, T_emb)
    return torch.bmm(at_tokens.transpose(1, 2), h)


def cross_term(module: nn.Embedding, tokens: Tensor, embedding_grad_output: Tensor, u: Tensor) -> Tensor:
    """``2⟨E_i, H_i⟩ = 2·Σ_{t'} u_{t'}·δ^emb_{t'}`` per example (B,), padding positions left out."""
    (grads,) = upcast(embedding_grad_output)
    batch = tokens.shape[0]
    tokens = tokens.reshape(batch, -1)
    grads = without_padding(module, tokens, grads.reshape(batch, tokens.shape[1], -1))
    return 2.0 * (grads * u.to(grads.dtype)).sum(dim=(1, 2))

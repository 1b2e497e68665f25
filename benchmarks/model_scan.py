#!/usr/bin/env python
"""The callback at its defaults on model types its tests were not written for, against the exact value.

    python benchmarks/model_scan.py [--seeds 5] [--steps 150] [--only GPT2]

With ``transformers`` installed, tiny Hugging Face models are scanned too. Each model is held at its
initial parameters (SGD with lr 0, so every step samples one distribution) and fitted in
Lightning for ``--steps`` optimizer steps at batch 32, one micro-batch per step, batches of scikit-learn's digits
drawn with replacement (``--seeds`` data orders). Tokens are the 64 pixel intensities (0..16) of each image; the
label is the digit. Exact = ``gns_callback.exact`` over all 1797 examples, for every trainable parameter and for
the ones the callback covers (they differ where it leaves some out; it says so).

Reported per model and seed: the run average and its 95% interval, whether the interval holds the exact value of
the covered parameters, the coverage, and the recommendation's status (``partial_coverage`` where the estimate is
of under 90% of the parameters).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from functools import partial
from typing import Callable

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.sketch_accuracy import digits  # noqa: E402
from gns_callback import GradientNoiseScaleCallback  # noqa: E402
from gns_callback.exact import exact_noise_scale, per_example_gradients  # noqa: E402
from tests.trust.models import FusedWindowAttention, KernelWindowAttention, SwinStyle  # noqa: E402


class LstmNet(nn.Module):
    """Embedding → LSTM → Linear on the last step's output."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(17, 8), nn.LSTM(8, 16, batch_first=True), nn.Linear(16, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(tokens))[0][:, -1])


class GruNet(nn.Module):
    """Embedding → GRU, 2 layers, bidirectional, sequence-first ``(T, B, ·)`` → Linear on the mean over steps."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(17, 8), nn.Linear(32, 10)
        self.rnn = nn.GRU(8, 16, num_layers=2, bidirectional=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(tokens.t()))[0].mean(0))


class EncoderNet(nn.Module):
    """PyTorch's own ``nn.TransformerEncoderLayer`` (its attention projections are applied functionally)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(17, 16)
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(tokens)).mean(1))


class DecoderNet(nn.Module):
    """PyTorch's ``nn.TransformerDecoderLayer`` at its default ``batch_first=False``: self-attention, and
    cross-attention on a memory of every other position (its key is its value, the query differs)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(17, 16)
        self.dec = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0)
        self.head = nn.Linear(16, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens).transpose(0, 1)  # (T, B, D)
        return self.head(self.dec(h, h[::2]).mean(0))


class GptStyle(nn.Module):
    """nanoGPT's two habits: a position table looked up on ``arange(T)`` and the token table tied to the head."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(17, 16), nn.Embedding(64, 16)
        self.up, self.down, self.ln = nn.Linear(16, 512), nn.Linear(512, 16), nn.LayerNorm(16)
        self.head = nn.Linear(16, 17, bias=False)
        self.head.weight = self.wte.weight
        self.classify = nn.Linear(17, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        h = h + self.down(torch.tanh(self.up(h)))
        return self.classify(self.head(self.ln(h)).mean(1))


class PositionTableAttention(nn.Module):
    """``nn.MultiheadAttention`` over tokens plus a position table looked up on ``arange(T)`` that holds 40% of the
    parameters: too much to leave out, so before it was read at its broadcast the run was not measured."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(17, 16), nn.Embedding(64, 16)
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        return self.head(self.mha(h, h, h, need_weights=False)[0].mean(1))


class Conv1dNet(nn.Module):
    """The image as a 64-sample signal: Conv1d + GroupNorm + Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv1d(1, 8, 5, padding=2), nn.GroupNorm(2, 8), nn.Linear(8 * 64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.norm(self.conv(x.unsqueeze(1)))).flatten(1))


class Conv3dNet(nn.Module):
    """The image as a 4×4×4 volume: Conv3d + GroupNorm, a strided Conv3d, and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.norm = nn.Conv3d(1, 8, 3, padding=1), nn.GroupNorm(2, 8)
        self.conv2, self.head = nn.Conv3d(8, 16, 3, stride=2, padding=1), nn.Linear(16 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.norm(self.conv1(x.reshape(-1, 1, 4, 4, 4))))
        return self.head(F.relu(self.conv2(h)).flatten(1))


class CellLoop(nn.Module):
    """The image as 8 rows of 8 through an ``nn.LSTMCell`` or ``nn.GRUCell`` (width 24) applied by a loop of its own,
    the last state into a Linear."""

    def __init__(self, cell: type = nn.LSTMCell) -> None:
        super().__init__()
        self.cell, self.head = cell(8, 24), nn.Linear(24, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, hx = x.reshape(x.shape[0], 8, 8), None
        for t in range(8):
            hx = self.cell(rows[:, t], hx)
        return self.head(hx[0] if isinstance(hx, tuple) else hx)


class ViTStyle(nn.Module):
    """The image in patches by a Conv2d, a class token and a position table as bare parameters (broadcast over the
    batch: :mod:`gns_callback.per_example.broadcast`), pre-LN ``nn.TransformerEncoderLayer`` s, LayerNorm, a head on
    the class token. At its defaults: a digit's 8×8 pixels in 2×2 patches, width 16, one layer."""

    def __init__(self, dim: int = 16, image: int = 8, patch: int = 2, channels: int = 1, layers: int = 1,
                 classes: int = 10) -> None:
        super().__init__()
        self.shape = (channels, image, image)
        self.patch = nn.Conv2d(channels, dim, patch, stride=patch)
        self.cls = nn.Parameter(0.1 * torch.randn(1, 1, dim))
        self.pos = nn.Parameter(0.1 * torch.randn(1, (image // patch) ** 2 + 1, dim))
        self.blocks = nn.Sequential(*(nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True,
                                                                 norm_first=True) for _ in range(layers)))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch(x.reshape(-1, *self.shape)).flatten(2).transpose(1, 2)
        h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], dim=1) + self.pos
        return self.head(self.norm(self.blocks(h))[:, 0])


class LayerScaleNet(nn.Module):
    """A learned offset on the input, and a residual MLP block whose branch is scaled per channel by a learned
    vector (CaiT's and ConvNeXt's layer scale): bare parameters, multiplied and added in."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.zeros(64))
        self.inp, self.branch, self.head = nn.Linear(64, 32), nn.Linear(32, 32), nn.Linear(32, 10)
        self.gamma = nn.Parameter(torch.full((32,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x - self.offset))
        return self.head(h + self.gamma * torch.tanh(self.branch(h)))


class MinGptStyle(nn.Module):
    """minGPT's habit: a learned position table as a bare parameter longer than the sequence, sliced to its length
    (``x + self.pos_emb[:, :T]``), then a ``nn.TransformerEncoderLayer``, LayerNorm and a head on the mean.
    Digits as 64 pixel tokens, width 16, a table of 80 positions."""

    def __init__(self, dim: int = 16, positions: int = 80) -> None:
        super().__init__()
        self.tok = nn.Embedding(17, dim)
        self.pos_emb = nn.Parameter(0.1 * torch.randn(1, positions, dim))
        self.block = nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos_emb[:, : tokens.shape[1]]
        return self.head(self.norm(self.block(h)).mean(1))


class HandWrittenAttention(nn.Module):
    """Layers written out with bare parameters, as research code does: the image as 8 rows of 8, projected by
    ``x @ W`` + a bias, one head of self-attention whose query, key, value and output maps are ``x @ W``, and a head
    by ``F.linear(h, W, b)`` (:mod:`gns_callback.per_example.matmul`). Width 16."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()

        def weight(fan_in: int, fan_out: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(fan_in, fan_out) / fan_in**0.5)

        self.embed, self.embed_bias = weight(8, dim), nn.Parameter(torch.zeros(dim))
        self.query, self.key, self.value, self.out = (weight(dim, dim) for _ in range(4))
        self.head, self.head_bias = nn.Parameter(weight(dim, 10).T.contiguous()), nn.Parameter(torch.zeros(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x.reshape(x.shape[0], 8, 8) @ self.embed + self.embed_bias)
        scores = (h @ self.query) @ (h @ self.key).transpose(1, 2) / h.shape[-1] ** 0.5
        h = h + (scores.softmax(-1) @ (h @ self.value)) @ self.out
        return F.linear(h.mean(1), self.head, self.head_bias)


class RelativeBiasAttention(nn.Module):
    """Two-head attention over the 64 tokens with a learned relative-position bias added to its logits: T5's (an
    ``nn.Embedding`` of 16 clamped distance buckets, looked up on an (L, L) matrix with no batch dim; Raffel et al.
    2020) or Swin's (a bare table of every distance, indexed by a buffer; Liu et al. 2021). Before, T5's stopped the
    measurement and Swin's was left out (``IndexBackward0``)."""

    def __init__(self, swin: bool = False, length: int = 64, heads: int = 2, width: int = 16) -> None:
        super().__init__()
        self.emb, self.qkv, self.head = nn.Embedding(17, width), nn.Linear(width, 3 * width), nn.Linear(width, 10)
        self.heads = heads
        pos = torch.arange(length)
        distance = pos[None, :] - pos[:, None]
        if swin:
            self.table = nn.Parameter(torch.randn(2 * length - 1, heads) * 0.5)
            self.register_buffer("index", (distance + length - 1).reshape(-1))
        else:
            self.rel = nn.Embedding(16, heads)
            self.register_buffer("buckets", distance.clamp(-7, 8) + 7)

    def bias(self, length: int) -> torch.Tensor:
        """(heads, L, L)."""
        if hasattr(self, "table"):
            return self.table[self.index].view(length, length, -1).permute(2, 0, 1)
        return self.rel(self.buckets).permute(2, 0, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        batch, length = tokens.shape
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(self.emb(tokens)).chunk(3, -1))
        logits = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + self.bias(length)
        out = (logits.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, -1)
        return self.head(out.mean(1))


class VocoderStyle(nn.Module):
    """HiFi-GAN-style convolutions, every weight weight-normalised (``W = g·v/‖v‖``): the 64 pixels as a one-channel
    signal, a dilated ``Conv1d`` stack with leaky ReLUs, a grouped ``Conv1d`` normalised per kernel position
    (``dim=2``, wav2vec 2.0's positional convolution), a ``ConvTranspose1d`` upsampling by 2, a normalised ``Linear``
    head."""

    def __init__(self) -> None:
        super().__init__()
        norm = nn.utils.parametrizations.weight_norm
        self.pre = norm(nn.Conv1d(1, 8, 5, padding=2))
        self.dilated = norm(nn.Conv1d(8, 8, 3, padding=2, dilation=2))
        self.grouped = norm(nn.Conv1d(8, 8, 4, padding=2, groups=4), dim=2)
        self.up = norm(nn.ConvTranspose1d(8, 4, 4, stride=2, padding=1))
        self.head = norm(nn.Linear(4 * 130, 10))
        with torch.no_grad():  # magnitudes off their start at ‖v‖, where W = v and the norms are W's
            for name, param in self.named_parameters():
                if name.endswith("original0"):
                    param.mul_(torch.rand_like(param) * 1.5 + 0.5)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        h = F.leaky_relu(self.pre(pixels.unsqueeze(1)), 0.1)
        h = F.leaky_relu(self.dilated(h), 0.1) + h
        h = F.leaky_relu(self.up(F.leaky_relu(self.grouped(h), 0.1)), 0.1)
        return self.head(h.flatten(1))


class FlattenedRows(nn.Module):
    """Token rows flattened as hand-written mixture-of-experts and older language-model code do: the embeddings
    viewed as ``(B·T, D)``, a Linear, a GELU, a LayerNorm and a second Linear on those rows, viewed back to
    ``(B, T, D)``, mean-pooled into a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(17, 16)
        self.up, self.norm, self.down = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16)
        self.head = nn.Linear(16, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        rows = self.down(self.norm(F.gelu(self.up(h.reshape(-1, 16)))))
        return self.head((h + rows.view(h.shape)).mean(1))


class BareTokenTables(nn.Module):
    """Token tables of the model's own code, not ``nn.Embedding``: ``F.embedding(tokens, W)`` with a padding row,
    and ``V[tokens]`` added to it, mean-pooled through a GELU into a head."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(17, 16) * 0.5)
        self.other = nn.Parameter(torch.randn(17, 16) * 0.5)
        self.head = nn.Linear(16, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = F.embedding(tokens, self.table, padding_idx=0) + self.other[tokens]
        return self.head(F.gelu(h).mean(1))


class HandWrittenLayer(nn.Module):
    """One layer written out, ``tanh(x @ W + b)``, under an ``nn.Linear`` head: the pattern of a layer of one's own
    beside the library's."""

    def __init__(self) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(64, 32) / 8), nn.Parameter(torch.zeros(32))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(x @ self.weight + self.bias))


class HuggingFaceGpt2(nn.Module):
    """``transformers``' ``GPT2LMHeadModel`` (2 layers, width 32, vocabulary 17, dropout off), or with ``bart`` its
    ``BartForConditionalGeneration`` (scaled token tables tied to the head, learned positions; encoder and decoder of
    2 layers), its logits mean-pooled over positions; the first 10 vocabulary entries are the class logits. Only
    where ``transformers`` is installed."""

    def __init__(self, bart: bool = False) -> None:
        super().__init__()
        import transformers

        if bart:
            config = transformers.BartConfig(vocab_size=17, d_model=32, encoder_layers=2, decoder_layers=2,
                                             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                             decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
                                             scale_embedding=True)
            self.gpt = transformers.BartForConditionalGeneration(config)
            return
        config = transformers.GPT2Config(vocab_size=17, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         attn_implementation="eager")
        self.gpt = transformers.GPT2LMHeadModel(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt(input_ids=tokens).logits.mean(1)[:, :10]


def digits_and_tokens() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 1797 digits: pixels in [0, 1], the same pixels as tokens 0..16 (for the models that read tokens), and
    the labels."""
    pixels, labels = digits()
    return pixels, (pixels * 16).round().long(), labels


MODELS: dict[str, tuple[Callable[[], nn.Module], bool]] = {  # name → (model, reads tokens)
    "LSTM": (LstmNet, True), "GRU (2 layers, bidirectional, sequence-first)": (GruNet, True),
    "nn.TransformerEncoderLayer": (EncoderNet, True),
    "nn.TransformerDecoderLayer (sequence-first)": (DecoderNet, True),
    "GPT-style (arange positions, tied head)": (GptStyle, True), "Conv1d + GroupNorm": (Conv1dNet, False),
    "attention with a large position table on arange(T)": (PositionTableAttention, True),
    "Conv3d + GroupNorm (volumes)": (Conv3dNet, False),
    "LSTMCell in a loop": (CellLoop, False), "GRUCell in a loop": (lambda: CellLoop(nn.GRUCell), False),
    "ViT-style (class token, position table)": (ViTStyle, False),
    "layer scale and a learned offset": (LayerScaleNet, False),
    "minGPT-style (position table sliced to the sequence)": (MinGptStyle, True),
    "hand-written attention (x @ W, F.linear)": (HandWrittenAttention, False),
    "hand-written layer (x @ W + b), nn.Linear head": (HandWrittenLayer, False),
    "T5-style relative-position bias (bucket embedding)": (RelativeBiasAttention, True),
    "Swin-style relative-position table (indexed bare parameter)": (lambda: RelativeBiasAttention(swin=True), True),
    "vocoder-style (every weight weight-normalised)": (VocoderStyle, False),
    "rows flattened to (B·T, D) (h.view(-1, D))": (FlattenedRows, True),
    "bare token tables (F.embedding(tokens, W), V[tokens])": (BareTokenTables, True),
    "Swin-style windows as rows (q, k, v layers)": (SwinStyle, False),
    "Swin-style windows as rows (timm's fused qkv, permute(2, 0, 3, 1, 4).unbind(0))": (
        partial(SwinStyle, attention=FusedWindowAttention), False),
    "Swin-style windows as rows (timm's fused qkv, scaled_dot_product_attention's kernel)": (
        partial(SwinStyle, attention=KernelWindowAttention), False),
}


#: ``transformers`` encoders (2 layers, width 32, 4 heads, vocabulary 17, dropout off): their config class, the
#: model class, and the config's arguments.
ENCODERS: dict[str, tuple[str, str, dict]] = {
    "T5EncoderModel (relative-position buckets, RMS norms)": (
        "T5Config", "T5EncoderModel", dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
                                           relative_attention_num_buckets=8)),
    "BertModel": ("BertConfig", "BertModel", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                  intermediate_size=64, hidden_dropout_prob=0.0,
                                                  attention_probs_dropout_prob=0.0, max_position_embeddings=64)),
    "LlamaModel (rotary positions, grouped queries)": (
        "LlamaConfig", "LlamaModel", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)),
    "DistilBertModel": ("DistilBertConfig", "DistilBertModel", dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                                                    dropout=0.0, attention_dropout=0.0,
                                                                    max_position_embeddings=64)),
    "GemmaModel (RMS norms scaled by 1 + weight)": (
        "GemmaConfig", "GemmaModel", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                          max_position_embeddings=64)),
    "MambaModel (dt_proj and conv1d applied outside their forward)": (
        "MambaConfig", "MambaModel", dict(hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4,
                                          use_mambapy=True)),
    "RwkvModel (time mix x·μ + x_prev·(1 − μ))": (
        "RwkvConfig", "RwkvModel", dict(hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                                        intermediate_size=64, context_length=64)),
    "OPTModel (learned positions counted from the mask)": (
        "OPTConfig", "OPTModel", dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                      word_embed_proj_dim=32, max_position_embeddings=64, dropout=0.0)),
    "BartModel (scaled token table, learned positions)": (
        "BartConfig", "BartModel", dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                        max_position_embeddings=64, dropout=0.0, scale_embedding=True)),
}


class HuggingFaceEncoder(nn.Module):
    """A ``transformers`` encoder of :data:`ENCODERS`, its last hidden state mean-pooled into a Linear head. Only
    where ``transformers`` is installed."""

    def __init__(self, name: str) -> None:
        super().__init__()
        import transformers

        config, model, kwargs = self.table()[name]
        self.body = getattr(transformers, model)(getattr(transformers, config)(vocab_size=17, **kwargs))
        self.head = nn.Linear(32, 10)

    @staticmethod
    def table() -> dict[str, tuple[str, str, dict]]:
        return ENCODERS

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(input_ids=tokens).last_hidden_state.mean(1))


#: ``transformers`` image models on the digits' 8×8 pixels (as 3 channels): their config class, the model class, and
#: the config's arguments (dropout and stochastic depth off: with them the brute-force value is one random draw).
VISION: dict[str, tuple[str, str, dict]] = {
    "ConvNextModel (layer scale, channels-first layer norms)": (
        "ConvNextConfig", "ConvNextModel", dict(patch_size=2, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2,
                                                layer_scale_init_value=0.1)),
    "PoolFormerModel (GroupNorm subclass, layer scale through unsqueeze(-1))": (
        "PoolFormerConfig", "PoolFormerModel", dict(hidden_sizes=[16, 32], depths=[1, 1], num_encoder_blocks=2,
                                                    strides=[2, 2], patch_sizes=[3, 3], padding=[1, 1], pool_size=3)),
    "BeitModel (layer scale, relative-position table)": (
        "BeitConfig", "BeitModel", dict(image_size=8, patch_size=2, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=64, use_relative_position_bias=True,
                                        layer_scale_init_value=0.1, use_mean_pooling=True,
                                        drop_path_rate=0.0)),
    "SwinModel (windows of the examples as rows)": (
        "SwinConfig", "SwinModel", dict(image_size=8, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
                                        window_size=2, drop_path_rate=0.0)),
}

#: ``transformers`` encoder-decoders, fed the tokens as both the encoder's and the decoder's input.
SEQ2SEQ: dict[str, tuple[str, str, dict]] = {
    "PegasusModel": ("PegasusConfig", "PegasusModel", dict(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0)),
    "ProphetNetModel (an n-gram table's row at a negative index)": ("ProphetNetConfig", "ProphetNetModel", dict(
        hidden_size=32, encoder_ffn_dim=64, decoder_ffn_dim=64, num_encoder_layers=2, num_decoder_layers=2,
        num_encoder_attention_heads=4, num_decoder_attention_heads=4, max_position_embeddings=80, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0)),
}


class HuggingFaceVision(nn.Module):
    """A ``transformers`` image model of :data:`VISION` on the digits' pixels as an 8×8 image of 3 channels, its
    pooled output (or its last hidden state, mean-pooled) into a Linear head. Only where ``transformers`` is
    installed."""

    def __init__(self, name: str) -> None:
        super().__init__()
        import transformers

        config, model, kwargs = VISION[name]
        self.body = getattr(transformers, model)(getattr(transformers, config)(num_channels=3, **kwargs))
        with torch.no_grad():
            width = self.features(torch.zeros(1, 64)).shape[1]
        self.head = nn.Linear(width, 10)

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        out = self.body(pixel_values=pixels.view(-1, 1, 8, 8).expand(-1, 3, 8, 8))
        if getattr(out, "pooler_output", None) is not None:
            return out.pooler_output.flatten(1)
        hidden = out.last_hidden_state
        return hidden.mean(1) if hidden.dim() == 3 else hidden.mean((2, 3))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(pixels))


class HuggingFaceSeq2Seq(HuggingFaceEncoder):
    """A ``transformers`` encoder-decoder of :data:`SEQ2SEQ`, the tokens its encoder's and its decoder's input, the
    decoder's last hidden state mean-pooled into a Linear head. Only where ``transformers`` is installed."""

    @staticmethod
    def table() -> dict[str, tuple[str, str, dict]]:
        return SEQ2SEQ

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(input_ids=tokens, decoder_input_ids=tokens).last_hidden_state.mean(1))


try:
    import transformers  # noqa: F401  (optional: not a dependency of the package)

    MODELS["Hugging Face GPT2LMHeadModel"] = (HuggingFaceGpt2, True)
    MODELS["Hugging Face BartForConditionalGeneration (tied head)"] = (partial(HuggingFaceGpt2, bart=True), True)
    MODELS.update({f"Hugging Face {name}": (partial(HuggingFaceEncoder, name), True) for name in ENCODERS})
    MODELS.update({f"Hugging Face {name}": (partial(HuggingFaceVision, name), False) for name in VISION})
    MODELS.update({f"Hugging Face {name}": (partial(HuggingFaceSeq2Seq, name), True) for name in SEQ2SEQ})
except ImportError:
    pass


class Frozen(pl.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def exact_values(net: nn.Module, x: torch.Tensor, y: torch.Tensor, covered: set[str]) -> tuple[float, float]:
    """Exact B_simple of every trainable parameter, and of the covered ones."""
    rows = per_example_gradients(net, F.cross_entropy, x, y)
    keep = torch.cat([torch.full((p.numel(),), name in covered) for name, p in net.named_parameters()
                      if p.requires_grad])
    return exact_noise_scale(rows)[0], exact_noise_scale(rows[:, keep])[0]


def fit(make: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor, seed: int, steps: int):
    torch.manual_seed(0)
    net = make()
    draws = torch.utils.data.RandomSampler(range(len(x)), replacement=True, num_samples=steps * 32,
                                           generator=torch.Generator().manual_seed(seed))  # i.i.d., as exact assumes
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, sampler=draws)
    callback = GradientNoiseScaleCallback(verbose=False)
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    trainer.fit(Frozen(net), loader)
    uncovered = set(callback.meter.coverage["uncovered"])
    covered = {name for name, _ in net.named_parameters() if f"net.{name}" not in uncovered}
    return net, callback, covered


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--only", help="only the models whose name contains this (e.g. GPT2)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for logger in ("pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    pixels, tokens, y = digits_and_tokens()
    print("| model | seed | run average [95%] | exact, covered | exact, whole model | holds | coverage | method "
          "| recommendation |\n|---|---|---|---|---|---|---|---|---|")
    for name, (make, reads_tokens) in MODELS.items():
        if args.only and args.only not in name:
            continue
        x = tokens if reads_tokens else pixels
        exact = None  # the same parameters (SGD at lr 0) and coverage for every seed: computed once
        for seed in range(args.seeds):
            net, callback, covered = fit(make, x, y, seed, args.steps)
            if not callback.run_estimate.measured:  # refused with its reason: the same for every seed
                print(f"| {name} | {seed} | not measured: {callback.run_estimate.failure} | | | | "
                      f"{callback.meter.coverage['fraction']:.1%} | {callback.run_estimate.method} | — |", flush=True)
                break
            exact = exact or exact_values(net, x, y, covered)
            whole, of_covered = exact
            run = callback.run_estimate
            status = callback.recommendation.status if callback.recommendation is not None else "—"
            print(f"| {name} | {seed} | {run.b_simple:.1f} [{run.ci_low:.1f}, {run.ci_high:.1f}] | {of_covered:.1f} "
                  f"| {whole:.1f} | {'yes' if run.ci_low <= of_covered <= run.ci_high else '**no**'} "
                  f"| {callback.meter.coverage['fraction']:.1%} | {run.method} | {status} |", flush=True)


if __name__ == "__main__":
    main()

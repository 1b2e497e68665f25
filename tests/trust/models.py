"""Models that real users bring and that a per-example hook can get wrong (each item of issue 10 has one)."""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

from benchmarks.sketch_accuracy import PixelSequence, digits, train
from tests.helpers import Classifier


class SequenceFirstEncoder(nn.Module):
    """Digits as 8 rows of 8 pixels, sequence-first all the way: ``(T, B, ·)`` into ``nn.TransformerEncoderLayer``
    with its default ``batch_first=False``, mean over positions, a Linear head on ``(B, ·)``."""

    def __init__(self, dim: int = 16, freeze_attention: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(8, dim)
        self.encoder = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=32, dropout=0.0)
        self.head = nn.Linear(dim, 10)
        if freeze_attention:  # the feed-forward, norm and embedding layers alone
            self.encoder.self_attn.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(x.shape[0], 8, 8).transpose(0, 1)  # (T=8, B, 8)
        return self.head(self.encoder(self.embed(rows)).mean(0))


class PixelTokens(PixelSequence):
    """:class:`benchmarks.sketch_accuracy.PixelSequence` fed pixels in [0, 1], made tokens 0..16 inside: its
    64-position sequence layer is long and wide enough that its per-example norms are sketched
    (``per_example/sketch.py``)."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward((x * 16).round().long())


def trained_pixel_tokens() -> PixelTokens:
    """:class:`PixelTokens` after the 150 SGD steps of ``benchmarks/sketch_accuracy.py`` on the digits (B_simple
    about twice a batch of 32 then, where at initialisation it is eight times), trained on one thread so that every
    process builds the same model."""
    x, y = digits()
    model, threads = PixelTokens(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(model, x, y, steps=150)
    finally:
        torch.set_num_threads(threads)
    return model


class ConvTwice(nn.Module):
    """One Conv1d applied twice (weight sharing across depth), which per-example norms can't measure: the norm of a
    convolution's summed gradient needs every call's positions in one window. Weights ×4 at init: B_simple
    resolved in a short test run."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp, self.body, self.head = nn.Linear(64, 32), nn.Conv1d(4, 4, 3, padding=1), nn.Linear(32, 10)
        with torch.no_grad():
            self.inp.weight.mul_(4.0)
            self.head.weight.mul_(4.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)).reshape(-1, 4, 8)
        return self.head(torch.tanh(self.body(torch.tanh(self.body(h)))).flatten(1))


class LinearTwice(nn.Module):
    """One Linear applied twice (weight sharing across depth), measured as one call over both
    (:mod:`gns_callback.per_example.repeated`). Weights ×4 at init: B_simple ≈ 31, resolved in a short test run."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp, self.body, self.head = nn.Linear(64, 32), nn.Linear(32, 32), nn.Linear(32, 10)
        with torch.no_grad():
            self.inp.weight.mul_(4.0)
            self.head.weight.mul_(4.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.head(torch.tanh(self.body(torch.tanh(self.body(h)))))


class PositionalEmbedding(nn.Module):
    """nanoGPT-style: token embedding plus a position embedding looked up on ``arange(T)`` (the same for every
    example, so the position table's gradient has no per-example rows of its own); a Linear head on the flattened
    sequence (×2 at init: B_simple ≈ 31)."""

    def __init__(self, dim: int = 4, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tokens, self.positions = nn.Embedding(17, dim), nn.Embedding(64, dim)
        self.head = nn.Linear(64 * dim, 10)
        with torch.no_grad():
            self.head.weight.mul_(2.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        return self.head(torch.tanh(h).flatten(1))


class PooledPositions(PositionalEmbedding):
    """:class:`PositionalEmbedding` with the sequence mean-pooled before a small head: the position table is 68% of
    the parameters, too much to leave out of the norms."""

    def __init__(self, dim: int = 4, seed: int = 0) -> None:
        super().__init__(dim, seed)
        self.head = nn.Linear(dim, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        return self.head(torch.tanh(h).mean(1))


class PixelPositions(PooledPositions):
    """:class:`PooledPositions` fed pixels in [0, 1], made tokens 0..16 inside (the DDP fits feed pixels)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward((x * 16).round().long())


class LinearOnLearnedTable(nn.Module):
    """A Linear applied both to the data and to a learned table (e.g. class prototypes) in the same forward."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.project = nn.Linear(64, 128)  # its weights are > 90% of the parameters: auto takes per_example
        self.prototypes = nn.Parameter(torch.randn(10, 64) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x) @ self.project(self.prototypes).T


class BatchCentred(nn.Module):
    """An MLP whose hidden layer is centred on the batch mean (BatchNorm's statistic, with no module to refuse):
    every example's gradient depends on the others (:mod:`gns_callback.per_example.checks`)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.hidden, self.head = nn.Linear(64, 32), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(x))
        return self.head(h - h.mean(0, keepdim=True))


class LstmClassifier(nn.Module):
    """Digits as 8 rows into an LSTM (sequence-first), last hidden state into a Linear (the LSTM's weights are most
    of the model)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lstm, self.head = nn.LSTM(8, 32), nn.Linear(32, 10)
        with torch.no_grad():  # larger gradients at init: B_simple ≈ 30, resolved in a short test run
            self.head.weight.mul_(8.0)
            self.lstm.weight_ih_l0.mul_(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x.reshape(x.shape[0], 8, 8).transpose(0, 1))
        return self.head(out[-1])


class ProjectedLstmClassifier(nn.Module):
    """:class:`LstmClassifier` with projected hidden states (``proj_size=16``), which per-example norms don't
    measure: they cover only the Linear head (4.2% of the parameters)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lstm, self.head = nn.LSTM(8, 32, proj_size=16), nn.Linear(16, 10)
        with torch.no_grad():  # larger gradients at init: B_simple resolved in a short test run
            self.head.weight.mul_(8.0)
            self.lstm.weight_ih_l0.mul_(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x.reshape(x.shape[0], 8, 8).transpose(0, 1))
        return self.head(out[-1])


class GradientPenaltyClassifier(Classifier):
    """Cross-entropy plus ``λ·|∂ℓ_i/∂x_i|²`` per example (an input-gradient penalty, ``create_graph=True``)."""

    PENALTY = 0.1

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = x.clone().requires_grad_(True)
        losses = F.cross_entropy(self.net(x), y, reduction="none")
        (grad_x,) = torch.autograd.grad(losses.sum(), x, create_graph=True)  # row i: ∂ℓ_i/∂x_i
        return (losses + self.PENALTY * grad_x.square().sum(1)).mean()


def penalised_loss_of_one(net: nn.Module):
    """``loss(params, x_i, y_i)`` of :class:`GradientPenaltyClassifier` for one example, for ``torch.func``."""
    from torch.func import functional_call, grad

    def loss(params, xi, yi):
        def ce(x):
            return F.cross_entropy(functional_call(net, params, (x.unsqueeze(0),)), yi.unsqueeze(0))

        return ce(xi) + GradientPenaltyClassifier.PENALTY * grad(ce)(xi).square().sum()

    return loss


def exact_b_simple_of_loss(loss_of_one, net: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = 256):
    """``(B_simple, |G|², tr Σ)`` by brute force: every example's gradient of ``loss_of_one(params, x_i, y_i)``
    over the whole data set (:func:`gns_callback.exact.exact_noise_scale` of them)."""
    from torch.func import grad, vmap

    from gns_callback.exact import exact_noise_scale

    params = {k: v.detach() for k, v in net.named_parameters() if v.requires_grad}
    rows = []
    for start in range(0, x.shape[0], chunk):
        g = vmap(grad(loss_of_one), in_dims=(None, 0, 0))(params, x[start:start + chunk], y[start:start + chunk])
        rows.append(torch.cat([v.reshape(v.shape[0], -1) for v in g.values()], dim=1))
    return exact_noise_scale(torch.cat(rows).double())


class TiedLanguageModel(nn.Module):
    """GPT-style tied embeddings: ``head.weight = tokens.weight`` (one (17, 8) table looks tokens up and produces
    per-position logits), an MLP block with LayerNorm between them, the logits mean-pooled into a classifier."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tokens, self.norm = nn.Embedding(17, 8), nn.LayerNorm(8)
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)
        self.head = nn.Linear(8, 17, bias=False)
        self.head.weight = self.tokens.weight
        self.classify = nn.Linear(17, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tokens(tokens)
        h = h + self.down(torch.tanh(self.up(self.norm(h))))
        return self.classify(self.head(h).mean(1))


class ScaledLogits(nn.Module):
    """The digits MLP 64-32-10 (tanh) whose logits are multiplied by a learned temperature, clamped as CLIP clamps
    its logit scale: a bare parameter used through a clamp, which no per-example reading follows (one of 2,411; a
    temperature multiplied in directly is measured, :mod:`gns_callback.per_example.broadcast`). At ``scale = 0.05``
    its gradient is mostly noise: the whole model's B_simple is 171 against 82 for the other parameters."""

    def __init__(self, scale: float = 0.05, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
        self.scale = nn.Parameter(torch.tensor(scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale.clamp(max=100.0)  # below the bound: the gradient of a plain product


def seeded_vit() -> nn.Module:
    """``benchmarks/model_scan.py``'s digits ViT (class token and position table as bare parameters), seeded."""
    from benchmarks.model_scan import ViTStyle

    torch.manual_seed(0)
    return ViTStyle()


def seeded_hand_written() -> nn.Module:
    """``benchmarks/model_scan.py``'s hand-written attention (every layer a bare ``x @ W`` or ``F.linear``), seeded."""
    from benchmarks.model_scan import HandWrittenAttention

    torch.manual_seed(0)
    return HandWrittenAttention()


class EinsumOnly(nn.Module):
    """Two bare weights applied by ``torch.einsum``, a product not read per example: nothing can be measured."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.outer = nn.Parameter(torch.randn(8, 16) / 3), nn.Parameter(torch.randn(16, 10) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(torch.einsum("btk,kl->btl", x.reshape(-1, 8, 8), self.inner))
        return torch.einsum("btk,kl->bl", h, self.outer)


def seeded_relative_bias(swin: bool) -> nn.Module:
    """``benchmarks/model_scan.py``'s attention with T5's bucket embedding or Swin's indexed table, seeded."""
    from benchmarks.model_scan import RelativeBiasAttention

    torch.manual_seed(0)
    return RelativeBiasAttention(swin=swin)


class PixelRelativeBias(nn.Module):
    """:func:`seeded_relative_bias` (T5's bucket embedding) fed pixels in [0, 1], made tokens 0..16 inside (the DDP
    fits feed pixels)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = seeded_relative_bias(swin=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x * 16).round().long())


class SharedTables(nn.Module):
    """T5 v1.1's layout (untied head): ``shared``, an encoder table and a decoder table holding one weight; the
    encoder reads the tokens, the decoder the first ``decoder_tokens`` of them reversed (0: the decoder table is never
    called, as in ``T5EncoderModel``). Tokens 0..16, pixels made tokens inside where ``pixels``. ``tied_head``: BART's
    and T5 v1.0's layout, the decoder's states read out by a Linear holding the same weight (vocabulary logits,
    pooled into the head)."""

    def __init__(self, decoder_tokens: int = 8, pixels: bool = False, seed: int = 0, tied_head: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.shared = nn.Embedding(17, 16)
        self.encoder, self.decoder = nn.Embedding(17, 16), nn.Embedding(17, 16)
        self.encoder.weight = self.decoder.weight = self.shared.weight
        self.mix, self.head = nn.Linear(16, 16), nn.Linear(17 if tied_head else 16, 10)
        self.lm_head = None
        if tied_head:
            self.lm_head = nn.Linear(16, 17, bias=False)
            self.lm_head.weight = self.shared.weight
        self.decoder_tokens, self.pixels = decoder_tokens, pixels

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.pixels:
            tokens = (tokens * 16).round().long()
        h = torch.tanh(self.mix(self.encoder(tokens)))
        if self.lm_head is not None:  # the decoder's states: its lookups plus the encoder's, read out by the table
            states = h[:, :self.decoder_tokens] + self.decoder(tokens[:, :self.decoder_tokens].flip(1))
            return self.head(torch.tanh(self.lm_head(states)).mean(1))
        h = h.mean(1)
        if self.decoder_tokens:
            h = h + self.decoder(tokens[:, :self.decoder_tokens].flip(1)).mean(1)
        return self.head(h)


def seeded_min_gpt() -> nn.Module:
    """``benchmarks/model_scan.py``'s minGPT-style model (a position table sliced to the sequence), seeded."""
    from benchmarks.model_scan import MinGptStyle

    torch.manual_seed(0)
    return MinGptStyle()



class WeightNormed(nn.Module):
    """Every weight weight-normalised (``W = g·v/‖v‖``), as in vocoders and wav2vec 2.0: the 64 pixels as 8 channels
    of 8 through a grouped ``Conv1d`` normalised per kernel position (``dim=2``, wav2vec 2.0's positional
    convolution), a ``Linear`` in the older hook-based form, a head normalised as a whole (``dim=None``)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.conv = parametrizations.weight_norm(nn.Conv1d(8, 8, 3, padding=1, groups=2), dim=2)
        with warnings.catch_warnings():  # the hook-based form is deprecated
            warnings.simplefilter("ignore")
            self.mix = torch.nn.utils.weight_norm(nn.Linear(64, 32))
        self.head = parametrizations.weight_norm(nn.Linear(32, 10), dim=None)
        with torch.no_grad():  # magnitudes off their start at ‖v‖ (where W = v, and the norms are W's)
            for name, param in self.named_parameters():
                if name.endswith(("original0", "weight_g")):
                    param.mul_(torch.rand_like(param) + 0.5)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(pixels.view(-1, 8, 8))).flatten(1)
        return self.head(torch.tanh(self.mix(h)))


class BareTokenTables(nn.Module):
    """Token tables of the model's own code, not ``nn.Embedding``: ``F.embedding(tokens, W)`` with a padding row and
    ``V[tokens]`` added to it, each position's row through a tanh into a head over all 64 positions."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.table = nn.Parameter(torch.randn(17, 4) * 0.5)
        self.other = nn.Parameter(torch.randn(17, 4) * 0.5)
        self.head = nn.Linear(64 * 4, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = F.embedding(tokens, self.table, padding_idx=0) + self.other[tokens]
        return self.head(torch.tanh(h).flatten(1))


class ScaledWordEmbedding(nn.Embedding):
    """BART's, mBART's and M2M100's token table: ``nn.Embedding``'s lookup times a fixed scale (its own forward)."""

    def __init__(self, rows: int, width: int, scale: float) -> None:
        super().__init__(rows, width)
        self.scale = scale

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) * self.scale


class LearnedPositions(nn.Embedding):
    """A position table of ``nn.Embedding``'s subclass, its rows two past each position, counted as

    * ``"expand"``: ``arange(T)`` expanded to the batch, looked up (BART's);
    * ``"mask"``: the padding mask's running sum, looked up (OPT's);
    * ``"shared"``: ``arange(T)``, looked up once for every example;
    * ``"slice"``: ``weight[2:T + 2]``, no lookup (Whisper's).

    The module returns those rows: their gradient meets the examples in its caller's forward for the last two."""

    OFFSET = 2

    def __init__(self, positions: int, width: int, counted: str = "expand") -> None:
        super().__init__(positions + self.OFFSET, width)
        self.counted = counted

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if self.counted == "slice":
            return self.weight[self.OFFSET:length + self.OFFSET]
        positions = torch.arange(length, device=tokens.device)
        if self.counted == "expand":
            positions = positions.expand(tokens.shape[0], -1)
        elif self.counted == "mask":
            mask = (tokens > 0).long()
            positions = torch.cumsum(mask, dim=1) * mask - 1
        return super().forward(positions + self.OFFSET)


class SubclassedEmbeddings(nn.Module):
    """Tokens through the two subclasses of ``nn.Embedding`` above, summed, a LayerNorm, a Linear and a GELU,
    mean-pooled into a head. ``two_towers``: a second scaled token table holding the first's weight (BART's
    ``encoder.embed_tokens`` and ``decoder.embed_tokens``) reads the tokens reversed, added to the first.
    ``tied_head``: the head is the token table too (BART's ``lm_head``), its logits mean-pooled, the first 10 the
    classes'."""

    def __init__(self, counted: str = "expand", two_towers: bool = False, tied_head: bool = False,
                 seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tokens, self.positions = ScaledWordEmbedding(17, 8, scale=4.0), LearnedPositions(64, 8, counted)
        self.norm, self.mix = nn.LayerNorm(8), nn.Linear(8, 8)
        self.other_tokens = ScaledWordEmbedding(17, 8, scale=0.5) if two_towers else None
        if two_towers:
            self.other_tokens.weight = self.tokens.weight
        self.head = nn.Linear(8, 17, bias=False) if tied_head else nn.Linear(8, 10)
        if tied_head:
            self.head.weight = self.tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tokens(tokens) + self.positions(tokens)
        if self.other_tokens is not None:
            h = h + self.other_tokens(tokens.flip(1))
        h = F.gelu(self.mix(self.norm(h)))
        return self.head(h).mean(1)[:, :10] if self.head.out_features == 17 else self.head(h.mean(1))


class OffsetPositions(nn.Module):
    """The 64 pixels as 32 tokens, each a pair of pixels (289 of them), plus a position table looked up at
    ``arange(32) + offset`` (BART's offset is 2), as many positions as a batch of 32 has examples; through a tanh,
    mean-pooled into a head."""

    def __init__(self, offset: int = 2, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.offset = offset
        self.tokens, self.positions = nn.Embedding(17 * 17, 8), nn.Embedding(32 + offset, 8)
        self.head = nn.Linear(8, 10)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        pairs = pixels[:, ::2] * 17 + pixels[:, 1::2]
        positions = torch.arange(pairs.shape[1], device=pairs.device) + self.offset
        return self.head(torch.tanh(self.tokens(pairs) + self.positions(positions)).mean(1))


class OnePlusScaleNorm(nn.Module):
    """Gemma's RMSNorm: ``x / rms(x) · (1 + w)`` in float32, ``w`` starting at zero."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class GemmaStyle(nn.Module):
    """Tokens through an embedding, a Gemma-style norm, a Linear with a GELU and a second such norm, mean-pooled
    into a head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.norm, self.mix = nn.Embedding(17, 8), OnePlusScaleNorm(8), nn.Linear(8, 8)
        self.final_norm, self.head = OnePlusScaleNorm(8), nn.Linear(8, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + F.gelu(self.mix(self.norm(h)))
        return self.head(self.final_norm(h).mean(1))


class LayerUsedOutside(nn.Module):
    """A digits MLP whose hidden ``nn.Linear`` is never called: the model applies its weight and bias itself
    (``x @ W.t() + b``, as Mamba's ``dt_proj.weight @ x``), or with ``through_conv`` as a 1×1 convolution, which no
    reading here takes."""

    def __init__(self, through_conv: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.hidden, self.head, self.through_conv = nn.Linear(64, 32), nn.Linear(32, 10), through_conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.through_conv:
            h = F.conv1d(x.unsqueeze(-1), self.hidden.weight.unsqueeze(-1), self.hidden.bias).squeeze(-1)
        else:
            h = x @ self.hidden.weight.t() + self.hidden.bias
        return self.head(torch.tanh(h))


class TimeMix(nn.Module):
    """RWKV's token shift: each position mixed with the one before, ``x·μ + x_prev·(1 − μ)`` with a learned ``μ`` per
    channel, then a Linear with a GELU, mean-pooled into a head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.mix = nn.Embedding(17, 8), nn.Parameter(torch.rand(8))
        self.key, self.head = nn.Linear(8, 8), nn.Linear(8, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        previous = F.pad(x, (0, 0, 1, -1))
        return self.head(F.gelu(self.key(x * self.mix + previous * (1 - self.mix))).mean(1))


class FunctionalLayerNorm(nn.Module):
    """nanoGPT's ``LayerNorm``: ``F.layer_norm`` with a weight and an optional bias of its own."""

    def __init__(self, width: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))
        self.bias = nn.Parameter(0.1 * torch.randn(width)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class ChannelsFirstLayerNorm(nn.LayerNorm):
    """SqueezeBERT's ``LayerNorm`` subclass: a ``(B, C, T)`` input permuted to ``nn.LayerNorm``'s and back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 1)).permute(0, 2, 1)


class LayerNormsOfTheirOwn(nn.Module):
    """Tokens through an embedding, nanoGPT's LayerNorm (with and without a bias) around a Linear with a GELU, and
    SqueezeBERT's channels-first LayerNorm, mean-pooled into a head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.first, self.mix = nn.Embedding(17, 8), FunctionalLayerNorm(8, bias=True), nn.Linear(8, 8)
        self.second, self.channels = FunctionalLayerNorm(8, bias=False), ChannelsFirstLayerNorm(8)
        self.head = nn.Linear(8, 10)
        with torch.no_grad():
            self.channels.weight.add_(0.1 * torch.randn(8))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.second(F.gelu(self.mix(self.first(self.embed(tokens)))))
        return self.head(self.channels(h.transpose(1, 2)).mean(2))


class BuiltOnlyGroupNorm(nn.GroupNorm):
    """``transformers``' ``PoolFormerGroupNorm``: ``nn.GroupNorm`` with one group, set in ``__init__`` alone."""

    def __init__(self, channels: int) -> None:
        super().__init__(1, channels)


class PoolFormerStyle(nn.Module):
    """PoolFormer's block on the digits' 8×8 pixels: a 1×1 convolution into 8 channels, then twice a GroupNorm
    subclass, a token mixer (average pooling less its input, or a 1×1 convolution MLP) and a layer scale of shape
    ``(C,)`` applied channels-first as ``scale.unsqueeze(-1).unsqueeze(-1) * h`` (negative dims), each added back;
    mean-pooled into a head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.stem, self.head = nn.Conv2d(1, 8, 1), nn.Linear(8, 10)
        self.before, self.after = BuiltOnlyGroupNorm(8), BuiltOnlyGroupNorm(8)
        self.pool, self.mlp = nn.AvgPool2d(3, 1, 1, count_include_pad=False), nn.Sequential(
            nn.Conv2d(8, 16, 1), nn.GELU(), nn.Conv2d(16, 8, 1))
        self.scale_1, self.scale_2 = nn.Parameter(0.5 + torch.rand(8)), nn.Parameter(0.5 + torch.rand(8))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        h = self.stem(pixels.view(-1, 1, 8, 8))
        mixed = self.before(h)
        h = h + self.scale_1.unsqueeze(-1).unsqueeze(-1) * (self.pool(mixed) - mixed)
        h = h + self.scale_2.unsqueeze(-1).unsqueeze(-1) * self.mlp(self.after(h))
        return self.head(h.mean((2, 3)))


def windows(h: torch.Tensor, size: int) -> torch.Tensor:
    """Swin's ``window_partition``: ``(B, H, W, C)`` cut into ``size × size`` windows stacked as rows, example by
    example: ``(B·nW, size², C)``."""
    b, height, width, c = h.shape
    h = h.view(b, height // size, size, width // size, size, c).permute(0, 1, 3, 2, 4, 5)
    return h.reshape(-1, size * size, c)


def unwindowed(rows: torch.Tensor, size: int, height: int, width: int) -> torch.Tensor:
    """Swin's ``window_reverse``: the rows of :func:`windows` back to ``(B, H, W, C)``."""
    c = rows.shape[-1]
    h = rows.view(-1, height // size, width // size, size, size, c).permute(0, 1, 3, 2, 4, 5)
    return h.reshape(-1, height, width, c)


class WindowAttention(nn.Module):
    """Attention within each window of rows ``(B·nW, T, C)``: a LayerNorm, separate q/k/v Linear layers, scores
    scaled, plus a learned relative bias ``(heads, T, T)`` and an optional constant mask, a softmax, an output
    Linear."""

    def __init__(self, width: int, heads: int, tokens: int) -> None:
        super().__init__()
        self.heads, self.norm = heads, nn.LayerNorm(width)
        self.q, self.k, self.v, self.out = (nn.Linear(width, width) for _ in range(4))
        self.bias = nn.Parameter(0.1 * torch.randn(heads, tokens, tokens))

    def forward(self, rows: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        n, t, c = rows.shape
        x = self.norm(rows)
        q, k, v = (f(x).view(n, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / (c // self.heads) ** 0.5 + self.bias.unsqueeze(0)
        if mask is not None:
            scores = scores + mask
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(n, t, c)
        return self.out(out)


class FusedWindowAttention(WindowAttention):
    """:class:`WindowAttention` in timm's layout: one Linear for q, k and v, ``reshape(n, t, 3, H, D).permute(2, 0,
    3, 1, 4).unbind(0)``, which moves the rows to dim 1 and picks along dim 0."""

    def __init__(self, width: int, heads: int, tokens: int) -> None:
        super().__init__(width, heads, tokens)
        del self.q, self.k, self.v
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, rows: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        n, t, c = rows.shape
        qkv = self.qkv(self.norm(rows)).reshape(n, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        scores = (q * (c // self.heads) ** -0.5) @ k.transpose(-2, -1) + self.bias.unsqueeze(0)
        if mask is not None:
            scores = scores + mask
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(n, t, c))


class KernelWindowAttention(FusedWindowAttention):
    """:class:`FusedWindowAttention` through ``F.scaled_dot_product_attention`` (timm's ``fused_attn``), with no
    relative bias, so that the CPU runs its fused kernel rather than the math fallback."""

    def __init__(self, width: int, heads: int, tokens: int) -> None:
        super().__init__(width, heads, tokens)
        del self.bias

    def forward(self, rows: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        n, t, c = rows.shape
        qkv = self.qkv(self.norm(rows)).reshape(n, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(*qkv.unbind(0), attn_mask=mask)  # a constant mask: still the kernel
        return self.out(out.transpose(1, 2).reshape(n, t, c))


class SwinStyle(nn.Module):
    """Swin on the digits' 8×8 pixels: a 1×1 convolution into 8 channels, then two blocks of attention within 2×2
    windows (the second on the map rolled by one pixel, with a constant mask), each added back, mean-pooled into a
    head. Its attention layers see the windows as rows, ``(B·16, 4, 8)``, with no batch of B in any dim."""

    def __init__(self, seed: int = 0, attention: type[WindowAttention] = WindowAttention) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.stem, self.head = nn.Conv2d(1, 8, 1), nn.Linear(8, 10)
        self.blocks = nn.ModuleList([attention(8, 2, 4), attention(8, 2, 4)])
        self.register_buffer("mask", torch.where(torch.rand(16, 1, 4, 4) < 0.2, -1e4, 0.0))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        h = self.stem(pixels.view(-1, 1, 8, 8)).permute(0, 2, 3, 1)  # (B, 8, 8, C)
        h = h + unwindowed(self.blocks[0](windows(h, 2)), 2, 8, 8)
        shifted = torch.roll(h, (-1, -1), (1, 2))
        rows = self.blocks[1](windows(shifted, 2), self.mask.repeat(shifted.shape[0], 1, 1, 1))
        h = h + torch.roll(unwindowed(rows, 2, 8, 8), (1, 1), (1, 2))
        return self.head(h.mean((1, 2)))

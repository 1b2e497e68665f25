"""Unbiased sketches of per-example squared norms ``|A_i|²`` of ``A_i = Σ_t a_{i,t}ᵀ δ_{i,t}`` (sequences, convs).

The exact forms cost about one weight-gradient computation per layer (``T²·(K+L)`` for the Gram form, ``T·K·L`` to
materialise, per example), which makes measuring every example of a sequence model cost a third more per step
(benchmarks/RESULTS.md, "Per-example norms for every example"). A random-probe sketch costs ``T·k·(K+L)``:

    |A|²_F = E_s |A s|²   for s with independent entries of mean 0 and variance 1 (Hutchinson 1990),

so with ``k`` Rademacher probes per example, ``(1/k)·Σ_j |A s_j|²`` is unbiased, with variance
``(2/k)·(|AᵀA|²_F − Σ_m (AᵀA)_mm²) ≤ (2/k)·|A|⁴_F`` (Avron & Toledo 2011): a relative standard deviation at most
``√(2/k)`` per example and layer, less the more directions ``A_i`` spreads over. The probes are drawn
independently per example, so these errors average out over the batch, as the examples' own spread does: at most
``√(2/(k·B))`` of ``Σ_i |g_i|²`` for a batch of ``B`` alike examples (9% at ``B = 32`` in the rank-one worst case),
and part of the meter's step-to-step variance, so of its interval.
``A s`` is computed as ``δᵀ(a·s)`` from the narrower side, without forming ``A``.

The probes come from generators of their own (one per device, seeded by the process's rank and the optimizer step,
:func:`reseed_probes`), so the user's random streams are never touched and a resumed run measures as an
uninterrupted one does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["PROBES", "SKETCH_MARGIN", "SKETCH_EXTRA_LAUNCHES", "RANDOM_DRAW_COST", "sketch_cost",
           "sketched_sq_norms", "probe_signs", "reseed_probes", "restart_probes"]

#: Probes per example (a multiple of 8, :func:`probe_signs`): relative standard deviation at most √(2/8) = 0.5 per
#: example and layer, before averaging.
PROBES = 8
#: The sketch replaces an exact form only when it is this many times cheaper (it adds a little noise).
SKETCH_MARGIN = 2.0
#: Kernels a sketch launches beyond an exact form's: the random draw, the sign lookup, the probes' product and the
#: division (the convolution's sketch launches 5 more than its exact form, :func:`sketched_sq_norms` 3 more than
#: the Gram form). On an accelerator each costs the host a launch (:mod:`.launches`).
SKETCH_EXTRA_LAUNCHES = 4
#: One random sign costs the host about as long as this many multiply-adds in a matrix product (CPU, one thread,
#: ``benchmarks/sketch_layers.py``: 32 768 signs in 0.035–0.040 ms against 134 million multiply-adds in 1.7 ms);
#: an overstatement on accelerators.
RANDOM_DRAW_COST = 100.0
_SEED = 0x9E5
_step = 0  # the optimizer step the probes are drawn for (reseed_probes)
_generators: dict[torch.device, torch.Generator] = {}
_tables: dict[tuple[torch.device, torch.dtype], Tensor] = {}


def sketch_cost(seq_len: float, in_features: float, out_features: float, probes: int = PROBES) -> float:
    """Multiply-adds per example of :func:`sketched_sq_norms`: ``T·k·(K+L)`` for ``δᵀ(a·s)``, ``k·max(K, L)``
    for the squared sum, and the ``k·min(K, L)`` random signs at :data:`RANDOM_DRAW_COST` each."""
    narrow, wide = sorted((in_features, out_features))
    return seq_len * probes * (narrow + wide) + probes * wide + RANDOM_DRAW_COST * probes * narrow


def sketched_sq_norms(activations: Tensor, grad_outputs: Tensor, probes: int = PROBES) -> Tensor:
    """Unbiased estimate of ``|Σ_t a_{i,t}ᵀ δ_{i,t}|²_F`` for ``activations`` (N, T, K), ``grad_outputs`` (N, T, L):
    ``(1/k)·Σ_j |δ_iᵀ (a_i s_ij)|²`` with ``k = probes`` Rademacher vectors ``s_ij`` per example (module docstring),
    probing the narrower of the two sides. Shape (N,)."""
    if activations.shape[-1] > grad_outputs.shape[-1]:
        activations, grad_outputs = grad_outputs, activations
    batch, _, narrow = activations.shape
    signs = probe_signs((batch, narrow, probes), activations.device, activations.dtype)
    # (sᵀaᵀ)δ, not (a s)ᵀδ: the same numbers, but a product with k rows, not k columns, is 2-4× faster on the
    # CPU (benchmarks/RESULTS.md, "The sketch's products, turned round").
    probed = torch.bmm(signs.transpose(1, 2), activations.transpose(1, 2))  # (N, k, T)
    projected = torch.bmm(probed, grad_outputs)  # (N, k, wide)
    return projected.square_().sum(dim=(1, 2)).div_(probes)


def probe_signs(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> Tensor:
    """Independent ±1 entries from this module's own generator for ``device``: random bytes, each looked up as its
    8 bits' signs (about 4× faster on CPU than drawing each sign). ``shape[-1]`` must be a multiple of 8."""
    device = torch.device(device)
    count = math.prod(shape)
    draws = torch.randint(0, 256, (count // 8,), generator=_generator(device), device=device)
    return F.embedding(draws, _sign_table(device, dtype)).reshape(shape)


def _sign_table(device: torch.device, dtype: torch.dtype) -> Tensor:
    """(256, 8): row ``b`` holds the signs ``2·bit − 1`` of byte ``b``'s 8 bits."""
    key = (device, dtype)
    if key not in _tables:
        bits = (torch.arange(256, device=device).unsqueeze(1) >> torch.arange(8, device=device)) & 1
        _tables[key] = bits.to(dtype).mul_(2).sub_(1)
    return _tables[key]


def reseed_probes(step: int) -> None:
    """Restart every device's probe stream at the seed of ``(rank, step)``. The meter calls this as each optimizer
    step begins, with its count of steps, which its checkpoint keeps: a resumed run draws the probes an
    uninterrupted one would, and every rank draws its own."""
    global _step
    _step = int(step)
    for generator in _generators.values():
        generator.manual_seed(_seed())


def restart_probes() -> None:
    """Restart the probe streams at the current step's seed: a pass run again draws the same probes."""
    reseed_probes(_step)


def _seed() -> int:
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if distributed else 0
    return (_SEED << 40) + (rank << 32) + _step


def _generator(device: torch.device) -> torch.Generator:
    if device not in _generators:
        _generators[device] = torch.Generator(device=device).manual_seed(_seed())
    return _generators[device]

"""What a loss divides its sum over the examples by, read off two gradients on the first batch (torch, no Lightning).

A loss ``L(n) = Σ_{i≤n} l_i / c(n)`` over ``n`` rows has, on ``h`` examples, the gradient
``g_h = Σ_{i≤h} ∇l_i / c(h)``, and on the same ``h`` examples each taken twice (``2h`` rows)
``g_2h = 2·Σ_{i≤h} ∇l_i / c(2h)``, so that

    g_2h = (2·c(h)/c(2h))·g_h:   g_2h = g_h for a mean (c(n) = n),   g_2h = 2·g_h for a sum (c constant).

A constant factor (``sum / 32``, ``mean * 10``, Lightning's ``1/accumulate_grad_batches``) changes neither; a sum
divided by the batch's own size (``loss.sum() / len(x)``) reads as the mean it is. The two gradients tell apart
what the steps' gradients alone can't: where a step's backward passes differ in size (accumulation over an epoch's
short last batch, a sampler of uneven batches), ``|G_B|²`` weighs them by ``1/(n·b_j)`` for a mean and ``1/N`` for
a sum (:mod:`gns_callback.accumulation`), and a sum read as a mean reads B_simple far off with a narrow interval
(breast cancer, batches of 56 and an epoch's last of 9 in steps of 3: 4.34–4.36, 95% CIs about [3.93, 4.86],
against an exact 3.64; ``python benchmarks/loss_reduction.py``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["TOLERANCE", "reduction_of", "reduction_reason"]

#: Largest ``|g_2h − f·g_h| / (f·|g_h|)`` read as rounding (float32 sums over ``h`` and ``2h`` rows: about 1e-7).
TOLERANCE = 1e-3


def reduction_of(once: Sequence[Optional[torch.Tensor]], twice: Sequence[Optional[torch.Tensor]],
                 tolerance: float = TOLERANCE) -> Optional[str]:
    """``"mean"`` where ``twice = once``, ``"sum"`` where ``twice = 2·once`` (within ``tolerance`` of ``|once|``),
    else None (another divisor, such as a square root of the size; a penalty on the parameters added to the loss; a
    zero or non-finite gradient). ``once``: each parameter's gradient on ``h`` examples; ``twice``: on the same
    examples each taken twice (module docstring). None entries (a parameter the pass did not reach) count as 0."""
    pairs = [(a, b) for a, b in zip(once, twice) if a is not None or b is not None]
    if not pairs:
        return None
    a = torch.cat([_flat(x, y) for x, y in pairs])
    b = torch.cat([_flat(y, x) for x, y in pairs])
    norm = float(a.norm())
    if not (norm > 0.0 and torch.isfinite(b).all()) or norm != norm or norm == float("inf"):
        return None
    for factor, name in ((1.0, "mean"), (2.0, "sum")):
        if float((b - factor * a).norm()) <= tolerance * factor * norm:
            return name
    return None


def _flat(value: Optional[torch.Tensor], like: Optional[torch.Tensor]) -> torch.Tensor:
    """``value`` as a float64 vector on the CPU (zeros shaped as ``like`` where None; dense where sparse)."""
    if value is None:
        assert like is not None
        return torch.zeros(like.numel(), dtype=torch.float64)
    value = value.to_dense() if value.is_sparse else value
    return value.detach().reshape(-1).to(device="cpu", dtype=torch.float64)


def reduction_reason(found: str, told: str, examples: int) -> str:
    """The warning where the loss is ``found`` ("mean" or "sum") over the batch and the meter was told ``told``."""
    how = "twice" if found == "sum" else "the same as"
    return (f"the loss is the {found} of its examples' terms over the batch, not their {told}: its gradient on the "
            f"first batch's first {examples} examples each taken twice is {how} on them once. It is measured as "
            f"loss_reduction={found!r}; pass loss_reduction={found!r} to say so (where a step's backward passes differ "
            f"in size, as with an epoch's short last batch and accumulate_grad_batches, a {found} read as a {told} "
            f"weighs them wrongly and reads B_simple off with a narrow interval)")

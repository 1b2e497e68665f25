"""Pure math of the memory search (no torch): a linear memory model and the plan of trials.

Memory of one training step at micro-batch size ``b`` is modelled as

    bytes(b) = fixed + per_sample · b

``fixed`` holds parameters, gradients and optimizer state (and any constant workspace), ``per_sample`` the
activations saved for backward, which grow linearly with the batch. The model is fitted by least squares to a
few small measured steps, and the largest ``b`` with ``bytes(b) ≤ limit`` is predicted and verified with a real
trial. Then:

* A verified size that used clearly less than the limit is extended: the slope at the largest size measured
  predicts again, near the limit, at most twice (:func:`extension`). Memory is not linear down to a few
  samples: on EfficientNet-B0 the fit over 2, 8 and 32 samples charged 8.8 MB a sample where large batches
  take 7.4, and the verified prediction came out 16.7% under the true maximum.
* A failed verification or extension backs off by 2.5%, then by 10%, then bisects between the largest size
  that worked and the smallest that failed. On an H100 a GPT-2-small step at the predicted size failed by
  allocator fragmentation 2% above the truth: the first, small back-off lands within the tolerance.

benchmarks/RESULTS.md, "GPU: the probe against the true largest micro-batch" and "GPU, fourth lease", has
both. This is the approach of DeepSpeed autotuning (memory fitted from measured micro-batch sizes) and
Ultralytics ``autobatch`` (a first-degree polynomial fitted to measured memory at a few batch sizes, solved
for the target fraction of device memory), with the verification and the extension added.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

#: Phases of a memory trial, in the order the planner uses them.
FIT, VERIFY, EXTEND, BACKOFF, BISECT = "fit", "verify", "extend", "backoff", "bisect"

#: Fractions the search backs off by after a failed verification or extension, in turn, before it bisects.
BACKOFFS = (0.025, 0.1)

#: An extension aims its secant at this fraction of the limit (a size just at the limit fails by a hair as
#: often as it fits), and is tried only if it adds more than ``EXTEND_MIN_GAIN`` to the largest size that ran.
EXTEND_AIM = 0.99
EXTEND_MIN_GAIN = 0.01
MAX_EXTENDS = 2


@dataclass(frozen=True)
class LinearMemoryModel:
    """``bytes(b) = fixed_bytes + bytes_per_sample · b``."""

    fixed_bytes: float
    bytes_per_sample: float

    def predict(self, size: int) -> float:
        return self.fixed_bytes + self.bytes_per_sample * size

    def max_batch(self, limit_bytes: float, cap: int) -> int:
        """Largest ``b`` in ``[0, cap]`` with ``fixed + per_sample·b ≤ limit``: ``⌊(limit − fixed)/per_sample⌋``."""
        if self.fixed_bytes > limit_bytes:
            return 0
        if self.bytes_per_sample <= 0:
            return cap
        return int(max(0, min(cap, math.floor((limit_bytes - self.fixed_bytes) / self.bytes_per_sample))))


def fit_linear(sizes: Sequence[int], measured_bytes: Sequence[float]) -> LinearMemoryModel:
    """Least-squares fit of ``bytes = fixed + per_sample·b``.

    With one point (or all points at one size) the model is ``fixed = 0, per_sample = bytes/b``: it charges the
    fixed part to every sample, so it can only under-predict the largest batch (safe side). A negative slope
    (noise) is clamped to 0 and a negative intercept to 0 with the slope refitted through the origin.
    """
    if len(sizes) != len(measured_bytes) or not sizes:
        raise ValueError("fit_linear needs as many sizes as measurements, and at least one.")
    n = len(sizes)
    mean_b = sum(sizes) / n
    mean_y = sum(measured_bytes) / n
    sxx = sum((b - mean_b) ** 2 for b in sizes)
    if sxx == 0:
        return LinearMemoryModel(0.0, mean_y / mean_b if mean_b > 0 else 0.0)
    slope = sum((b - mean_b) * (y - mean_y) for b, y in zip(sizes, measured_bytes)) / sxx
    if slope < 0:
        return LinearMemoryModel(max(mean_y, 0.0), 0.0)
    intercept = mean_y - slope * mean_b
    if intercept < 0:
        slope = sum(b * y for b, y in zip(sizes, measured_bytes)) / sum(b * b for b in sizes)
        intercept = 0.0
    return LinearMemoryModel(intercept, slope)


class MemoryTrial(Protocol):
    """What the planner reads from a finished trial (:class:`gns_callback.probe.result.Trial` has it)."""

    size: int
    phase: str
    ok: bool
    measured_bytes: Optional[float]


def bracket(trials: Sequence[MemoryTrial], cap: int) -> tuple[int, int]:
    """``(lo, hi)``: the largest size that worked (0 if none) and the smallest that failed (``cap + 1`` if none).

    Memory is assumed monotone in ``b``, so every size in ``(lo, hi)`` is still undecided.
    """
    lo = max((t.size for t in trials if t.ok), default=0)
    hi = min((t.size for t in trials if not t.ok), default=cap + 1)
    return lo, hi


def converged(lo: int, hi: int, rel_tol: float) -> bool:
    """Stop when the undecided gap is at most ``max(1, ⌊rel_tol·lo⌋)`` sizes."""
    return hi - lo <= max(1, math.floor(rel_tol * lo))


def next_trial(
    trials: Sequence[MemoryTrial],
    *,
    fit_sizes: Sequence[int],
    limit_bytes: float,
    cap: int,
    rel_tol: float = 0.05,
    backoffs: Sequence[float] = BACKOFFS,
) -> Optional[tuple[int, str]]:
    """The next ``(size, phase)`` to try, or ``None`` when the search is done (answer: ``bracket(...)[0]``).

    1. ``fit``: the small ``fit_sizes`` in increasing order, stopping at the first failure.
    2. ``verify``: one real step at the size the linear fit predicts (clamped into the open bracket).
    3. ``extend``: while nothing has failed above it, the largest size that ran predicts again by the secant
       (:func:`extension`), at most ``MAX_EXTENDS`` times.
    4. ``backoff``: after a failed verification or extension, ``⌊(1 − backoffs[i])·hi⌋`` for each ``i`` in
       turn until one works: predictions are usually close, so the first back-off is small.
    5. ``bisect``: midpoint of ``(lo, hi)`` until :func:`converged`.
    """
    lo, hi = bracket(trials, cap)
    if hi <= 1:  # even a single sample failed
        return None
    tried = {t.size for t in trials}
    phases = {t.phase for t in trials}
    if not phases & {VERIFY, EXTEND, BACKOFF, BISECT}:
        for size in sorted({min(int(s), cap) for s in fit_sizes if s >= 1}):
            if size not in tried and size < hi:
                return size, FIT
        measured = [(t.size, t.measured_bytes) for t in trials if t.ok and t.measured_bytes is not None]
        if measured:
            prediction = fit_linear([s for s, _ in measured], [y for _, y in measured]).max_batch(limit_bytes, cap)
        else:
            prediction = (lo + hi) // 2
        prediction = min(prediction, hi - 1)
        if prediction > lo and prediction not in tried:
            return prediction, VERIFY
    # Refine only below a size that really failed: after a verified prediction with nothing failing above it
    # (or a prediction at or below a size that worked) the search extends upward or is done.
    if hi > cap:
        candidate = extension(trials, limit_bytes, cap)
        return (candidate, EXTEND) if candidate is not None and candidate not in tried else None
    if converged(lo, hi, rel_tol):
        return None
    candidate = _backoff(trials, lo, hi, backoffs)
    if candidate is not None and candidate not in tried:
        return candidate, BACKOFF
    return (lo + hi) // 2, BISECT


def extension(trials: Sequence[MemoryTrial], limit_bytes: float, cap: int) -> Optional[int]:
    """The size the slope at the largest measured size that ran predicts at ``EXTEND_AIM × limit``:

        b = b₂ + ⌊(EXTEND_AIM · limit − m₂) / slope⌋,   slope = max((m₂ − m₁)/(b₂ − b₁), (m₂ − m₀)/(b₂ − b₀))

    with ``(b₁, m₁)`` the next largest and ``(b₀, m₀)`` the smallest size measured. The local secant reads the
    slope where the answer lies; the long one bounds it from below, because near the limit cuDNN takes
    convolution algorithms with smaller workspaces, and memory can then grow far slower than the activations
    (EfficientNet-B0 on an H100: 1.2 MB a sample between 9,608 and 10,482, against 7.4 on average).

    ``None`` before a verified prediction, after ``MAX_EXTENDS`` extensions, when the slope is not positive,
    or when the gain over ``b₂`` is at most ``EXTEND_MIN_GAIN`` (a prediction that was already close).
    """
    if not any(t.phase == VERIFY and t.ok for t in trials) or sum(t.phase == EXTEND for t in trials) >= MAX_EXTENDS:
        return None
    measured = sorted((t.size, t.measured_bytes) for t in trials if t.ok and t.measured_bytes is not None)
    if len(measured) < 2:
        return None
    (b0, m0), (b1, m1), (b2, m2) = measured[0], measured[-2], measured[-1]
    slope = max((m2 - m1) / (b2 - b1), (m2 - m0) / (b2 - b0))
    if slope <= 0:
        return None
    candidate = min(cap, b2 + math.floor((EXTEND_AIM * limit_bytes - m2) / slope))
    return candidate if candidate > b2 * (1.0 + EXTEND_MIN_GAIN) else None


def _backoff(trials: Sequence[MemoryTrial], lo: int, hi: int, backoffs: Sequence[float]) -> Optional[int]:
    """The next back-off below the smallest failure ``hi``, while the verification (or an extension) and
    every back-off so far failed and back-offs are left; else ``None``."""
    if not any(t.phase in (VERIFY, EXTEND) and not t.ok for t in trials):
        return None
    done = [t for t in trials if t.phase == BACKOFF]
    if any(t.ok for t in done) or len(done) >= len(backoffs):
        return None
    candidate = math.floor((1.0 - backoffs[len(done)]) * hi)
    return candidate if lo < candidate < hi else None


def throughput_ladder(max_size: int, count: int = 4) -> list[int]:
    """``max_size`` and the powers of two below it, the ``count`` largest, increasing (e.g. 12 → [2, 4, 8, 12])."""
    if max_size < 1 or count < 1:
        return []
    sizes = {max_size}
    power = 1
    while power < max_size:
        sizes.add(power)
        power *= 2
    return sorted(sizes)[-count:]

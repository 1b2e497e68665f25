"""Which global batch, and its ``micro × accumulate`` split per device.

A trusted estimate aims at ``B ≈ B_simple`` (McCandlish et al.'s knee, ``S/S_min = E/E_min = 2``), clipped to
``[min_batch_size, min(max_batch_size, dataset_size)]`` and moved to the nearest grid size that splits over the
devices under the micro-batch cap (see :mod:`.sizing`). An untrusted one keeps the current batch and only
re-splits it under the cap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from gns_callback.recommendation.current import CurrentSetup
from gns_callback.recommendation.sizing import candidates, split, split_keeping

#: How far (relative) from the nearest grid size a batch may move to keep the fewest accumulation steps.
_STRICT_WINDOW = 0.10


@dataclass(frozen=True)
class Bounds:
    """``lo ≤ B ≤ hi`` for the global batch; ``hi_is_dataset``: the upper bound is the data-set size."""

    lo: int
    hi: float
    hi_is_dataset: bool
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Grid:
    """Global batches are multiples of ``multiple_of`` (and powers of two when ``power_of_two``)."""

    multiple_of: int = 8
    power_of_two: bool = False


@dataclass(frozen=True)
class BatchChoice:
    """The global batch aimed at (``target``), the one chosen, its split per device, and notes on the way."""

    target: float
    batch_size: int
    micro_batch_size: int
    accumulate: int
    notes: tuple[str, ...]


def batch_bounds(min_batch_size: Optional[int], max_batch_size: Optional[int], dataset_size: Optional[int]) -> Bounds:
    """``[max(1, min_batch_size), min(max_batch_size, dataset_size)]``; an empty range collapses to its top."""
    lo = max(1, min_batch_size or 1)
    hi: float = math.inf if max_batch_size is None else max_batch_size
    from_dataset = dataset_size is not None and dataset_size < hi
    if from_dataset:
        hi = dataset_size
    if lo > hi:
        note = f"min_batch_size {lo} above the upper bound {hi:g}: using the upper bound"
        return Bounds(int(hi), hi, from_dataset, (note,))
    return Bounds(lo, hi, from_dataset)


def aim(b_simple: float, bounds: Bounds, grid: Grid, current: CurrentSetup, micro_cap: Optional[int],
        what: str = "B_simple") -> BatchChoice:
    """The batch for a trusted estimate: ``B_simple`` within the bounds, on the grid, split under the cap.
    ``what``: the value aimed at, as the notes name it (the interval's near end for a wide interval)."""
    notes = list(bounds.notes)
    if b_simple < bounds.lo:
        notes.append(f"{what} = {b_simple:.4g} is below the lower bound {bounds.lo}: raised to it")
    elif b_simple > bounds.hi:
        why = "the data-set size" if bounds.hi_is_dataset else "max_batch_size"
        notes.append(f"{what} = {b_simple:.4g} is above {why} ({bounds.hi:g}): clipped")
    size, (micro, accum), more = nearest_splitting(b_simple, bounds.lo, bounds.hi, current.num_devices, micro_cap, grid)
    return BatchChoice(b_simple, size, micro, accum, tuple(notes) + more)


def keep(bounds: Bounds, current: CurrentSetup, micro_cap: Optional[int]) -> BatchChoice:
    """The batch for an untrusted estimate: the current one, re-split under the cap (the smallest change that
    divides over the devices when it does not)."""
    batch = current.batch_size
    notes = list(bounds.notes)
    parts = split_keeping(batch, current.num_devices, micro_cap)
    if parts is None:
        batch, parts, more = nearest_splitting(float(batch), 1, math.inf, current.num_devices, micro_cap, Grid(1))
        notes += more
    micro, accum = parts
    if current.micro_batch_size is not None and micro != current.micro_batch_size:
        notes.append(
            f"batch size kept; micro-batch {current.micro_batch_size} → {micro} (accumulate {current.accumulate} → "
            f"{accum})"
        )
    return BatchChoice(float(current.batch_size), batch, micro, accum, tuple(notes))


def _grids(grid: Grid) -> list[tuple[int, bool, str]]:
    """The grid asked for, then the coarser fallbacks: multiples of ``multiple_of``, then any size."""
    grids = []
    if grid.power_of_two:
        grids.append((grid.multiple_of, True, "a power of two"))
    grids.append((grid.multiple_of, False, f"a multiple of {grid.multiple_of}"))
    if grid.multiple_of != 1:
        grids.append((1, False, "any size"))
    return grids


def _first_split(
    target: float, lo: int, hi: float, num_devices: int, micro_cap: Optional[int], step: int, pow2: bool
) -> Optional[tuple[int, tuple[int, int]]]:
    """On one grid: the nearest size splitting strictly within the window around the nearest grid size, else
    the nearest size with a relaxed split (see :func:`~gns_callback.recommendation.sizing.split`)."""
    first = next(candidates(target, lo, hi, step, pow2), None)
    if first is None:
        return None
    window = abs(first - target) + _STRICT_WINDOW * first
    for size in candidates(target, lo, hi, step, pow2):
        if abs(size - target) > window:
            break
        parts = split(size, num_devices, micro_cap)
        if parts is not None:
            return size, parts
    for size in candidates(target, lo, hi, step, pow2):
        parts = split(size, num_devices, micro_cap, strict=False)
        if parts is not None:
            return size, parts
    return None


def _off_grid_note(target: float, lo: int, hi: float, asked: tuple[int, bool, str], label: str) -> str:
    """Why the batch is off the grid asked for: the bounds hold no size on it, or none of those splits."""
    step, pow2, what = asked
    if next(candidates(target, lo, hi, step, pow2), None) is None:
        return f"no size in [{lo}, {hi:g}] (the batch-size bounds) is {what}: using {label}"
    return f"no size in range that is {what} splits over the devices: using {label}"


def nearest_splitting(
    target: float, lo: int, hi: float, num_devices: int, micro_cap: Optional[int], grid: Grid
) -> tuple[int, tuple[int, int], tuple[str, ...]]:
    """``(size, (micro, accumulate), notes)``: the grid size nearest ``target`` that splits over the devices.

    >>> nearest_splitting(256.0, 1, 1000.0, 1, 48, Grid(8))[:2]
    (264, (44, 6))
    """
    grids = _grids(grid)
    nearest = None
    for i, (step, pow2, label) in enumerate(grids):
        nearest = nearest if nearest is not None else next(candidates(target, lo, hi, step, pow2), None)
        found = _first_split(target, lo, hi, num_devices, micro_cap, step, pow2)
        if found is None:
            continue
        size, (micro, accum) = found
        notes = []
        if i > 0:
            notes.append(_off_grid_note(target, lo, hi, grids[0], label))
        if size != nearest:
            notes.append(
                f"global batch adjusted from {nearest} to {size} so that micro × accumulate × devices = "
                f"{micro} × {accum} × {num_devices} divides exactly"
            )
        return size, (micro, accum), tuple(notes)
    # Nothing in [lo, hi] splits (hi below the device count): one example per device.
    note = f"no batch size in [{lo}, {hi:g}] splits over {num_devices} devices: using one per device"
    return num_devices, (1, 1), (note,)

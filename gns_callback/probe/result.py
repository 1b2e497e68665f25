"""What the probe returns: :class:`ProbeResult` (with its :class:`Trial` log), JSON-safe both ways."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

from gns_callback.json_values import json_safe
from gns_callback.probe.split import SplitResult
from gns_callback.probe.timing import Timing, faster


def _bytes(n: Optional[float]) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


@dataclass
class Trial:
    """One probe step (or group of steps) at one micro-batch size.

    Attributes:
        size: micro-batch size tried.
        ok: it ran and its measured bytes were within ``headroom × budget``.
        measured_bytes: the step's bytes (CUDA peak or accounting); ``None`` when it raised an OOM or was stopped
            early for exceeding the budget.
        phase: ``fit``, ``verify``, ``extend``, ``backoff``, ``bisect`` (memory search), ``throughput`` or
            ``confirm`` (after the ranks agreed), ``split`` (split-factor search).
        split: ``batch_split_factor`` set during the trial (split search only).
        error: why it failed (the OOM message, or ``"over budget"``).
        timing: its repeated timing on this rank (:class:`~gns_callback.probe.timing.Timing`), when timed.
    """

    size: int
    ok: bool
    measured_bytes: Optional[int] = None
    phase: str = "fit"
    split: Optional[int] = None
    error: Optional[str] = None
    timing: Optional[Timing] = None

    @property
    def samples_per_s(self) -> Optional[float]:
        """``size`` over the median step time, when timed."""
        return None if self.timing is None else self.timing.samples_per_s(self.size)

    @property
    def step_seconds(self) -> Optional[float]:
        """Median forward+backward seconds of one micro-batch, when timed."""
        return None if self.timing is None else self.timing.step_seconds

    @property
    def optimizer_seconds(self) -> Optional[float]:
        """Median optimizer-step seconds, when timed."""
        return None if self.timing is None else self.timing.optimizer_seconds

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe; ``samples_per_s`` is written out for readers that do not parse ``timing``."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "timing"}
        data["samples_per_s"] = self.samples_per_s
        data["timing"] = None if self.timing is None else self.timing.to_dict()
        return json_safe(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Trial":
        names = {f.name for f in fields(cls)} - {"timing"}
        return cls(**{k: v for k, v in data.items() if k in names}, timing=_timing_from(data.get("timing"), data))


def _timing_from(timing: Optional[dict[str, Any]], row: dict[str, Any]) -> Optional[Timing]:
    """A stored timing; rows written before timings were repeated carry only step/optimizer seconds."""
    if timing is not None:
        return Timing.from_dict(timing)
    if row.get("step_seconds") is not None:
        return Timing.single(row["step_seconds"], row.get("optimizer_seconds") or 0.0)
    return None


@dataclass
class ProbeResult:
    """The largest micro-batch that fits, the memory model behind it, and throughput per micro-batch size.

    Attributes:
        max_micro_batch: largest size that ran within ``headroom × budget_bytes`` (0: not even one sample);
            always a size that was actually tried. Under DDP the minimum over ranks. ``None``: not measured.
        fixed_bytes, bytes_per_sample: the fitted ``bytes(b) = fixed + per_sample·b`` (DDP: the largest over
            ranks); ``None`` when nothing could be fitted.
        budget_bytes: the memory budget (DDP: the smallest over ranks; ``None``: not measured);
            ``headroom``: the usable fraction.
        device: e.g. ``"cuda:0"``; ``measure``: ``"cuda"`` (allocator peak) or ``"accounting"``.
        trials: this rank's trials in order (they may differ between ranks; the fields above do not).
        timings: repeated timing per micro-batch size (DDP: the slowest rank's), ``{size: Timing}``: median
            step time, its 95% interval, spread and repeats (:mod:`gns_callback.probe.timing`);
            :attr:`throughput` reads samples/s off it, :meth:`faster` compares two sizes beyond the noise.
        capped: ``max_micro_batch`` was limited by ``max_batch_size``, not by memory.
        world_size: number of ranks that agreed on the result.
        split: the split-factor/accumulation search, when requested.
        error: why the probe measured nothing (it stepped aside and left the run as it was), else ``None``.
        not_restored: module attributes a probe step changed that could not be put back (named, and warned).
        wall_seconds: what the probe cost this rank, start to end (memory search, timing, restores);
            ``timing_seconds``: the throughput timing's share.
    """

    max_micro_batch: Optional[int]
    fixed_bytes: Optional[float]
    bytes_per_sample: Optional[float]
    budget_bytes: Optional[int]
    headroom: float
    device: str
    measure: str
    trials: list[Trial] = field(default_factory=list)
    timings: dict[int, Timing] = field(default_factory=dict)
    capped: bool = False
    world_size: int = 1
    split: Optional[SplitResult] = None
    error: Optional[str] = None
    not_restored: list[str] = field(default_factory=list)
    wall_seconds: Optional[float] = None
    timing_seconds: Optional[float] = None

    @classmethod
    def not_measured(cls, reason: str, *, device: str, headroom: float, world_size: int = 1) -> "ProbeResult":
        """A probe that stepped aside: no size, no budget, no throughput; ``reason`` says why."""
        return cls(None, None, None, None, headroom, device, "none", world_size=world_size, error=reason)

    @property
    def measured(self) -> bool:
        """False when the probe stepped aside (see ``error``)."""
        return self.max_micro_batch is not None

    @property
    def limit_bytes(self) -> Optional[float]:
        """``headroom × budget_bytes``: what a step may use."""
        return None if self.budget_bytes is None else self.headroom * self.budget_bytes

    @property
    def throughput(self) -> dict[int, float]:
        """Samples/s per timed micro-batch size, ``{size: size / median step seconds}``."""
        table = {size: timing.samples_per_s(size) for size, timing in self.timings.items()}
        return {size: value for size, value in table.items() if value is not None}

    def faster(self, a: int, b: int) -> Optional[bool]:
        """Is micro-batch ``a`` faster than ``b`` beyond the measured noise? ``None``: they cannot be told apart
        (their samples/s intervals overlap, or either has too few repeats for one)."""
        for size in (a, b):
            if size not in self.timings:
                raise ValueError(f"micro-batch {size} was not timed; timed sizes: {sorted(self.timings)}.")
        return faster(a, self.timings[a], b, self.timings[b])

    @property
    def fastest_micro_batch(self) -> Optional[int]:
        """The largest timed size that no other is faster than beyond the noise (``None`` if nothing was timed).

        The size with the highest median samples/s, or a larger one that cannot be told apart from it: within
        the noise, fewer accumulation steps win."""
        table = self.throughput
        if not table:
            return None
        best = max(table, key=lambda s: (table[s], s))
        return max(s for s in table if s == best or self.faster(best, s) is not True)

    def summary(self) -> str:
        """One line for the log (print it on rank zero)."""
        if not self.measured:
            return f"probe on {self.device}: not measured ({self.error})"
        line = (
            f"probe on {self.device} ({self.measure}): max micro-batch {self.max_micro_batch}"
            f"{' (capped)' if self.capped else ''} within {self.headroom:g} × {_bytes(self.budget_bytes)}"
        )
        if self.fixed_bytes is not None and self.bytes_per_sample is not None:
            line += f"; memory ≈ {_bytes(self.fixed_bytes)} + {_bytes(self.bytes_per_sample)}/sample"
        line += f"; {len(self.trials)} trials"
        fastest = self.fastest_micro_batch
        if fastest is not None:
            line += f"; fastest {fastest} at {_rate(fastest, self.timings[fastest])}"
        if self.split is not None and self.split.best is not None:
            b = self.split.best
            line += f"; split search: micro {b.micro_batch} × accumulate {b.accumulate} × split {b.split}"
        if self.not_restored:
            line += f"; not restored: {', '.join(self.not_restored)}"
        if self.wall_seconds is not None:
            line += f"; took {self.wall_seconds:.2g} s"
        return line

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe (non-finite floats become ``None``; throughput as a list of pairs)."""
        return {
            "measured": self.measured,
            "error": self.error,
            "max_micro_batch": self.max_micro_batch,
            "fixed_bytes": json_safe(self.fixed_bytes),
            "bytes_per_sample": json_safe(self.bytes_per_sample),
            "budget_bytes": self.budget_bytes,
            "headroom": self.headroom,
            "device": self.device,
            "measure": self.measure,
            "capped": self.capped,
            "world_size": self.world_size,
            "throughput": [_timing_row(s, t) for s, t in sorted(self.timings.items())],
            "trials": [t.to_dict() for t in self.trials],
            "split": None if self.split is None else self.split.to_dict(),
            "not_restored": list(self.not_restored),
            "wall_seconds": json_safe(self.wall_seconds),
            "timing_seconds": json_safe(self.timing_seconds),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ProbeResult":
        return cls(
            max_micro_batch=_int_or_none(data.get("max_micro_batch")),
            fixed_bytes=data.get("fixed_bytes"),
            bytes_per_sample=data.get("bytes_per_sample"),
            budget_bytes=_int_or_none(data.get("budget_bytes")),
            headroom=float(data["headroom"]),
            device=data["device"],
            measure=data["measure"],
            trials=[Trial.from_dict(t) for t in data.get("trials", [])],
            timings={int(row["size"]): _row_timing(row) for row in data.get("throughput", [])
                     if row.get("seconds") is not None or row.get("samples_per_s")},
            capped=bool(data.get("capped", False)),
            world_size=int(data.get("world_size", 1)),
            split=None if data.get("split") is None else SplitResult.from_dict(data["split"]),
            error=data.get("error"),
            not_restored=list(data.get("not_restored", [])),
            wall_seconds=data.get("wall_seconds"),
            timing_seconds=data.get("timing_seconds"),
        )


def _int_or_none(value: Any) -> Optional[int]:
    return None if value is None else int(value)


def _rate(size: int, timing: Timing) -> str:
    """``"9,200 samples/s (±4%, 40 repeats)"``."""
    text = f"{timing.samples_per_s(size) or 0:,.0f} samples/s"
    width = timing.rel_halfwidth
    noise = f"±{width:.0%}, " if width is not None else ""
    return f"{text} ({noise}{timing.repeats} repeats)"


def _timing_row(size: int, timing: Timing) -> dict[str, Any]:
    """One ``throughput`` row: the size, samples/s and its interval (what readers use), and the timing."""
    interval = timing.samples_per_s_interval(size)
    low, high = interval if interval else (None, None)
    row = {"size": size, "samples_per_s": timing.samples_per_s(size), "samples_per_s_low": low,
           "samples_per_s_high": high}
    return json_safe({**row, **timing.to_dict()})


def _row_timing(row: dict[str, Any]) -> Timing:
    """A ``throughput`` row back; rows written before timings were repeated hold only ``samples_per_s``."""
    if row.get("seconds") is not None:
        return Timing.from_dict(row)
    return Timing.single(int(row["size"]) / float(row["samples_per_s"]))

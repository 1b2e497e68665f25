"""What the probe returns: :class:`ProbeResult` (with its :class:`Trial` log), JSON-safe both ways."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

from gns_callback.json_values import json_safe
from gns_callback.probe.split import SplitResult


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
        samples_per_s: ``size / (step_seconds + optimizer_seconds)``, when timed.
        phase: ``fit``, ``verify``, ``backoff``, ``bisect`` (memory search), ``throughput``/``confirm`` (after
            the ranks agreed), ``split`` (split-factor search).
        split: ``batch_split_factor`` set during the trial (split search only).
        step_seconds: mean forward+backward time of one micro-batch (steady state, warm-up excluded).
        optimizer_seconds: time of one optimizer step.
        error: why it failed (the OOM message, or ``"over budget"``).
    """

    size: int
    ok: bool
    measured_bytes: Optional[int] = None
    samples_per_s: Optional[float] = None
    phase: str = "fit"
    split: Optional[int] = None
    step_seconds: Optional[float] = None
    optimizer_seconds: Optional[float] = None
    error: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return {k: json_safe(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Trial":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


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
        throughput: samples/s per micro-batch size (DDP: the slowest rank's), ``{size: samples_per_s}``.
        capped: ``max_micro_batch`` was limited by ``max_batch_size``, not by memory.
        world_size: number of ranks that agreed on the result.
        split: the split-factor/accumulation search, when requested.
        error: why the probe measured nothing (it stepped aside and left the run as it was), else ``None``.
        not_restored: module attributes a probe step changed that could not be put back (named, and warned).
    """

    max_micro_batch: Optional[int]
    fixed_bytes: Optional[float]
    bytes_per_sample: Optional[float]
    budget_bytes: Optional[int]
    headroom: float
    device: str
    measure: str
    trials: list[Trial] = field(default_factory=list)
    throughput: dict[int, float] = field(default_factory=dict)
    capped: bool = False
    world_size: int = 1
    split: Optional[SplitResult] = None
    error: Optional[str] = None
    not_restored: list[str] = field(default_factory=list)

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
    def fastest_micro_batch(self) -> Optional[int]:
        """The measured size with the highest samples/s (``None`` if throughput was not measured)."""
        return max(self.throughput, key=lambda s: (self.throughput[s], s)) if self.throughput else None

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
            line += f"; fastest {fastest} at {self.throughput[fastest]:,.0f} samples/s"
        if self.split is not None and self.split.best is not None:
            b = self.split.best
            line += f"; split search: micro {b.micro_batch} × accumulate {b.accumulate} × split {b.split}"
        if self.not_restored:
            line += f"; not restored: {', '.join(self.not_restored)}"
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
            "throughput": [{"size": s, "samples_per_s": json_safe(v)} for s, v in sorted(self.throughput.items())],
            "trials": [t.to_dict() for t in self.trials],
            "split": None if self.split is None else self.split.to_dict(),
            "not_restored": list(self.not_restored),
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
            throughput={int(p["size"]): p["samples_per_s"] for p in data.get("throughput", [])},
            capped=bool(data.get("capped", False)),
            world_size=int(data.get("world_size", 1)),
            split=None if data.get("split") is None else SplitResult.from_dict(data["split"]),
            error=data.get("error"),
            not_restored=list(data.get("not_restored", [])),
        )


def _int_or_none(value: Any) -> Optional[int]:
    return None if value is None else int(value)

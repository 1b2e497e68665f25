"""Report sections for the report-command and plot tests: estimates, a history, two probes, a whole report."""

from __future__ import annotations

import math
import random
from typing import Any

from gns_callback.recommendation import recommend

MiB, GiB = 2**20, 2**30


def estimate(b=76.4, lo=62.5, hi=98.0, steps=1000, averaging="run") -> dict:
    """A ``GNSEstimate.to_dict()``."""
    return {"b_simple": b, "grad_sq_norm": 0.09, "trace_sigma": 0.09 * b if b else 0.0, "ci_low": lo, "ci_high": hi,
            "confidence": 0.95, "steps": steps, "skipped_steps": 0, "effective_steps": float(steps),
            "method": "per_example", "averaging": averaging}


def history(n: int = 40, seed: int = 0, final: bool = True) -> list[dict]:
    """B_simple growing during training, its interval shrinking, unbounded (null) at first; the fit-end entry
    last, as the callback appends it."""
    rng = random.Random(seed)
    rows = []
    for i in range(1, n + 1):
        b = 40 + 2.0 * i + rng.gauss(0, 4)
        half = 2.5 / math.sqrt(i)
        rows.append({"step": 25 * i, "b_simple": None if i == 1 else b, "ci_low": b / (1 + half),
                     "ci_high": None if i <= 3 else b * (1 + half), "b_simple_run": 40.0 + i})
    if final:
        rows.append({**rows[-1], "step": 25 * n + 7, "b_simple": rows[-1]["b_simple"] * 1.1, "final": True})
    return rows


def cpu_probe() -> dict:
    """``python -m gns_callback demo`` on the 2-core CPU machine: accounting bytes, 22.9 GiB budget, the search
    stopped by its 65536 cap."""
    sizes = [2, 8, 32, 64, 128, 256, 512, 1024, 65536]
    trials = [{"size": s, "ok": True, "measured_bytes": 313468 + 1328 * s, "samples_per_s": None, "phase": "fit",
               "split": None, "step_seconds": None, "optimizer_seconds": None, "error": None} for s in sizes]
    throughput = {32: 99044.2, 64: 177005.3, 128: 282220.2, 256: 384129.7, 512: 480183.7, 1024: 542681.4,
                  65536: 306768.9}
    return {"max_micro_batch": 65536, "fixed_bytes": 313468.0, "bytes_per_sample": 1328.0,
            "budget_bytes": 24597403688, "headroom": 0.85, "device": "cpu", "measure": "accounting",
            "capped": True, "world_size": 1,
            "throughput": [{"size": s, "samples_per_s": v} for s, v in throughput.items()],
            "trials": trials, "split": None}


def gpu_probe() -> dict:
    """1.2 GiB + 40 MiB/sample under an 8 GiB budget (headroom 0.9); 256 runs out of memory."""
    trials = []
    for s in (8, 16, 32, 64, 128, 256):
        ok = s <= 128
        trials.append({"size": s, "ok": ok, "measured_bytes": int(1.2 * GiB + 40 * MiB * s) if ok else None,
                       "samples_per_s": 3000 * s / (s + 24) if ok else None, "phase": "fit", "split": None,
                       "step_seconds": None, "optimizer_seconds": None, "error": None if ok else "out of memory"})
    throughput = [{"size": t["size"], "samples_per_s": t["samples_per_s"]} for t in trials if t["ok"]]
    return {"max_micro_batch": 128, "fixed_bytes": 1.2 * GiB, "bytes_per_sample": 40.0 * MiB,
            "budget_bytes": 8 * GiB, "headroom": 0.9, "device": "cuda:0", "measure": "cuda", "capped": False,
            "world_size": 1, "throughput": throughput, "trials": trials, "split": None}


#: What the callback passed to ``recommend`` for :func:`report` (batch 16 = micro 8 × accumulate 2, SGD).
CALLBACK_INPUTS: dict[str, Any] = dict(current_batch_size=16, current_lr=0.1, optimizer="SGD", num_devices=1,
                                       current_micro_batch_size=8, current_accumulate=2, dataset_size=1797)


def report(run_estimate: dict | None = None, **recommend_kwargs: Any) -> dict:
    """A report with every section, its recommendation made from ``run_estimate`` as the callback would."""
    run_est = run_estimate or estimate()
    probe = gpu_probe()
    inputs = {**CALLBACK_INPUTS, **recommend_kwargs}
    rec = recommend(run_est, probe=probe, **inputs)
    return {"report_version": 1, "estimate": estimate(110.0, 80.0, 160.0, averaging="ema"), "run_estimate": run_est,
            "history": history(), "probe": probe, "recommendation": rec.to_dict(),
            "config": {"method": "per_example", "ema_decay": 0.99, "confidence": 0.95},
            "run": {"world_size": inputs["num_devices"], "accumulate_grad_batches": inputs["current_accumulate"],
                    "precision": "32-true", "global_step": 1000}}

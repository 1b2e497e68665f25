"""A synthetic GNS report with every section the plots read (estimate, history, probe, recommendation)."""

from __future__ import annotations

import math
import random

import torch

from gns_callback.recommendation import recommend

MiB, GiB = 2**20, 2**30


def synthetic_estimate(b=76.4, lo=62.5, hi=98.0, steps=1000, averaging="run") -> dict:
    return {
        "b_simple": b, "grad_sq_norm": 0.09, "trace_sigma": 0.09 * b if b else 0.0, "ci_low": lo, "ci_high": hi,
        "confidence": 0.95, "steps": steps, "skipped_steps": 0, "effective_steps": float(steps),
        "method": "per_example", "averaging": averaging,
    }


def synthetic_history(n: int = 40, seed: int = 0) -> list[dict]:
    """B_simple growing during training, the interval shrinking, unbounded (null) at the start."""
    rng = random.Random(seed)
    rows = []
    for i in range(1, n + 1):
        b = 40 + 2.0 * i + rng.gauss(0, 4)
        half = 2.5 / math.sqrt(i)
        rows.append({
            "step": 25 * i,
            "b_simple": None if i == 1 else b,
            "ci_low": b / (1 + half),
            "ci_high": None if i <= 3 else b * (1 + half),
            "b_simple_run": 40.0 + i,
        })
    return rows


def synthetic_probe() -> dict:
    """The probe section in the shape of ``ProbeResult.to_dict()``: memory 1.2 GiB + 40 MiB/sample under an 8 GiB
    budget (headroom 0.9), 256 runs out of memory, throughput saturating with the micro-batch size."""
    trials = []
    for s in (8, 16, 32, 64, 128, 256):
        ok = s <= 128
        trials.append({
            "size": s, "ok": ok, "measured_bytes": int(1.2 * GiB + 40 * MiB * s) if ok else None,
            "samples_per_s": 3000 * s / (s + 24) if ok else None, "phase": "fit", "split": None,
            "step_seconds": None, "optimizer_seconds": None, "error": None if ok else "CUDA out of memory",
        })
    throughput = [{"size": t["size"], "samples_per_s": t["samples_per_s"]} for t in trials if t["ok"]]
    return {"max_micro_batch": 128, "fixed_bytes": 1.2 * GiB, "bytes_per_sample": 40.0 * MiB,
            "budget_bytes": 8 * GiB, "headroom": 0.9, "device": "cuda:0", "measure": "cuda", "capped": False,
            "world_size": 1, "throughput": throughput, "trials": trials, "split": None}


def synthetic_report() -> dict:
    est = synthetic_estimate()
    probe = synthetic_probe()
    rec = recommend(est, current_batch_size=16, current_lr=0.1, optimizer=torch.optim.SGD, current_accumulate=2,
                    dataset_size=1797, probe=probe, price_per_device_hour=2.5)
    return {
        "report_version": 1,
        "estimate": synthetic_estimate(b=110.0, lo=80.0, hi=160.0, averaging="ema"),
        "run_estimate": est,
        "history": synthetic_history(),
        "probe": probe,
        "recommendation": rec.to_dict(),
        "run": {"world_size": 1, "accumulate_grad_batches": 2, "precision": "32-true", "global_step": 1000},
    }

#!/usr/bin/env python
"""On a CUDA GPU: the probe's predicted largest micro-batch against the truth, and a run with the probe against
one without it, bit for bit.

    python benchmarks/gpu_probe_truth.py --json probe_truth.json          # on the GPU machine (~3 min on an H100)
    python benchmarks/gpu_probe_truth.py --from-json probe_truth.json --out benchmarks/RESULTS.md

Two real models, each with its optimizer state created by two real steps first (as in a run):

* EfficientNet-B0 at 32×32 (``benchmarks/cifar10``: timm's when it imports), LAMB, CIFAR-shaped input;
* a GPT-style decoder (GPT-2 small: 12 layers, d 768, 12 heads, vocab 50257, causal SDPA attention), sequence
  length 512, AdamW.

**Truth** is an exhaustive search: full training steps (zero_grad, forward, backward, optimizer step; two steps
per size) at doubling sizes until a real CUDA out-of-memory error, then bisection to the exact integer: the
largest size that runs. **The probe** is ``probe_micro_batch`` with the device's free memory as the budget,
``headroom=1.0`` (the claim compared with the truth) and then at its default headroom 0.85; the rows give its
answer, its error against the truth, and how many real trials verified it after the memory fit.

**Bit identity**: the same seeded training steps (dropout, BatchNorm, AdamW/LAMB) with and without a full probe
(memory search and throughput timing) after step 2; every weight, buffer and optimizer-state tensor is compared
with ``torch.equal``. A control pair without the probe first shows whether the model's CUDA kernels are
themselves deterministic (``torch.use_deterministic_algorithms(True, warn_only=True)``); where they are not,
bit identity cannot be asked of the probe and the row says so.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.cifar10.lamb import build_lamb  # noqa: E402
from benchmarks.cifar10.model import build_model  # noqa: E402
from benchmarks.results import publish_section  # noqa: E402
from gns_callback.probe import is_oom, probe_micro_batch  # noqa: E402

SECTION_HEADING = "## GPU: the probe against the true largest micro-batch"
DEVICE = "cuda"
Batch = tuple[torch.Tensor, torch.Tensor]


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-2 small's shape: token and position embeddings, pre-LN blocks, an LM head tied to the token embedding
    (``tied=False``: its own ``Linear``, which per-example norms can measure)."""

    def __init__(self, vocab: int = 50257, seq: int = 512, d: int = 768, layers: int = 12, heads: int = 12,
                 dropout: float = 0.1, tied: bool = True) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*(Block(d, heads, dropout) for _ in range(layers)))
        self.ln = nn.LayerNorm(d)
        self.head = None if tied else nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)  # a batch dim for every layer
        hidden = self.ln(self.blocks(self.tok(tokens) + self.pos(positions)))
        return hidden @ self.tok.weight.T if self.head is None else self.head(hidden)


@dataclass
class Case:
    name: str
    description: str
    build: Callable[[], tuple[nn.Module, torch.optim.Optimizer]]
    make_batch: Callable[[int], Batch]
    loss: Callable[[nn.Module, Batch], torch.Tensor]


def efficientnet_case() -> Case:
    def build():
        model, _ = build_model(10)
        model = model.to(DEVICE)
        return model, build_lamb(model, 1e-3)[0]

    def make_batch(size: int) -> Batch:
        gen = torch.Generator(device=DEVICE).manual_seed(size)
        return (torch.randn(size, 3, 32, 32, device=DEVICE, generator=gen),
                torch.randint(0, 10, (size,), device=DEVICE, generator=gen))

    description = build_model(10)[1] + ", LAMB, input 3×32×32"
    return Case("EfficientNet-B0", description, build, make_batch, lambda m, b: F.cross_entropy(m(b[0]), b[1]))


def gpt_case(seq: int = 512) -> Case:
    def build():
        model = GPT(seq=seq).to(DEVICE)
        return model, torch.optim.AdamW(model.parameters(), lr=3e-4)

    def make_batch(size: int) -> Batch:
        gen = torch.Generator(device=DEVICE).manual_seed(size)
        tokens = torch.randint(0, 50257, (size, seq + 1), device=DEVICE, generator=gen)
        return tokens[:, :-1], tokens[:, 1:]

    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        logits = model(batch[0])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))

    return Case("GPT-2 small, seq 512", "12 layers, d 768, 12 heads, vocab 50257, causal SDPA, AdamW, fp32",
                build, make_batch, loss)


def release() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, case: Case, size: int, steps: int) -> None:
    for _ in range(steps):
        batch = case.make_batch(size)
        optimizer.zero_grad(set_to_none=True)
        case.loss(model, batch).backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def runs(model: nn.Module, optimizer: torch.optim.Optimizer, case: Case, size: int) -> bool:
    """Two full training steps at ``size`` fit (a real CUDA OOM says they don't)."""
    failed = False
    try:
        train_steps(model, optimizer, case, size, steps=2)
    except Exception as exc:  # noqa: BLE001 - only OOMs are expected; anything else is re-raised
        if not is_oom(exc):
            raise
        failed = True
    optimizer.zero_grad(set_to_none=True)
    release()
    return not failed


def exhaustive_max(model: nn.Module, optimizer: torch.optim.Optimizer, case: Case, start: int = 16) -> dict:
    """Doubling from ``start`` to the first OOM, then bisection to the exact largest size that runs."""
    tried: list[tuple[int, bool]] = []
    lo, hi = 0, start
    while True:
        ok = runs(model, optimizer, case, hi)
        tried.append((hi, ok))
        if not ok:
            break
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ok = runs(model, optimizer, case, mid)
        tried.append((mid, ok))
        lo, hi = (mid, hi) if ok else (lo, mid)
    return {"max": lo, "first_failing": hi, "trials": len(tried)}


def probe_row(model: nn.Module, optimizer: torch.optim.Optimizer, case: Case, headroom: float) -> dict:
    release()
    result = probe_micro_batch(model, optimizer, case.make_batch(32), lambda b: case.loss(model, b),
                               headroom=headroom, throughput=False, progress_bar=False)
    after_fit = [t for t in result.trials if t.phase != "fit"]
    fixed, per_sample = result.fixed_bytes, result.bytes_per_sample
    return {"headroom": headroom, "predicted": result.max_micro_batch, "budget_bytes": result.budget_bytes,
            "fixed_bytes": fixed, "bytes_per_sample": per_sample, "verify_trials": len(after_fit),
            "trials": [(t.size, t.phase, t.ok, t.measured_bytes) for t in result.trials],
            "seconds": result.wall_seconds}


def probe_against_truth(case: Case) -> dict:
    torch.manual_seed(0)
    model, optimizer = case.build()
    train_steps(model, optimizer, case, 16, steps=2)  # optimizer state exists, as in a run
    rows = [probe_row(model, optimizer, case, headroom) for headroom in (1.0, 0.85)]
    started = time.perf_counter()
    truth = exhaustive_max(model, optimizer, case)
    truth["seconds"] = time.perf_counter() - started
    for row in rows:
        row["error"] = (row["predicted"] - truth["max"]) / truth["max"]
    del model, optimizer
    release()
    return {"case": case.name, "description": case.description, "truth": truth, "probe": rows}


def seeded_run(case: Case, size: int, probe_after: int | None, steps: int = 4) -> dict[str, torch.Tensor]:
    """``steps`` seeded training steps; the full probe (memory search and timing) after step ``probe_after``."""
    torch.manual_seed(0)
    torch.cuda.manual_seed_all(0)
    model, optimizer = case.build()
    for step in range(steps):
        if step == probe_after:
            probe_micro_batch(model, optimizer, case.make_batch(size), lambda b: case.loss(model, b),
                              memory_budget_bytes=8 * 2**30, timing_budget_s=0.5, progress_bar=False)
        train_steps(model, optimizer, case, size, steps=1)
    tensors = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, state in enumerate(optimizer.state.values()):
        tensors.update({f"opt.{i}.{k}": v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)})
    tensors["cuda_rng"] = torch.cuda.get_rng_state()
    del model, optimizer
    release()
    return tensors


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


def bit_identity(case: Case, size: int) -> dict:
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    try:
        control = [seeded_run(case, size, None) for _ in range(2)]
        probed = seeded_run(case, size, probe_after=2)
    finally:
        torch.use_deterministic_algorithms(False)
    deterministic = differing(*control)
    changed = differing(control[0], probed)
    return {"case": case.name, "size": size, "tensors": len(control[0]), "control_differs": len(deterministic),
            "probe_differs": len(changed), "probe_differs_names": changed[:8]}


def environment() -> dict[str, Any]:
    import pytorch_lightning

    props = torch.cuda.get_device_properties(0)
    return {"device": f"{props.name}, {props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs",
            "software": f"torch {torch.__version__}, CUDA {torch.version.cuda}, pytorch-lightning "
                        f"{pytorch_lightning.__version__}",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def measure(bit_sizes: dict[str, int], identity: bool = True) -> dict[str, Any]:
    cases = [efficientnet_case(), gpt_case()]
    out: dict[str, Any] = {"environment": environment(), "truth": [], "identity": []}
    for case in cases:
        out["truth"].append(probe_against_truth(case))
        print(json.dumps(out["truth"][-1], default=str), flush=True)
    for case in cases if identity else []:
        out["identity"].append(bit_identity(case, bit_sizes[case.name]))
        print(json.dumps(out["identity"][-1]), flush=True)
    return out


def _gib(n: float | None) -> str:
    return "–" if n is None else f"{n / 2**30:.2f} GiB"


def render(run: dict[str, Any], command: str) -> str:
    env = run["environment"]
    lines = [f"- Command (on the GPU machine): `{command}`",
             f"- Device: {env['device']}; {env['software']}; date {env['date']}",
             "- Truth: two full training steps per size (optimizer state already created), doubling to the first "
             "real CUDA OOM, then bisection to the exact integer. Probe: `probe_micro_batch` with the device's free "
             "memory as the budget; *verifying trials* are the real steps after the three-size memory fit.",
             "", "| model | truth (largest that runs) | headroom | probe's answer | error vs truth | verifying trials "
             "| memory model | budget | probe time | truth search time |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in run["truth"]:
        truth = row["truth"]
        for probe in row["probe"]:
            model = f"{_gib(probe['fixed_bytes'])} + {probe['bytes_per_sample'] / 2**20:.2f} MiB/sample"
            lines.append(f"| {row['case']} | {truth['max']} | {probe['headroom']:g} | {probe['predicted']} | "
                         f"{probe['error']:+.1%} | {probe['verify_trials']} | {model} | {_gib(probe['budget_bytes'])} "
                         f"| {probe['seconds']:.1f} s | {truth['seconds']:.0f} s ({truth['trials']} sizes) |")
    lines += ["", "Models: " + "; ".join(f"{r['case']}: {r['description']}" for r in run["truth"]), "",
              "Bit identity (a full probe, memory search and throughput timing, between training steps 2 and 3 "
              "of 4; every weight, buffer, optimizer-state tensor and the CUDA RNG state compared with "
              "`torch.equal`):", "", "| model | micro-batch | tensors compared | control pair (no probe) differs "
              "| with probe differs |", "|---|---|---|---|---|"]
    for row in run["identity"]:
        lines.append(f"| {row['case']} | {row['size']} | {row['tensors']} | {row['control_differs']} | "
                     f"{row['probe_differs']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the measurements here")
    parser.add_argument("--from-json", type=Path, help="no measuring: render a saved --json file")
    parser.add_argument("--out", type=Path, help="write/replace this benchmark's section of this markdown file")
    parser.add_argument("--no-identity", action="store_true", help="the probe against the truth only")
    args = parser.parse_args(argv)
    command = "python benchmarks/gpu_probe_truth.py --json probe_truth.json"
    if args.from_json:
        run = json.loads(args.from_json.read_text())
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA GPU (use --from-json to render saved measurements)")
        run = measure({"EfficientNet-B0": 64, "GPT-2 small, seq 512": 8}, identity=not args.no_identity)
        if args.json:
            args.json.write_text(json.dumps(run, indent=1, default=str))
    section = render(run, command)
    publish_section(section, args.out, SECTION_HEADING)
    return 0


if __name__ == "__main__":
    sys.exit(main())

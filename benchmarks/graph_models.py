"""Graph neural networks for graph classification, batched as a disjoint union of graphs, against exact values.

    python benchmarks/graph_models.py [--seeds 3] [--steps 150] [--only NAME] [--drivers 'NAME;NAME']

scikit-learn's digits as graphs: each image's pixels with intensity > 0 are its nodes (16–42 per graph, 32.7 on
average), with features (intensity/16, row/7, col/7), and edges join 4-neighbour kept pixels (both directions); the
label is the digit. One example is one graph. A ``collate_fn`` builds the batch as PyTorch Geometric's DataLoader
does (PyG itself is not used): node features ``x`` (N_nodes, 3) of all the batch's graphs, ``edge_index`` (2, E)
offset by each graph's first node, ``batch`` (N_nodes,) the graph of each node, and ``y`` (num_graphs,). Three
layouts of it, as users write them: a tuple ``(x, edge_index, batch, y)``, a dict, and an object with those
attributes (as PyG's ``Batch``). Two models on it: message passing by ``index_add_`` over ``edge_index``, and by
``torch.sparse.mm`` on a sparse adjacency built in the collate; both pool each graph's nodes by ``index_add_`` over
``batch`` (mean) into a Linear head on (num_graphs, H). Their node Linear layers see N_nodes rows, which are not
examples. The same function with the head on every node and its logits pooled per graph last (``NodeLogits``): every
layer then sees node rows, none graph rows. A last model takes the dense layout: every graph padded to the batch's
largest, ``x`` (num_graphs, max_nodes, 3), a dense adjacency and a node mask, so that each layer's rows are graphs.

Exact: ``B_simple`` of each graph's gradient over all 1797 graphs, float64, one backward pass per graph, at fixed
parameters (:func:`gns_callback.exact.exact_noise_scale`). Readings, 32 graphs a step at lr 0: the Lightning
callback at its defaults (``method="auto"``), with 1 and 2 micro-batches per step (``accumulate_grad_batches=2`` ×
16), and with ``method="per_example"`` or ``"micro_batch"`` forced; the plain-loop meter (``method="per_example"``)
with no check (``meter.step()`` alone), as the README shows it (``meter.check_batch(loss_of, batch)`` on the first
batch), with ``check_batch(..., batch_size=num_graphs)``, and with that and ``step(micro_batch_size=num_graphs)``;
and the plain-loop meter with ``method="micro_batch"``, 2 backward passes of 16 graphs,
``step(micro_batch_size=16)``. The Lightning loader shuffles without replacement (the sampler is corrected for); the
plain loop draws with replacement. "held": intervals holding the exact value.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gns_callback import GradientNoiseScaleMeter  # noqa: E402
from gns_callback.exact import exact_noise_scale  # noqa: E402

Graph = tuple[torch.Tensor, torch.Tensor, int]  # node features (n, 3), edge_index (2, e), label
H = 32


def digit_graphs() -> list[Graph]:
    """The 1797 digits as graphs: kept pixels (intensity > 0) as nodes, 4-neighbour edges both ways."""
    from sklearn.datasets import load_digits
    data = load_digits()
    graphs = []
    for image, label in zip(data.images, data.target):
        image = torch.tensor(image, dtype=torch.float32)
        kept = image > 0
        ids = torch.full((8, 8), -1, dtype=torch.long)
        ids[kept] = torch.arange(int(kept.sum()))
        rows, cols = kept.nonzero(as_tuple=True)
        x = torch.stack([image[rows, cols] / 16, rows / 7, cols / 7], dim=1)
        edges = []
        for dr, dc in ((0, 1), (1, 0)):
            a = ids[: 8 - dr, : 8 - dc]
            b = ids[dr:, dc:]
            both = (a >= 0) & (b >= 0)
            edges.append(torch.stack([a[both], b[both]]))
        one_way = torch.cat(edges, dim=1)
        graphs.append((x, torch.cat([one_way, one_way.flip(0)], dim=1), int(label)))
    return graphs


# ------------------------------------------------------------------ batches: the disjoint union, three layouts
@dataclasses.dataclass
class GraphBatch:
    """A dataclass holding the disjoint union (as a user's own batch class)."""
    x: torch.Tensor
    edge_index: torch.Tensor
    batch: torch.Tensor
    y: torch.Tensor


class AttributeBatch:
    """A plain object with the union's tensors as attributes, as PyTorch Geometric's ``Batch``."""

    def __init__(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.edge_index, self.batch, self.y = x, edge_index, batch, y

    @property
    def num_graphs(self) -> int:
        return int(self.y.shape[0])


def union(graphs: list[Graph]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, edge_index, batch, y) of the disjoint union of ``graphs``: edge ids offset by each graph's first node."""
    sizes = torch.tensor([g[0].shape[0] for g in graphs])
    offsets = torch.cumsum(sizes, 0) - sizes
    x = torch.cat([g[0] for g in graphs])
    edge_index = torch.cat([g[1] + o for g, o in zip(graphs, offsets.tolist())], dim=1)
    batch = torch.repeat_interleave(torch.arange(len(graphs)), sizes)
    return x, edge_index, batch, torch.tensor([g[2] for g in graphs])


def collate_tuple(graphs: list[Graph]) -> tuple:
    return union(graphs)


def collate_dict(graphs: list[Graph]) -> dict:
    return dict(zip(("x", "edge_index", "batch", "y"), union(graphs)))


def collate_object(graphs: list[Graph]) -> AttributeBatch:
    return AttributeBatch(*union(graphs))


def collate_dataclass(graphs: list[Graph]) -> GraphBatch:
    return GraphBatch(*union(graphs))


def collate_sparse(graphs: list[Graph]) -> dict:
    """The union with a sparse (N, N) adjacency (COO) in place of ``edge_index``."""
    x, edge_index, batch, y = union(graphs)
    adjacency = torch.sparse_coo_tensor(edge_index, torch.ones(edge_index.shape[1]), (len(x), len(x))).coalesce()
    return {"x": x, "adjacency": adjacency, "batch": batch, "y": y}


def collate_dense(graphs: list[Graph]) -> tuple:
    """Dense batching: (x (G, n_max, 3) zero-padded, adjacency (G, n_max, n_max), node mask (G, n_max), y (G,))."""
    n_max = max(g[0].shape[0] for g in graphs)
    x = torch.zeros(len(graphs), n_max, 3)
    adjacency = torch.zeros(len(graphs), n_max, n_max)
    mask = torch.zeros(len(graphs), n_max, dtype=torch.bool)
    for i, (features, edge_index, _) in enumerate(graphs):
        n = features.shape[0]
        x[i, :n], mask[i, :n] = features, True
        adjacency[i, edge_index[1], edge_index[0]] = 1.0
    return x, adjacency, mask, torch.tensor([g[2] for g in graphs])


def fields(batch: Any) -> tuple:
    """(x, edge_index or adjacency, batch or mask, y) of any layout."""
    if isinstance(batch, dict):
        return batch["x"], batch.get("edge_index", batch.get("adjacency")), batch["batch"], batch["y"]
    if isinstance(batch, (tuple, list)):
        return tuple(batch)
    return batch.x, batch.edge_index, batch.batch, batch.y


# ------------------------------------------------------------------ models
class MessagePassing(nn.Module):
    """Node encoder, two rounds of ``h ← tanh(W(h + mean of neighbours))`` by ``index_add_`` over ``edge_index``
    (or ``torch.sparse.mm`` on a sparse adjacency), mean over each graph's nodes by ``index_add_`` over ``batch``, a
    Linear head on (num_graphs, H)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(3, H)
        self.convs = nn.ModuleList([nn.Linear(H, H), nn.Linear(H, H)])
        self.head = nn.Linear(H, 10)

    @staticmethod
    def neighbours(h: torch.Tensor, links: torch.Tensor) -> torch.Tensor:
        """Mean over each node's neighbours: ``links`` an edge_index (2, E) or a sparse adjacency (N, N)."""
        if links.is_sparse:
            total = torch.sparse.mm(links, h)
            degree = torch.sparse.sum(links, dim=1).to_dense()
        else:
            total = torch.zeros_like(h).index_add_(0, links[1], h[links[0]])
            ones = torch.ones_like(links[1], dtype=h.dtype)
            degree = torch.zeros(h.shape[0], dtype=h.dtype).index_add_(0, links[1], ones)
        return total / degree.clamp(min=1).unsqueeze(1)

    def encode(self, x: torch.Tensor, links: torch.Tensor) -> torch.Tensor:
        """The nodes' features after the encoder and the two rounds of message passing."""
        h = torch.tanh(self.embed(x))
        for conv in self.convs:
            h = torch.tanh(conv(h + self.neighbours(h, links)))
        return h

    @staticmethod
    def pool(values: torch.Tensor, batch: torch.Tensor, num_graphs: int) -> torch.Tensor:
        """Mean of ``values`` over each graph's nodes (``batch``: each node's graph)."""
        ones = torch.ones_like(batch, dtype=values.dtype)
        counts = torch.zeros(num_graphs, dtype=values.dtype).index_add_(0, batch, ones)
        total = torch.zeros(num_graphs, values.shape[1], dtype=values.dtype).index_add_(0, batch, values)
        return total / counts.unsqueeze(1)

    def forward(self, x: torch.Tensor, links: torch.Tensor, batch: torch.Tensor, num_graphs: int) -> torch.Tensor:
        return self.head(self.pool(self.encode(x, links), batch, num_graphs))


class NodeLogits(MessagePassing):
    """The same layers, the head on every node and its logits pooled per graph last (the head commutes with the
    mean: the same function, the same exact value); every layer then sees node rows, none graph rows."""

    def forward(self, x: torch.Tensor, links: torch.Tensor, batch: torch.Tensor, num_graphs: int) -> torch.Tensor:
        return self.pool(self.head(self.encode(x, links)), batch, num_graphs)


class DenseGraphNet(nn.Module):
    """The same layers on the dense layout: (G, n_max, ·) tensors, a dense adjacency, a node mask; rows are graphs."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(3, H)
        self.convs = nn.ModuleList([nn.Linear(H, H), nn.Linear(H, H)])
        self.head = nn.Linear(H, 10)

    def forward(self, x: torch.Tensor, adjacency: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        keep = mask.unsqueeze(-1).to(x.dtype)
        degree = adjacency.sum(-1, keepdim=True).clamp(min=1)
        h = torch.tanh(self.embed(x)) * keep
        for conv in self.convs:
            h = torch.tanh(conv(h + adjacency @ h / degree)) * keep
        return self.head(h.sum(1) / keep.sum(1))


def sparse_loss(net: nn.Module, batch: Any) -> torch.Tensor:
    """Cross entropy, mean over the batch's graphs."""
    x, links, nodes_graph, y = fields(batch)
    return F.cross_entropy(net(x, links, nodes_graph, y.shape[0]), y)


def dense_loss(net: nn.Module, batch: Any) -> torch.Tensor:
    x, adjacency, mask, y = fields(batch)
    return F.cross_entropy(net(x, adjacency, mask), y)


@dataclasses.dataclass(frozen=True)
class Setup:
    """A model, the collate function that batches for it, and its loss of (net, batch)."""
    name: str
    make: Callable[[], nn.Module]
    collate: Callable[[list[Graph]], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]


SETUPS = [
    Setup("index_add, tuple batch", MessagePassing, collate_tuple, sparse_loss),
    Setup("index_add, dict batch", MessagePassing, collate_dict, sparse_loss),
    Setup("index_add, attribute batch", MessagePassing, collate_object, sparse_loss),
    Setup("index_add, dataclass batch", MessagePassing, collate_dataclass, sparse_loss),
    Setup("sparse.mm, dict batch", MessagePassing, collate_sparse, sparse_loss),
    Setup("node logits pooled last, tuple batch", NodeLogits, collate_tuple, sparse_loss),
    Setup("node logits pooled last, attribute batch", NodeLogits, collate_object, sparse_loss),
    Setup("dense padded, tuple batch", DenseGraphNet, collate_dense, dense_loss),
]


# ------------------------------------------------------------------ exact value and readings
def exact_value(setup: Setup, graphs: list[Graph]) -> float:
    """``B_simple`` of each graph's gradient over all graphs, float64, one backward pass per graph."""
    net = setup.make().double()
    params = [p for p in net.parameters() if p.requires_grad]
    rows = []
    for graph in graphs:
        batch = _double(setup.collate([graph]))
        grads = torch.autograd.grad(setup.loss(net, batch), params)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return exact_noise_scale(torch.stack(rows))[0]


def _double(batch: Any) -> Any:
    if isinstance(batch, dict):
        return {k: _double(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_double(v) for v in batch)
    if isinstance(batch, torch.Tensor):
        return batch.double() if batch.is_floating_point() else batch
    return type(batch)(*(_double(v) for v in fields(batch)))


def plain_reading(setup: Setup, graphs: list[Graph], seed: int, steps: int, told: str = "none",
                  batch: int = 32) -> tuple[Any, str]:
    """(the run estimate, the first batch's check) of the plain-loop meter, the README's way: ``check_batch`` on the
    first batch, then ``loss.backward(); meter.step()``. ``told``: ``"nocheck"`` (no ``check_batch``); ``"none"``;
    ``"check"`` (``check_batch(...,
    batch_size=num_graphs)``); ``"all"`` (that, and ``step(micro_batch_size=num_graphs)``)."""
    net, generator = setup.make(), torch.Generator().manual_seed(seed)
    with GradientNoiseScaleMeter(net, method="per_example") as meter:
        for step in range(steps):
            b = setup.collate([graphs[i] for i in torch.randint(0, len(graphs), (batch,), generator=generator)])
            if step == 0 and told == "nocheck":
                check = meter.per_example_check or "no check"
            elif step == 0:
                check = meter.check_batch(lambda bb: setup.loss(net, bb), b,
                                          **({} if told == "none" else {"batch_size": batch}))
            setup.loss(net, b).backward()
            meter.step(**({"micro_batch_size": batch} if told == "all" else {}))
            net.zero_grad()
    return meter.run_estimate, getattr(check, "status", check)


def lightning_reading(setup: Setup, graphs: list[Graph], seed: int, steps: int, accumulate: int,
                      method: str = "auto", batch: int = 32) -> tuple[Any, str]:
    """(the run estimate, '<check status> (<method>)') of the Lightning callback; a shuffled DataLoader over the
    graphs, ``steps`` optimizer steps of ``batch`` graphs."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader
    from gns_callback import GradientNoiseScaleCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = setup.make()

        def training_step(self, b, batch_idx):
            return setup.loss(self.net, b)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    loader = DataLoader(graphs, batch_size=batch // accumulate, shuffle=True, collate_fn=setup.collate,
                        generator=torch.Generator().manual_seed(seed))
    callback = GradientNoiseScaleCallback(method=method, verbose=False, recommend=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=accumulate,
                         callbacks=[callback])
    try:
        trainer.fit(Module(), loader)
    except Exception as error:  # noqa: BLE001 - a refusal at fit start is a reading too
        return None, f"{type(error).__name__}: {str(error)[:200]}"
    check = callback.meter.per_example_check if callback.meter is not None else None
    used = callback.meter.method if callback.meter is not None else "?"
    return callback.run_estimate, f"{check.status if check is not None else 'none'} ({used})"


def shown(reading: Any, exact: float) -> str:
    if reading is None:
        return "refused"
    if not math.isfinite(reading.b_simple):
        return "not measured: " + (reading.failure or "")[:160]
    held = reading.ci_low <= exact <= reading.ci_high
    return f"{reading.b_simple:.1f} [{reading.ci_low:.1f}, {reading.ci_high:.1f}] {'held' if held else 'MISSED'}"


def plain_micro_batch_reading(setup: Setup, graphs: list[Graph], seed: int, steps: int, passes: int = 2,
                              batch: int = 32) -> tuple[Any, str]:
    """The plain-loop meter with ``method="micro_batch"``: ``passes`` backward passes of ``batch // passes`` graphs a
    step, each loss divided by ``passes``, ``step(micro_batch_size=num_graphs of one pass)``."""
    net, generator = setup.make(), torch.Generator().manual_seed(seed)
    micro = batch // passes
    with GradientNoiseScaleMeter(net, method="micro_batch") as meter:
        for _ in range(steps):
            for _ in range(passes):
                b = setup.collate([graphs[i] for i in torch.randint(0, len(graphs), (micro,), generator=generator)])
                (setup.loss(net, b) / passes).backward()
            meter.step(micro_batch_size=micro)
            net.zero_grad()
    return meter.run_estimate, "micro_batch"


DRIVERS: dict[str, Callable[..., tuple[Any, str]]] = {
    "Lightning auto, 1×32": lambda s, g, seed, steps: lightning_reading(s, g, seed, steps, 1),
    "Lightning auto, 2×16": lambda s, g, seed, steps: lightning_reading(s, g, seed, steps, 2),
    "Lightning per_example, 1×32": lambda s, g, seed, steps: lightning_reading(s, g, seed, steps, 1, "per_example"),
    "Lightning micro_batch, 2×16": lambda s, g, seed, steps: lightning_reading(s, g, seed, steps, 2, "micro_batch"),
    "plain, no check": lambda s, g, seed, steps: plain_reading(s, g, seed, steps, "nocheck"),
    "plain, README": lambda s, g, seed, steps: plain_reading(s, g, seed, steps),
    "plain, check_batch(batch_size=32)": lambda s, g, seed, steps: plain_reading(s, g, seed, steps, "check"),
    "plain, + step(micro_batch_size=32)": lambda s, g, seed, steps: plain_reading(s, g, seed, steps, "all"),
    "plain micro_batch, 2×16": lambda s, g, seed, steps: plain_micro_batch_reading(s, g, seed, steps),
}


def _short(reading: Any, status: str) -> str:
    """Why a reading was not measured, shortened for the table."""
    if reading is None:
        return status.split(";")[0][:90]
    failure = reading.failure or ""
    if "rows in dim 0, but the training DataLoader" in failure:
        return "stopped at the first batch: its rows are not the loader's batch_size" + (
            " (names a disjoint union of graphs, with the fix)" if "disjoint union" in failure else "")
    if "does not hold the batch" in failure:
        return "stopped: a layer's dim 0 does not hold the batch"
    if "per-example norms read" in failure and "off the rows of the model's layers" in failure:
        return "stopped at the first step: the examples its layers held are not the loader's batch_size" + (
            " (names a disjoint union of graphs, with the fix)" if "disjoint union" in failure else "")
    if "but the model returned" in failure:
        return "stopped: the model returned fewer rows than its inputs hold"
    if "ran on" in failure and "but the model was called on" in failure:
        return "stopped: a layer's rows are not the rows the model was called on"
    if "scaled by a factor computed from the batch" in failure:
        return "stopped: check 'scaled by the batch'"
    if "saw batch size" in failure:
        return "stopped: layers saw different batch sizes"
    if "could not be read off the batch" in failure:
        return "stopped: micro-batch size unknown"
    return "stopped: " + failure[:80]


def summary(readings: list, exact: float) -> tuple[str, str, str]:
    """(the readings, 'held/measured', why the others were not measured)."""
    measured = [r for r, _ in readings if r is not None and math.isfinite(r.b_simple)]
    shown_ = "; ".join(f"{r.b_simple:.1f} [{r.ci_low:.1f}, {r.ci_high:.1f}]" for r in measured) or "—"
    held = sum(r.ci_low <= exact <= r.ci_high for r in measured)
    why = sorted({_short(r, st) for r, st in readings if r is None or not math.isfinite(r.b_simple)})
    return shown_, f"{held}/{len(measured)}", " / ".join(why)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--only", default=None, help="setups whose name contains this")
    parser.add_argument("--drivers", default=None, help="driver names separated by ';' (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging
    import pytorch_lightning  # noqa: F401 - it sets its loggers' level as it loads: quiet them after
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning", "lightning.pytorch.utilities.rank_zero",
                 "pytorch_lightning.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.ERROR)
    graphs = digit_graphs()
    drivers = {k: v for k, v in DRIVERS.items() if args.drivers is None or k in args.drivers.split(";")}
    print("| setup | exact | driver | readings (95% CI), one per seed | held | not measured |")
    print("|---|---|---|---|---|---|")
    for setup in SETUPS:
        if args.only and args.only not in setup.name:
            continue
        exact = exact_value(setup, graphs)
        for name, drive in drivers.items():
            readings = []
            for seed in range(args.seeds):
                try:
                    readings.append(drive(setup, graphs, seed, args.steps))
                except ValueError as error:  # check_batch on a batch whose size it can't read: it asks for it
                    readings.append((None, f"ValueError: {error}"))
            shown_, held, why = summary(readings, exact)
            print(f"| {setup.name} | {exact:.1f} | {name} | {shown_} | {held} | {why} |", flush=True)


if __name__ == "__main__":
    main()

"""Graph neural networks for graph classification (``benchmarks/graph_models.py``): the digits as graphs, one
example per graph, batched as PyTorch Geometric's DataLoader does (a disjoint union: node rows ``x``, ``edge_index``,
``batch``, ``y`` of the graphs), or padded dense, ``(num_graphs, max_nodes, F)`` with a node mask.

A disjoint union's tensors hold nodes in dim 0, so the batch's size read off them is its node count. The message
passing layers see nodes as rows and the head graphs: per-example norms can't measure it, and ``micro_batch`` reads
each micro-batch as that many nodes. Before, ``auto`` with 2 micro-batches of 16 graphs switched to ``micro_batch``
on the per-example check's refusal and read B_simple = 1709.2 (95% CI 1404.2–inf) over 150 steps against an exact
155.3 (1292.1–1452.9 over 400 steps, 0 of 5 data orders: ``benchmarks/RESULTS.md``): the first batch's rows against
the loader's ``batch_size``, which found it, were skipped wherever the check had refused.

With the head on every node and its logits pooled per graph last (:class:`benchmarks.graph_models.NodeLogits`: the
same function), every layer runs on nodes. Where nothing tells the batch's size, the nodes then read as examples:
before, a PyTorch Geometric-like ``Batch`` object (no size readable off it) in Lightning read B_simple = 25.3 (95% CI
22.5–29.4), and a plain loop without ``check_batch`` 29.1 (26.1–32.6), against the exact 155.3 (150 steps; over 400,
25.0–37.5 and 27.3–29.5, 0 of 5 data orders each)."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, RandomSampler

from benchmarks.graph_models import (SETUPS, DenseGraphNet, MessagePassing, NodeLogits, collate_dataclass,
                                     collate_dense, collate_dict, collate_object, collate_tuple, dense_loss,
                                     digit_graphs, exact_value, plain_reading, sparse_loss)
from gns_callback import GradientNoiseScaleCallback
from tests.trust.setups import assert_withheld, with_and_without

STEPS = 100


@pytest.fixture(scope="module")
def graphs():
    return digit_graphs()


class GraphClassifier(pl.LightningModule):
    """``loss(net, batch)``, SGD at lr 0 (fixed parameters)."""

    def __init__(self, net: torch.nn.Module, loss) -> None:
        super().__init__()
        self.net, self.loss = net, loss

    def training_step(self, batch, batch_idx):
        return self.loss(self.net, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def loader(graphs, collate, batch_size: int, shuffle: bool = True, steps: int = STEPS) -> DataLoader:
    """Shuffled batches of graphs, or ``steps`` batches drawn with replacement (``shuffle=False``)."""
    generator = torch.Generator().manual_seed(0)
    if shuffle:
        return DataLoader(graphs, batch_size=batch_size, shuffle=True, collate_fn=collate, generator=generator)
    sampler = RandomSampler(graphs, replacement=True, num_samples=batch_size * steps, generator=generator)
    return DataLoader(graphs, batch_size=batch_size, sampler=sampler, collate_fn=collate)


@pytest.mark.parametrize("collate", [collate_tuple, collate_dict, collate_dataclass])
def test_a_disjoint_union_at_two_micro_batches_is_not_measured_as_nodes(graphs, collate):
    """``auto`` at 2 micro-batches of 16 graphs: measuring stops at the first batch, saying the rows are nodes of a
    disjoint union, with the fix; it does not switch to ``micro_batch`` (1709.2 [1404.2, inf] before, exact 155.3)."""
    callback = GradientNoiseScaleCallback(verbose=False, recommend=False)
    trainer, caught = with_and_without(lambda: GraphClassifier(MessagePassing(), sparse_loss),
                                       lambda: loader(graphs, collate, 16), callback, accumulate_grad_batches=2)
    assert callback.meter.method == "per_example" and callback.meter.switched_from is None
    assert_withheld(callback.run_estimate, "disjoint union", "batch_size is 16", "dense")
    assert not any("switched" in str(w.message) for w in caught)


def test_a_disjoint_union_at_one_micro_batch_says_why(graphs):
    """One micro-batch of 32 graphs: stopped at the first batch with the same reason (before: the per-example hooks'
    'dim 0 does not hold the batch', whose fix, micro_batch, reads nodes as examples too)."""
    callback = GradientNoiseScaleCallback(verbose=False, recommend=False)
    with_and_without(lambda: GraphClassifier(MessagePassing(), sparse_loss), lambda: loader(graphs, collate_tuple, 32),
                     callback)
    assert_withheld(callback.run_estimate, "disjoint union", "batch_size is 32")


def test_padded_dense_graphs_are_measured_per_example(graphs):
    """Dense batching, ``(num_graphs, max_nodes, 3)`` with a node mask: each layer's rows are graphs, so the defaults
    measure it per example, and the interval holds the exact value."""
    dense = next(s for s in SETUPS if s.collate is collate_dense)
    exact = exact_value(dense, graphs)
    callback = GradientNoiseScaleCallback(verbose=False, recommend=False)
    with_and_without(lambda: GraphClassifier(DenseGraphNet(), dense_loss),
                     lambda: loader(graphs, collate_dense, 128, shuffle=False), callback)
    estimate = callback.run_estimate
    assert callback.meter.method == "per_example" and callback.meter.coverage["fraction"] == 1.0
    assert estimate.steps == STEPS and estimate.ci_low <= exact <= estimate.ci_high, (estimate, exact)
    assert estimate.ci_high / estimate.ci_low < 3.0, estimate


def test_nodes_read_off_the_layers_of_an_attribute_batch_are_not_examples(graphs):
    """A batch object with attributes (PyG's ``Batch``; its size can't be read off it) into a model whose every layer
    runs on nodes: the first step's per-example norms read ~1078 examples off the layers, against the loader's
    batch_size of 32, and measuring stops there (25.3 [22.5, 29.4] before, exact 155.3)."""
    callback = GradientNoiseScaleCallback(verbose=False, recommend=False)
    with_and_without(lambda: GraphClassifier(NodeLogits(), sparse_loss), lambda: loader(graphs, collate_object, 32),
                     callback)
    assert_withheld(callback.run_estimate, "per-example norms read", "batch_size is 32", "disjoint union")


def test_a_plain_loop_without_the_check_stops_where_the_model_returns_fewer_rows(graphs):
    """``meter.step()`` alone, the size told nowhere: every layer runs on the model's input rows (nodes), but the
    model returns one row per graph; measuring stops with the fix (29.1 [26.1, 32.6] before, exact 155.3)."""
    node_logits = next(s for s in SETUPS if s.make is NodeLogits and s.collate is collate_tuple)
    estimate, _ = plain_reading(node_logits, graphs, seed=0, steps=20, told="nocheck")
    assert_withheld(estimate, "but the model returned 32", "expect_batch_size")


def test_node_logits_in_a_disjoint_union_are_refused_for_their_rows(graphs):
    """The node-logits model on a tuple batch: the first batch's check copies node rows and reads the loss 'scaled by
    the batch'; the reason given is the rows, with the fix for graphs (before, the check's)."""
    callback = GradientNoiseScaleCallback(verbose=False, recommend=False)
    with_and_without(lambda: GraphClassifier(NodeLogits(), sparse_loss), lambda: loader(graphs, collate_tuple, 32),
                     callback)
    assert_withheld(callback.run_estimate, "disjoint union", "batch_size is 32", "dense")

"""Which Lightning setups the callback can measure, and what to do instead when it cannot.

Checked when a fit starts (the callback's ``setup("fit")``: before the strategy wraps or shards the model), so a
setup that would give a wrong number is refused before any training time is spent:

* sharded strategies (FSDP, DeepSpeed, model parallel): no rank's ``.grad`` holds the whole gradient, so
  ``|G_B|²`` and every micro-batch norm would be partial sums (:func:`sharded_refusal`);
* manual optimization: the callback reads gradients at the optimizer step Lightning makes (:func:`manual_refusal`);
* ``adapt=True`` beside a ``GradientAccumulationScheduler``: both would set ``accumulate_grad_batches``; beside
  ``StochasticWeightAveraging``: its ``SWALR``, installed mid-run, sets the LR to its own ``swa_lrs``;
* several training DataLoaders combined into each batch (checked at the first batch, when Lightning has built
  them): :func:`combined_loaders_refusal`;
* data-parallel ranks that drew the same first batch (checked at the first batch): :func:`same_batches_refusal`;
* a first batch whose rows in dim 0 are not the DataLoader's ``batch_size`` (a sequence-first batch): measuring
  stops (:func:`rows_not_examples`).

A strategy that is neither known data-parallel nor known sharded (a custom one) is measured with a warning
(:func:`unverified_strategy_warning`).
"""

from __future__ import annotations

from typing import Any, Optional

from gns_callback.batch_size import batch_fingerprint
from gns_callback.lightning import trainer_facts as facts

WHAT_WORKS = (
    "Use one device or a DDP strategy (strategy='ddp', 'ddp_spawn' or 'ddp_fork'), where every rank holds the whole "
    "gradient; or measure in your own loop (Lightning Fabric, plain PyTorch) with gns_callback.GradientNoiseScaleMeter "
    "on a model that is not sharded."
)


def sharded_refusal(trainer: Any) -> Optional[str]:
    """Why a sharded strategy cannot be measured, and what works instead; None if the strategy is not sharded."""
    name = facts.sharded_strategy(trainer)
    if name is None:
        return None
    own = type(trainer.strategy).__name__
    strategy = name if own == name else f"{own} (a {name})"
    return (
        f"GradientNoiseScaleCallback cannot measure under {strategy}: it shards "
        "parameters, gradients or optimizer state across ranks, so no rank holds the whole gradient and B_simple "
        f"would be computed from partial norms (a wrong number). {WHAT_WORKS}"
    )


def manual_refusal(pl_module: Any) -> Optional[str]:
    """Why manual optimization cannot be measured; None under automatic optimization."""
    if pl_module.automatic_optimization:
        return None
    return (
        "GradientNoiseScaleCallback needs automatic optimization (one optimizer stepped by Lightning); "
        f"{type(pl_module).__name__} sets `automatic_optimization = False`. Remove the callback or use "
        "automatic optimization, or measure in your own loop with gns_callback.GradientNoiseScaleMeter."
    )


def adapt_refusal(trainer: Any, adapt: bool) -> Optional[str]:
    """Why ``adapt=True`` cannot run beside a ``GradientAccumulationScheduler`` or ``StochasticWeightAveraging``
    (either namespace); else None."""
    if not adapt:
        return None
    if facts.accumulation_schedule(trainer) is not None:
        return (
            "GradientNoiseScaleCallback(adapt=True) changes accumulate_grad_batches itself; remove the "
            "GradientAccumulationScheduler callback or set adapt=False."
        )
    if facts.has_callback(trainer, "StochasticWeightAveraging"):
        return (
            "GradientNoiseScaleCallback(adapt=True) scales the learning rate by the factor it reports, but "
            "StochasticWeightAveraging replaces the LR scheduler with its SWALR at swa_epoch_start, which sets the LR "
            "to its own swa_lrs: the factor would silently be undone. Remove StochasticWeightAveraging, or set "
            "adapt=False and apply the recommendation (cb.recommendation) yourself."
        )
    return None


def combined_loaders_refusal(trainer: Any) -> Optional[str]:
    """Why batches combined from several training DataLoaders cannot be measured (Lightning's fit loop combines them
    in every mode it allows; ``"sequential"`` it refuses); None for one loader."""
    loaders, mode = facts.combined_train_loaders(trainer)
    if loaders <= 1:
        return None
    return (
        f"GradientNoiseScaleCallback cannot measure batches combined from {loaders} training DataLoaders (mode "
        f"{mode!r}): a step's examples come from several loaders, weighted as training_step chooses, and rows of "
        "different loaders share an index, so neither the batch size nor one example's gradient can be told (per-"
        "example norms would add two loaders' examples as one: on digits B_simple read half the exact value). Train "
        "from one DataLoader over the combined data (torch.utils.data.ConcatDataset, or a sampler that mixes them), "
        "or measure in your own loop with gns_callback.GradientNoiseScaleMeter."
    )


def rows_not_examples(trainer: Any, rows: int, read_off: str = "batch") -> Optional[str]:
    """Why the first batch's ``rows`` (its size read off dim 0 of its tensors) are not its examples, or None: the
    training DataLoader says it batches another number of them. A first batch may be short only where the sampler
    draws fewer than ``batch_size`` examples in all.

    A sequence-first batch, ``(T, B, ...)`` as ``pad_sequence`` returns it by default, reads ``T``: into a model
    whose layers don't declare their layout (a per-token MLP) every position was taken for an example, and the
    callback read B_simple = 1.46 [1.36, 1.57] against an exact 49.0 on digits rows (``python
    benchmarks/padded_sequences.py``). A ``collate_fn`` that stacks several rows per example (crops of one image)
    reads rows that are not independent draws. A disjoint union of graphs (PyTorch Geometric's layout: node features
    ``x``, ``edge_index``, ``batch``, ``y``) reads its node count: its message passing layers see nodes as rows, and
    ``micro_batch`` would divide by that count (``tests/trust/test_graph_models.py``).

    ``read_off="layers"``: ``rows`` are the examples per backward pass that per-example norms read off their layers'
    rows at the first step, where the batch's size could not be read off its tensors."""
    size, drawn = facts.loader_batch_size(trainer)
    if size is None or size <= 1 or rows == size or (rows < size and (drawn is None or drawn < size)):
        return None
    where = (f"the first training batch's tensors hold {rows} rows in dim 0" if read_off == "batch" else
             f"the batch's size could not be read off its tensors, and per-example norms read {rows} examples per "
             "backward pass off the rows of the model's layers at the first step")
    return (f"{where}, but the training DataLoader's "
            f"batch_size is {size}, so its examples can't be told from its rows: a sequence-first batch, (T, B, ...) "
            "as pad_sequence returns it by default, reads its sequence length as the batch size, and a collate_fn "
            "that stacks several rows per example (crops of one image) reads rows that are not independent draws, "
            "and a disjoint union of graphs (PyTorch Geometric's layout: x, edge_index, batch, y) reads its nodes. "
            "The fix: batches with one row per example in dim 0 (pad_sequence(..., batch_first=True), and "
            "x.transpose(0, 1) in the model's forward where it is sequence-first; for graphs, dense batching, "
            "(num_graphs, max_nodes, F) with a node mask, which per-example norms measure), or in your own loop "
            "GradientNoiseScaleMeter(model, method='micro_batch') over 2 or more backward passes per step, with "
            "meter.step(micro_batch_size=examples per pass)")


def same_batches_refusal(trainer: Any, batch: Any) -> Optional[str]:
    """Why ranks that drew the same first training batch cannot be measured, and how to give each rank its own
    examples; None on one process, or where the ranks' batches differ. A collective: call it on every rank, at the
    same batch.

    With ``use_distributed_sampler=False`` each rank's ``DataLoader(shuffle=True)`` draws its order from torch's
    random stream, which ``seed_everything`` seeds alike on every rank: the ranks then train on copies of the same
    batch, and a step's batch holds each example ``world_size`` times. Per-example norms took the copies for
    independent draws: on digits over 2 ranks B_simple read 29.8, 95% CI 28.0–31.9, against an exact 68.0."""
    ranks = trainer.world_size
    if ranks <= 1:
        return None
    fingerprints = trainer.strategy.all_gather(batch_fingerprint(batch, trainer.strategy.root_device))
    fingerprints = fingerprints.reshape(ranks, -1)
    if not bool(fingerprints[0].any()) or not bool((fingerprints == fingerprints[0]).all()):
        return None
    return (
        f"GradientNoiseScaleCallback cannot measure this run: all {ranks} data-parallel ranks drew the same first "
        "training batch, so they train on copies of the same examples (with use_distributed_sampler=False, a "
        "DataLoader(shuffle=True) on each rank draws the same order after seed_everything), and a step's batch "
        f"holds each example {ranks} times: B_simple would read low, by up to {ranks}x. Give each rank its own "
        "examples: Trainer(use_distributed_sampler=True) (the default), a DistributedSampler in the DataLoader, or "
        "a sampler generator seeded by rank (torch.Generator().manual_seed(seed + trainer.global_rank))."
    )


def refusal(trainer: Any, pl_module: Any, adapt: bool) -> Optional[str]:
    """The first reason this fit cannot be measured (in the order above), or None."""
    return sharded_refusal(trainer) or manual_refusal(pl_module) or adapt_refusal(trainer, adapt)


def unverified_strategy_warning(trainer: Any) -> Optional[str]:
    """A warning for a strategy that is neither known data-parallel nor known sharded; None otherwise."""
    if facts.data_parallel_strategy(trainer) or facts.sharded_strategy(trainer) is not None:
        return None
    return (
        f"GradientNoiseScaleCallback has not been checked with {type(trainer.strategy).__name__}. It assumes every "
        "rank's .grad holds the whole gradient, averaged over ranks, at the optimizer step (as under DDP); if this "
        f"strategy shards parameters or gradients, B_simple is wrong. {WHAT_WORKS}"
    )

"""Batches drawn without replacement from a finite data set (a shuffled epoch), and what that does to the estimates.

The estimators assume examples drawn independently (with replacement): a batch mean of ``B`` of them has
``E|Ḡ_B|² = |G|² + tr Σ/B``. A ``DataLoader(shuffle=True)`` draws each epoch's batches without replacement from the
``N`` examples, and then (Cochran 1977, *Sampling Techniques*, Thm 2.2, with ``tr Σ`` the population's variance about
its mean, as the exact value computes it)

    E|Ḡ_B|² = |G|² + tr Σ·(N − B)/(B·(N − 1)).

Solving the same two-batch-size equations with these expectations turns the independent-draw estimates ``(x, y)`` of
``(tr Σ, |G|²)`` into

    tr Σ = x·(N − 1)/N,    |G|² = y + x/N,

at any pair of batch sizes (per-example norms, micro-batches, and the pair estimates of a measured subset alike):
linear in ``(x, y)``, so each step stays unbiased and the ratio and its interval work on the corrected pairs. Left
out, ``|G|²`` reads low by about ``tr Σ/N`` and ``B_simple`` high by the fraction ``B_simple/N``: 18% on
scikit-learn's wine (178 examples, exact B_simple 33), where the uncorrected interval missed the exact value in 3 of
5 shuffled runs.

That correction holds where an example's gradient is the same at every draw. Data augmentation as the data set
loads an example, or dropout's fresh mask, add a part ``tr Σ_d`` drawn anew each time, which shuffling does not
thin: ``E|Ḡ_B|² = |G|² + tr Σ_e·(N − B)/(B·(N − 1)) + tr Σ_d/B``. The same corrected pair then reads ``|G|²``
high by ``tr Σ_d/N`` (on wine with Gaussian jitter on the inputs: ``B_simple`` 39% low, every interval missing),
and the uncorrected one reads it low by ``tr Σ_e/(N − 1)``. The steps can't tell the two parts apart, and the true
``B_simple`` falls monotonically from the uncorrected ratio ``x/y`` (all of ``tr Σ`` drawn afresh) to the corrected
one (none). Since the correction is linear in ``(x, y)``, Fieller's interval of the one maps onto the other's
exactly (:func:`varying_draws_high`): where draws may vary (:func:`draws_may_vary`), the interval keeps the
corrected lower end and the uncorrected upper end, and the point estimate stays the corrected one.

:func:`population_of` tells from a torch sampler whether its batches are such draws. Torch only, no Lightning.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, TypeVar, Union

from torch import nn
from torch.utils.data import (BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler,
                              SequentialSampler, Subset, SubsetRandomSampler, TensorDataset, WeightedRandomSampler,
                              default_collate)

__all__ = ["NOT_SHUFFLED", "UNKNOWN_DRAWS", "WEIGHTED_ORDER", "draws_may_vary", "loader_sampler", "population_from",
           "population_of", "unknown_draws", "unstated_population", "varying_draws_high", "without_replacement"]

Number = TypeVar("Number")  # float, numpy scalar or torch tensor

NOT_SHUFFLED = (
    "the training DataLoader does not shuffle (shuffle=False): every epoch has the same batches, while the noise "
    "scale assumes batches drawn at random: the estimate would be that of these fixed batches, far off where the data "
    "is ordered (e.g. by class), with an interval that counts each epoch's repeat of them as new draws"
)


def without_replacement(trace: Number, grad_sq: Number, population: Optional[int]) -> tuple[Number, Number]:
    """``(tr Σ, |G|²)`` for batches drawn without replacement from ``population`` examples (module docstring);
    unchanged for ``None`` (independent draws, or a stream)."""
    if population is None:
        return trace, grad_sq
    return trace * ((population - 1) / population), grad_sq + trace / population


def varying_draws_high(high: float, population: Optional[int]) -> float:
    """The upper end ``high`` of an interval for the corrected ``B_simple`` (:func:`without_replacement`) moved to
    the uncorrected ratio's: ``ρ = x/y`` and ``ρ' = x(N − 1)/(N·y + x)`` give ``ρ = N·ρ'/(N − 1 − ρ')`` (infinite
    from ``ρ' ≥ N − 1`` on), so that it also holds a ``B_simple`` whose noise is drawn afresh at every draw
    (module docstring). Unchanged for ``None``."""
    if population is None or math.isnan(high):
        return high
    room = population - 1 - high
    return population * high / room if room > 0.0 else math.inf


def draws_may_vary(loader: object, model: Optional[nn.Module] = None) -> Optional[str]:
    """Why an example's gradient may differ from one draw to the next (module docstring), or why the loader's batches
    may lie between independent and shuffled draws (a ``WeightedRandomSampler(replacement=False)``: either way the
    interval keeps the uncorrected upper end), or None where it can be shown not to: the loader's data set is a
    ``TensorDataset`` (or a ``Subset`` of one) batched by torch's own collate function, and ``model`` has no dropout
    module with ``p > 0``. Randomness the model draws by functions
    of its own forward (``F.dropout``, stochastic depth) can't be seen here."""
    dropout = next((name for name, m in (model.named_modules() if model is not None else ())
                    if _drops(m)), None)
    if dropout is not None:
        return f"the model's dropout '{dropout}' draws a new mask at each draw of an example"
    if not isinstance(loader, DataLoader):
        return "the data set can't be seen (not one DataLoader), so data augmentation can't be ruled out"
    if _weighted_without_replacement(loader_sampler(loader)):
        return WEIGHTED_ORDER
    dataset = loader.dataset
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    if type(dataset) is not TensorDataset:
        return (f"the data set ({type(dataset).__name__}) may transform an example each time it loads it (data "
                "augmentation)")
    if loader.collate_fn is not default_collate:
        return "the DataLoader's collate function of its own may transform the examples it batches"
    return None


WEIGHTED_ORDER = (
    "the WeightedRandomSampler(replacement=False) draws each epoch without replacement but in an order its weights "
    "bias, so that its batches are neither independent draws nor a shuffled epoch's"
)


def _weighted_without_replacement(sampler: Optional[Sampler]) -> bool:
    """A ``WeightedRandomSampler(replacement=False)`` (:func:`population_of`)."""
    return type(sampler) is WeightedRandomSampler and not sampler.replacement


def _drops(module: nn.Module) -> bool:
    """A dropout module, or attention with dropout on its weights, that drops anything."""
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p > 0.0
    return isinstance(module, nn.MultiheadAttention) and module.dropout > 0.0


def population_of(sampler: Optional[Sampler], ranks: int = 1,
                  in_random_order: bool = False) -> tuple[Optional[int], Optional[str]]:
    """``(N, problem)``: the number of examples ``sampler`` draws each epoch's batches from without replacement
    (None: with replacement, or not known), and why its batches are not random draws at all (None if they are).

    With several data-parallel ``ranks`` only a ``DistributedSampler``'s shards of one shuffled order make the
    ranks' batches one draw without replacement; ranks shuffling on their own draw independently of each other.
    ``in_random_order``: the data set's order is random already (shuffled or drawn beforehand), so a sampler that
    reads it in order draws each epoch without replacement.

    A ``WeightedRandomSampler(replacement=False)`` draws its ``num_samples`` without replacement from its
    ``len(weights)`` examples, early draws favouring the heavy ones: its batches lie between independent and
    shuffled draws, so :func:`draws_may_vary` keeps the interval's upper end that of independent draws. Before, they
    were taken as independent: on wine with class-balancing weights (exact 40.8, ``B_simple/N`` = 23%) 6 of 6
    runs read 46-53 with intervals above the exact value (``benchmarks/samplers.py``)."""
    kind = type(sampler)  # exactly these classes: a subclass (Lightning's DistributedSamplerWrapper) may draw otherwise
    if ranks > 1 and kind in (RandomSampler, SubsetRandomSampler):
        return None, None
    if kind is RandomSampler:
        return (None if sampler.replacement else len(sampler.data_source)), None
    if kind is SubsetRandomSampler:
        return len(sampler.indices), None
    if _weighted_without_replacement(sampler) and ranks == 1:
        return len(sampler.weights), None
    if kind is DistributedSampler:
        return (len(sampler.dataset), None) if sampler.shuffle or in_random_order else (None, NOT_SHUFFLED)
    if kind is SequentialSampler:
        return (len(sampler.data_source), None) if in_random_order else (None, NOT_SHUFFLED)
    return None, None


def unknown_draws(loader: object) -> Optional[str]:
    """Why ``loader``'s batches can't be told to be random draws, or None: a DataLoader whose batches torch's own
    ``BatchSampler`` makes of a sampler (read by :func:`population_of`), or not a DataLoader at all.

    A ``batch_sampler`` of one's own, or an ``IterableDataset``, decides itself which examples share a batch. Where
    it groups them (by class, by length as bucketing does, a class-ordered stream read through a small shuffle
    buffer), the batch gradient varies otherwise than that of ``B`` independent draws, and the estimators' reading
    is neither the data set's ``B_simple`` nor the noise the batches carry: on wine (exact 4.01) batches of one
    class each read 1.06 [1.02, 1.11] (the batches' own ``B·tr Cov(Ḡ_B)/|E Ḡ_B|²``: 25.3), a class-ordered
    stream through a 16-example buffer 1.22 [1.15, 1.29] (``benchmarks/samplers.py``), with nothing said."""
    if not isinstance(loader, DataLoader):
        return None
    if isinstance(loader.dataset, IterableDataset):
        return (f"the training data is an IterableDataset ({type(loader.dataset).__name__}), which decides itself "
                "which examples share a batch")
    if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
        return (f"the training DataLoader's batches come from a batch_sampler of its own "
                f"({type(loader.batch_sampler).__name__}), which decides itself which examples share a batch")
    return None


UNKNOWN_DRAWS = (
    "whether each batch is examples drawn at random can't be told, while the noise scale assumes it: batches that "
    "group examples (by class, by length as bucketing does, a class-ordered stream through a small shuffle buffer) "
    "vary otherwise than random draws, and B_simple would read far off (on wine, exact 4.01: batches of one class "
    "each read 1.06 [1.02, 1.11])"
)


def unstated_population(loaders: Iterable[tuple[str, object]], ranks: int = 1) -> Optional[tuple[int, str]]:
    """``(N, why)`` where a meter given no ``population`` may read ``B_simple`` high, or None: ``loaders``, the
    ``(name, object)`` pairs a plain loop keeps in its scope (:func:`~gns_callback.random_streams.scope_objects`),
    hold a DataLoader whose batches are drawn without replacement from ``N`` examples (:func:`population_of`), and
    the correction of the module docstring would be left out. The meter then corrects with ``N`` and keeps the
    uncorrected upper end (:func:`varying_draws_high`), which holds the value either way: whether that loader feeds
    the steps or the batches are drawn with replacement. Before, on wine (178 examples, a shuffled DataLoader of
    32, the README's loop), 300 steps read 4.4 [4.3, 4.5] against an exact 4.2, with nothing said
    (``benchmarks/plain_loops.py``). ``ranks``: the data-parallel processes (each shuffling on its own draws apart
    from the others: not one draw without replacement, :func:`population_of`)."""
    drawn = [(name, population_of(loader_sampler(loader), ranks)[0]) for name, loader in loaders]
    drawn = [(name, population) for name, population in drawn if population is not None]
    if not drawn:
        return None
    name, population = drawn[0]
    return population, (
        f"the loop holds `{name}`, a DataLoader that draws each epoch's batches without replacement from "
        f"{population} examples, but the meter was given no population=. Left alone, B_simple would read high by "
        f"the fraction B_simple/{population}; the meter now corrects for {population} examples and keeps the "
        f"interval's upper end wide enough for batches drawn with replacement too. If `{name}` is the training "
        f"loader, pass GradientNoiseScaleMeter(..., population={name}) (or population=len(dataset)): the upper end "
        "then narrows")


def loader_sampler(loader: object) -> Optional[Sampler]:
    """The sampler behind a DataLoader's batches (None: not a DataLoader, ready-made batches, or a custom batch
    sampler, whose draws can't be told)."""
    if not isinstance(loader, DataLoader) or type(loader.batch_sampler) is not BatchSampler:
        return None
    return loader.batch_sampler.sampler


def population_from(value: Union[int, DataLoader, None]) -> Optional[int]:
    """The meter's ``population``: an int as it is, or read off a DataLoader's sampler (:func:`population_of`;
    a loader that does not shuffle is refused: ``ValueError``)."""
    if not isinstance(value, DataLoader):
        return value
    population, problem = population_of(loader_sampler(value))
    if problem is not None:
        raise ValueError(f"population: {problem}. Pass shuffle=True to the DataLoader, or population=len(dataset) if "
                         "the data set is in a random order already (shuffled or drawn beforehand).")
    return population

"""A subclass of a ``torch.nn`` layer that changes only how it is built runs as that layer.

``class PoolFormerGroupNorm(nn.GroupNorm)`` sets ``num_groups=1`` in ``__init__`` and keeps ``nn.GroupNorm``'s
forward: its per-example gradients are ``nn.GroupNorm``'s. Such a subclass is read as its ``torch.nn`` base
(:func:`runs_as`). A subclass that defines anything else a forward may reach (``forward``, ``_conv_forward``, a
``weight`` property, any other method or descriptor) is kept as its own type, which the per-layer tables do not
hold: what it computes is not known. Torch only.
"""

from __future__ import annotations

import inspect
from functools import cache

from torch import nn

__all__ = ["BUILD_ONLY", "runs_as"]

#: What a subclass may define and still run as its base: how it is built and shown, and class-level data.
BUILD_ONLY = frozenset({"__init__", "extra_repr", "reset_parameters", "__repr__", "__doc__", "__module__",
                        "__qualname__", "__annotations__", "__dict__", "__weakref__", "__firstlineno__",
                        "__static_attributes__", "__orig_bases__", "__parameters__", "_is_protocol"})


@cache
def runs_as(cls: type) -> type:
    """The nearest ``torch.nn`` class ``cls`` runs as: itself if it is one, or its base where every class between
    them defines only :data:`BUILD_ONLY` names and plain data; ``cls`` itself otherwise. Kept per class: the layer
    tables look it up at every layer call."""
    for base in cls.__mro__:
        if _is_torch_layer(base):
            return base
        if not _builds_only(base):
            return cls
    return cls


def _is_torch_layer(cls: type) -> bool:
    return cls.__module__.startswith("torch.nn.") and issubclass(cls, nn.Module) and cls is not nn.Module


def _builds_only(cls: type) -> bool:
    """Whether ``cls`` itself defines nothing but :data:`BUILD_ONLY` names and data (no function or descriptor)."""
    return all(name in BUILD_ONLY or not _may_run(value) for name, value in vars(cls).items())


def _may_run(value: object) -> bool:
    return (callable(value) or inspect.isdatadescriptor(value) or inspect.ismethoddescriptor(value)
            or isinstance(value, (staticmethod, classmethod)))

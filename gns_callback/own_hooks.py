"""The hooks this package puts on the user's model (forward and forward pre-hooks on its modules, gradient hooks on
its parameters), made so that copies and pickles of the model leave them behind.

``copy.deepcopy(model)`` copies a module's hook dicts with the module (``AveragedModel(net)``, an EMA or teacher copy
made while the hooks are on), and a hook that is a bound method of a tracker would copy the tracker with it, and
through its ``.model`` the whole model it measures (a LightningModule with its trainer): the copy kept live
hooks for good, and pickling the model pickled the tracker. Each hook is an :class:`OwnHook`, whose copy and pickle
are :func:`inert_hook`, which does nothing and refers to nothing. The model itself keeps its hooks as they are, and
their handles remove them as before. (A parameter's hooks are not copied by ``Parameter.__deepcopy__`` nor pickled
anyway; they are wrapped too, so that no hook of ours depends on it.) A copy held in the measured model (an
``AveragedModel`` set as a submodule) loses its inert hooks too when the meter detaches (:func:`remove_inert_hooks`).
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

#: A module's hook dicts that copies of our hooks land in, each with the flag dicts keyed by the same hook ids.
_HOOK_DICTS = (("_forward_hooks", ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")),
               ("_forward_pre_hooks", ("_forward_pre_hooks_with_kwargs",)))


def inert_hook(*_args: Any, **_kwargs: Any) -> None:
    """What a copy or a pickle of the model holds in place of a hook of ours: does nothing (None: torch leaves the
    inputs, output or gradient as they are, for every kind of hook)."""
    return None


class OwnHook:
    """A hook of this package on the user's model: calls ``fn`` with what torch passes. Deep copies, copies and
    pickles of it are :func:`inert_hook` (they hold no reference to ``fn`` nor to what it is bound to)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, _memo: dict[int, Any]) -> Callable[..., None]:
        return inert_hook

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        return _inert, ()


def _inert() -> Callable[..., None]:
    """Unpickles an :class:`OwnHook` (and ``copy.copy`` makes one): :func:`inert_hook`."""
    return inert_hook


def remove_inert_hooks(model: nn.Module) -> None:
    """Take off ``model``'s modules the inert hooks that copies of ours left there (a copy of the model, made while
    the hooks were on, held as a submodule of it): its forward runs without hooks again."""
    for module in model.modules():
        for hooks_name, flag_names in _HOOK_DICTS:
            hooks = getattr(module, hooks_name, {})
            for key in [key for key, hook in hooks.items() if hook is inert_hook]:
                del hooks[key]
                for flag_name in flag_names:
                    getattr(module, flag_name, {}).pop(key, None)

"""Post-step hooks on the optimizer wrappers (``shard_optimizer``, ``ap.Optimizer``, ``ap.parallelize``).

    handle = opt.register_step_post_hook(lambda opt: print("stepped"))
    ...
    handle.remove()

``fn(optimizer)`` runs after each step that updated the parameters, on the wrapper the hook was registered
on (the outermost one the entry point returned): once per ``step()`` call, which under gradient
accumulation is once per accumulation window; a step the loss scaler skips on overflow runs no hooks.
Hooks run in registration order; an exception in a hook propagates (nothing is swallowed).
"""
from __future__ import annotations

import itertools
import weakref

_ids = itertools.count()
_INNER: "weakref.WeakSet" = weakref.WeakSet()      # the paddle optimizers an ap wrapper drives (its ``_inner``)


def is_inner(opt) -> bool:
    """Whether an ap optimizer wrapper drives ``opt`` (the user's optimizer inside ``shard_optimizer`` & co)."""
    return opt in _INNER


class _Hooks(dict):
    """An optimizer wrapper's post-step hooks {key: fn}; weakly referable, for the handles."""
    __slots__ = ("__weakref__",)


class HookHandle:
    """Holds the hooks weakly: a handle kept after its optimizer is gone (``auto_checkpoint``'s current run keeps
    one) must not keep the hooks alive, nor what they hold (the model a hook closes over)."""

    def __init__(self, hooks: dict, key: int):
        self._hooks, self._key = weakref.ref(hooks), key

    def remove(self) -> None:
        hooks = self._hooks()
        if hooks is not None:
            hooks.pop(self._key, None)


class StepHooks:
    """Mixin: ``register_step_post_hook(fn)`` and ``_after_step()`` for a wrapper's ``step()`` to call; the
    optimizer a wrapper drives (``self._inner = ...``) is noted (``is_inner``)."""

    def __setattr__(self, name, value):
        if name == "_inner" and value is not None:
            try:
                _INNER.add(value)
            except TypeError:                   # not weakly referable: not a paddle optimizer
                pass
        super().__setattr__(name, value)

    def _step_hooks(self) -> dict:
        hooks = self.__dict__.get("_step_post_hooks")
        if hooks is None:
            hooks = self.__dict__["_step_post_hooks"] = _Hooks()
        return hooks

    def register_step_post_hook(self, fn) -> HookHandle:
        """Call ``fn(optimizer)`` after every real optimizer step; returns a handle with ``.remove()``."""
        if not callable(fn):
            raise TypeError(f"register_step_post_hook expects a callable fn(optimizer), got {type(fn).__name__}")
        hooks = self._step_hooks()
        key = next(_ids)
        hooks[key] = fn
        return HookHandle(hooks, key)

    def _after_step(self) -> None:
        for fn in list(self._step_hooks().values()):
            fn(self)

    def minimize(self, loss=None, startup_program=None, parameters=None, no_grad_set=None):
        """paddle's dygraph ``minimize``: the gradients of ``loss.backward()`` applied, i.e. ``step()``; returns
        paddle's ``(optimize_ops, params_grads)``. Updating a subset (``parameters``, ``no_grad_set``) is not
        supported by the distributed step."""
        if parameters is not None or no_grad_set is not None:
            raise NotImplementedError(f"minimize(parameters=..., no_grad_set=...) over distributed parameters: the "
                                      f"step updates every parameter of the optimizer; got parameters="
                                      f"{_names(parameters)}, no_grad_set={_names(no_grad_set)}")
        pairs = [(p, p.grad) for p in _params(self) if not p.stop_gradient and p.grad is not None]
        self.step()
        return None, pairs



def _params(opt) -> list:
    """The parameters a wrapper steps (``parameters`` of the plain wrapper, ``params`` of the ZeRO one)."""
    ps = getattr(opt, "parameters", None)
    return list(ps if ps is not None and not callable(ps) else getattr(opt, "params", []))


def _names(xs):
    return None if xs is None else [getattr(x, "name", x) for x in xs][:3]

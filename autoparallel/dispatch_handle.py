"""Dispatch as an explicit, reversible mode.

    handle = ap.install()            # route paddle ops on distributed tensors (the first shard_tensor does it)
    ...
    handle.uninstall()               # every patched paddle name is the original object again
    with ap.dispatch_mode():         # installed inside, the previous state restored on exit
        ...

Installing patches paddle's op table entries, their aliases in every loaded module, the guards over the
remaining public callables, the ``Tensor`` methods and in-place forms, ``paddle.jit``'s ``StaticFunction``
entry, the lazy initialiser hook, the loss scalers and (in a launched job) ``paddle.distributed.new_group``;
every one of those goes through ``autoparallel.patches``, which ``uninstall()`` rewinds.

``uninstall()`` refuses while a live layer holds a distributed parameter: a ``DistParameter`` is a real paddle
tensor holding its local shard, so without dispatch paddle's own ops on it would compute on that shard
silently. Drop the model first, or pass ``force=True`` to accept that.

While uninstalled, a DistTensor op (``x + y``, ``x.matmul(w)``) raises a ``RuntimeError`` saying so: it does
not re-install behind the user's back. Entry points (``ap.shard_tensor``, ``ap.dtensor_from_local``,
``ap.shard_layer``, ``ap.trace``, ``ap.to_static``...) install again, as the first one did.

The DistTensor methods reach the call path through ``call`` here: the installer plugs the dispatch module in,
so the tensor type never imports the dispatcher.
"""
from __future__ import annotations

import contextlib
import inspect
import threading

from autoparallel import patches

_ACTIVE: list = []          # [the dispatch module, the in-place rebinder] while installed


class DispatchHandle:
    """What ``install()`` returns: ``uninstall()`` (idempotent) puts every patched paddle name back."""

    def __init__(self, count: int):
        self.count = count

    @property
    def installed(self) -> bool:
        return bool(_ACTIVE)

    def uninstall(self, force: bool = False) -> int:
        return uninstall(force)

    def __repr__(self) -> str:
        state = "installed" if _ACTIVE else "uninstalled"
        return f"DispatchHandle({state}, {self.count} paddle names patched)"


_HANDLE: list = []
_LOCK = threading.RLock()


def installed() -> bool:
    return bool(_ACTIVE)


def install() -> DispatchHandle:
    """Route paddle ops on distributed tensors (idempotent); returns the handle. An install that fails
    part-way is rolled back before the error propagates."""
    if _ACTIVE:
        return _HANDLE[0]
    with _LOCK:
        if not _ACTIVE:
            from autoparallel import dispatch_install       # the one lazy edge back up (docs/design.md)

            try:
                plugged = dispatch_install.install_all()
            except BaseException:
                patches.undo()
                raise
            _HANDLE[:] = [DispatchHandle(len(patches.recorded()))]
            _ACTIVE[:] = plugged
    return _HANDLE[0]


def uninstall(force: bool = False) -> int:
    """Restore every name autoparallel patched in paddle; returns how many were restored. Refused while a live
    layer holds a distributed parameter, unless ``force``."""
    if not isinstance(force, bool):
        raise TypeError(f"uninstall(force=...) expects a bool, got {type(force).__name__} {force!r}")
    held = [] if force or not _ACTIVE else _held_dist_params()
    if held:
        names = ", ".join(map(repr, held[:3])) + (", ..." if len(held) > 3 else "")
        raise RuntimeError(f"uninstall: live layers hold {len(held)} distributed parameter(s) ({names}); without "
                           f"dispatch paddle's own ops would compute on their local shards silently; drop the model "
                           f"first, or pass force=True to accept that")
    with _LOCK:
        _ACTIVE.clear()
        return patches.undo()


def _held_dist_params() -> list:
    """Names of the distributed parameters that live layers hold (one walk over the live objects)."""
    import gc

    import paddle

    gc.collect()
    names = []
    for obj in gc.get_objects():
        if isinstance(obj, paddle.nn.Layer):          # a DistParameter carries its spec in _ap_spec
            names += [p.name for p in obj.__dict__.get("_parameters", {}).values()
                      if getattr(p, "_ap_spec", None) is not None]
    return sorted(set(names))


@contextlib.contextmanager
def dispatch_mode(force: bool = False):
    """Dispatch installed inside the block; on exit, uninstalled again if it was not installed before (refused
    while live layers hold distributed parameters, unless ``force``: see ``uninstall``)."""
    if not isinstance(force, bool):                # refused before installing, not at the block's exit
        raise TypeError(f"dispatch_mode(force=...) expects a bool, got {type(force).__name__} {force!r}")
    was = installed()
    handle = install()
    try:
        yield handle
    finally:
        if not was:
            uninstall(force)


def call(op: str, path: str, args, kwargs):
    """A DistTensor method: the routed call of ``path`` (rule ``op``)."""
    if not _ACTIVE:
        raise _not_installed(path)
    return _ACTIVE[0].run(op, path, args, kwargs)


def call_inplace(op: str, path: str, target, args, kwargs):
    """A DistTensor in-place method: the out-of-place call, then ``target`` takes the result."""
    if not _ACTIVE:
        raise _not_installed(path)
    if op in INPLACE_TARGETS:              # cond.where_(x, y) writes x
        target = inplace_target(op, _ACTIVE[0]._ORIG.get(path), args, kwargs)
    return _ACTIVE[1](path, target, _ACTIVE[0].run(op, path, args, kwargs))


INPLACE_TARGETS = {"where": "x"}    # in-place forms that write another parameter than their first (where_(c, x, y))


def inplace_target(op: str, fn, args, kwargs):
    """The tensor an in-place form of ``op`` writes: its first argument, or the parameter of ``fn`` (paddle's
    callable) named in INPLACE_TARGETS."""
    first = args[0] if args else next(iter(kwargs.values()))
    name = INPLACE_TARGETS.get(op)
    if name is None and args:
        return first
    try:
        sig = inspect.signature(fn)
        arguments = sig.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return first
    return arguments.get(name or next(iter(sig.parameters)), first)


def _not_installed(path: str) -> RuntimeError:
    return RuntimeError(f"{path} on a distributed tensor: autoparallel's dispatch is uninstalled (the handle's "
                        f"uninstall() or ap.uninstall() ran); call ap.install() (or any entry point such as "
                        f"ap.shard_tensor) to route paddle ops again")

"""What a parameter carries to the distributed parameter that replaces it when it is laid out (``ap.parallelize``
/ ``ap.shard_layer`` / ``ap.shard_tensor`` make a new ``DistParameter``, dist_tensor._make_param): the user's
gradient hooks and the user's own attributes.

Hooks (``p.register_hook(fn)`` in a layer's ``__init__``): paddle keeps a tensor's hooks in its C++ autograd meta,
which neither python nor the new parameter can read, so they were dropped and the hook silently stopped rescaling
(a ``g * 0.1`` on a weight trained with the full gradient). ``install()`` (at import, paddle already imported)
wraps ``EagerParamBase.register_hook`` so that each hook registered on a parameter from then on is also
remembered beside it; ``carry(old, new)`` registers the live ones on the replacement (and remembers them there,
so a later re-layout carries them again; hooks registered on a laid-out parameter itself are not remembered:
the package registers its own there). The handle the user holds removes the hook from every parameter it was
carried to. A hook registered before autoparallel was imported is not seen (paddle offers no way to list them).

Attributes: a parameter's python attributes the user (or a model library) set on it -- ``p.no_decay = True``
read by a parameter-group filter, PaddleFormers' ``sequence_parallel`` / ``color`` / ``expert`` marks -- were
lost with the old object; ``carry_attributes`` copies every public one the new parameter does not set itself.
``follow_optimizer_attrs`` gives a ZeRO master chunk what paddle's optimizers read from its parameter at each step.

Successors: each replaced parameter remembers (weakly) its replacement, so an optimizer built after the layout
from a list of parameters taken before it (``decay = [p for n, p in model.named_parameters() ...]`` then
``ap.parallelize`` then ``AdamW(parameters=decay)``) is pointed at the distributed ones by ``ap.shard_optimizer``
(parallel/stale_optimizers.repoint_stale); it held the originals, which get no gradient, and trained nothing.
"""
from __future__ import annotations

import weakref

from autoparallel import patches
from autoparallel.compat import EagerParamBase, SideData, TensorHookRemoveHelper

_HOOKS = SideData()             # parameter -> [_Record, ...]: its hooks registered while installed
_WRAPPERS: set = set()          # the register_hook wrappers install() put on EagerParamBase (idempotence)
# paddle's own parameter attributes (every parameter has them) that making the distributed one does not set:
# ``ParamAttr(do_model_average=True)`` read back as None
_PADDLE_UNSET = ("do_model_average",)
_SUCCESSOR = SideData()         # replaced parameter -> weakref to the distributed parameter replacing it


class _Record:
    """One hook as registered by the user, and where it is registered now."""

    __slots__ = ("hook", "handles", "removed")

    def __init__(self, hook, handle):
        self.hook = hook            # the user's callable, hook(grad) -> grad or None
        self.handles = [handle]     # paddle's remove helpers, one per parameter the hook sits on
        self.removed = False        # the user removed it: carried no further


class CarriedHookHandle(TensorHookRemoveHelper):
    """What ``register_hook`` on a parameter returns: ``remove()`` takes the hook off the parameter and off
    every parameter it was carried to (True when it was registered somewhere)."""

    def __init__(self, record: _Record):
        first = record.handles[0]
        super().__init__(getattr(first, "_tensor", None), getattr(first, "_hook_id", -1))
        self._record = record

    def remove(self) -> bool:
        rec = self._record
        if rec.removed:
            return False
        rec.removed = True
        return any([h.remove() for h in rec.handles])


def remember(param, hook, handle) -> CarriedHookHandle:
    """Record ``hook`` (already registered on ``param``, ``handle`` its helper) so a replacement gets it."""
    rec = _Record(hook, handle)
    records = _HOOKS.get(param)
    if records is None:
        records = []
        _HOOKS.set(param, records)
    records.append(rec)
    return CarriedHookHandle(rec)


def carry(old, new) -> None:
    """Register on ``new`` every hook still registered on ``old`` (the parameter ``new`` replaces)."""
    records = [r for r in _HOOKS.get(old, ()) if not r.removed]
    if not records or new is old:
        return
    mine = _HOOKS.get(new)
    if mine is None:
        mine = []
        _HOOKS.set(new, mine)
    for rec in records:
        rec.handles.append(new.register_hook(_Bare(rec.hook)))
        if rec not in mine:
            mine.append(rec)


def carried(old, new):
    """``new`` after ``carry_attributes(old, new)`` and ``carry(old, new)``; ``old`` may be None (a parameter made
    from no other)."""
    if old is None:
        return new
    _SUCCESSOR.set(old, weakref.ref(new))
    carry_attributes(old, new)
    if not new.stop_gradient:
        carry(old, new)
    return new


def successor(param):
    """The live distributed parameter that last replaced ``param`` (through re-layouts), or None."""
    out, ref = None, _SUCCESSOR.get(param)
    while ref is not None and ref() is not None:
        out = ref()
        ref = _SUCCESSOR.get(out)
    return out


def stale_map(params) -> dict:
    """{id(p): its successor} for the parameters of ``params`` that a layout replaced (an optimizer built after
    ``ap.parallelize`` from a list of parameters taken before it)."""
    out = {}
    for p in params:
        new = successor(p)
        if new is not None and new is not p:
            out[id(p)] = new
    return out


def carry_attributes(old, new) -> None:
    """Copy ``old``'s public python attributes that ``new`` lacks (the framework's own, set on ``new`` already,
    and private names stay as they are), and paddle's own that making ``new`` left unset (_PADDLE_UNSET)."""
    mine = vars(new)
    for name, value in vars(old).items():
        if not name.startswith("_") and (name not in mine or name in _PADDLE_UNSET):
            setattr(new, name, value)


def follow_optimizer_attrs(param, copy) -> None:
    """``copy`` (a ZeRO master chunk, a rank's shadow) takes what paddle's optimizers and clips read from
    ``param`` at each step: ``optimize_attr`` (the learning-rate scale; the dict itself, so an item set later
    reaches both), ``regularizer`` and ``need_clip``, as the user has them now (set after the layout, too)."""
    copy.optimize_attr = getattr(param, "optimize_attr", None) or {"learning_rate": 1.0}
    copy.regularizer = getattr(param, "regularizer", None)
    copy.need_clip = getattr(param, "need_clip", True)


class _Bare:
    """The user's hook passed on without being recorded a second time (carry records it itself)."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn            # the user's hook

    def __call__(self, grad):
        return self.fn(grad)


def install() -> None:
    """Wrap ``EagerParamBase.register_hook`` once (idempotent; undone with the other patches)."""
    original = EagerParamBase.register_hook
    if original in _WRAPPERS:
        return

    def register_hook(self, hook):
        if isinstance(hook, _Bare):
            return original(self, hook.fn)
        handle = original(self, hook)
        if hasattr(self, "_ap_spec") or not isinstance(handle, TensorHookRemoveHelper):
            return handle       # a laid-out parameter (the package's own hooks sit there too): carry keeps the rest
        return remember(self, hook, handle)

    _WRAPPERS.add(register_hook)
    register_hook.__doc__ = original.__doc__
    patches.patch(EagerParamBase, "register_hook", register_hook)

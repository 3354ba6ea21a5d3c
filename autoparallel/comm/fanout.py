"""One gradient reduction per replicated tensor, however many tensor-parallel consumers read it.

An op split over mesh dim m that reads a tensor replicated on m leaves a partial-sum gradient on every
rank of m. Reducing it per consumer (q, k and v projections of one input: three all_reduces) is what a
naive adjoint does; Megatron sums the partial gradients of every consumer first and reduces once.

``shared(v, locs, ...)`` does the same for any tensor: the first consumer asking for ``v`` in a given layout
with given split dims builds the input once -- the reshard (an S -> R step on a split dim takes the
all_gather / reduce_scatter pair) and one identity / all_reduce PyLayer per remaining split dim -- and every
later consumer asking the same gets the same local tensors. Autograd sums the consumers' partial gradients
into those tensors, and the PyLayer's backward (run once the sum is complete) reduces once.

An entry serves while its source tensors are the very objects it was built from, unmodified in place
(``_inplace_version``), and its backward has not run (a later forward builds a fresh one).

``replicate_for_split(x, m)`` is the same for a layer hook that gathers a sequence-sharded input before
column-parallel layers: one all_gather forward, one reduce_scatter backward, shared by the layers reading
it; the result is registered as "gradient partial on m", so dispatch adds no reduction for consumers split
on m, and turns the complete gradient of any other consumer (a replicated op reading it too) into partial sums
(kept on the group's first member) before it joins them. Code that reads its locals outside dispatch (a user's
PyLayer, ``local_map`` / ``LocalLayer``, ``dtensor_to_local``) reads ``complete_gradient(x)``, the same.
"""
from __future__ import annotations

import itertools
import weakref
from collections import deque

import paddle
from paddle.pir import Value as _PirValue

from autoparallel import dist_tensor_forms as _forms, redistribute
from autoparallel.comm import collectives as C
from autoparallel.compat import SideData
from autoparallel.dist_tensor import DistParameter, DistTensor
from autoparallel.switch import turned_off

_MEMO: dict = {}        # (id(source), requested spec, split dims) -> (insertion number, _Entry)
_ORDER: deque = deque()  # (insertion number, key), oldest first
_INSERTED = itertools.count()
_PARTIAL = SideData()   # DistTensor -> dims its gradient stays partial on (dropped when the tensor dies)
_DERIVED = SideData()   # DistTensor -> the DistParameter it is a cast / view of (dropped when the tensor dies)
_LIMIT = 256
_enabled = [True]


def disabled():
    """Every consumer reduces its own partial gradient inside the block (the per-use adjoint: a baseline)."""
    return turned_off(_enabled)


class _Entry:
    """The sources are held weakly: an entry whose backward never runs (a forward abandoned or raising, the
    re-run forward of a recompute region, a consumer autograd never reaches) is dropped when its sources die,
    instead of keeping its outputs and their graph for ``_LIMIT`` more insertions. A dead source can never be
    served (``serves`` compares identities), so dropping it changes no hit or miss."""
    __slots__ = ("src", "versions", "out", "live", "__weakref__")

    def __init__(self, src, out, live):
        self.src, self.versions, self.out, self.live = tuple(map(weakref.ref, src)), _versions(src), out, live

    def serves(self, src) -> bool:
        return (self.live[0] and len(src) == len(self.src) and all(r() is b for r, b in zip(self.src, src))
                and _versions(src) == self.versions)

    def drop_with_sources(self, key) -> None:
        def dead(_ref, key=key, entry=weakref.ref(self)):
            hit = _MEMO.get(key)
            if hit is not None and hit[1] is entry():
                del _MEMO[key]

        self.src = tuple(weakref.ref(r(), dead) for r in self.src)


def _versions(ts) -> tuple:
    return tuple([-1 if t.__class__ is _PirValue else t._inplace_version() for t in ts])   # program values: none


def _store(key, entry) -> None:
    """Memoise ``entry``, forgetting entries by age (stored more than ``_LIMIT`` insertions ago), never by
    size: whether a consumer hits or misses decides whether a collective runs, so every rank must forget the
    same entries at the same call. The table's size differs between ranks (its keys are ids, which collide
    differently in every process), its insertions do not."""
    n = next(_INSERTED)
    _MEMO[key] = (n, entry)
    if entry.__class__ is _Entry:
        entry.drop_with_sources(key)
    _ORDER.append((n, key))
    while _ORDER[0][0] <= n - _LIMIT:
        old, k = _ORDER.popleft()
        if _MEMO.get(k, (None,))[0] == old:
            del _MEMO[k]


def _memo(key):
    """The memoised entry for ``key``, or None."""
    hit = _MEMO.get(key)
    return None if hit is None else hit[1]


# ---- parameters used through a cast or a view ------------------------------------------------------------
def note_derived(out, src) -> None:
    """``out`` is a data-free cast / view of parameter ``src`` (or of a tensor derived from one): a consumer
    split over a mesh dim leaves the parameter a partial gradient there, reduced in the data-parallel
    buckets with the parameter's direct uses, instead of an all_reduce of its own in backward."""
    p = src if isinstance(src, DistParameter) else derived_param(src)
    if p is None or out.__class__ is not DistTensor:
        return
    _remember(_DERIVED, out, p)


def _remember(table, t, value) -> None:
    """``table[t] = value`` until ``t`` dies: only dead entries are ever dropped (forgetting a live one would
    mix gradient states: a partial and a complete contribution to one gradient), and a dead one goes at once
    (it held a parameter of a dropped model)."""
    table.set(t, value)


def derived_param(v):
    """The DistParameter ``v`` is a data-free cast / view of, or None."""
    return _DERIVED.get(v)


def inherit_gradient_state(out, src) -> None:
    """``out`` is an element-wise, per-local function of ``src`` computed outside dispatch (an emulated
    autocast rounding): it keeps the gradient convention ``src`` was registered with, so that dispatch
    neither reduces a partial gradient twice nor misses the reduction of a derived parameter."""
    dims = partial_dims(src)
    if dims and out.__class__ is DistTensor:
        _remember(_PARTIAL, out, dims)
    p = src if isinstance(src, DistParameter) else derived_param(src)
    if p is not None and out.__class__ is DistTensor:
        _remember(_DERIVED, out, p)


def partial_dims(v) -> frozenset:
    """Mesh dims a tensor made by ``replicate_for_split`` keeps its gradient partial on (else empty)."""
    return _PARTIAL.get(v, frozenset())


def any_partial(leaves) -> bool:
    """Whether one of ``leaves`` keeps its gradient partial (see ``partial_dims``); cheap when none does."""
    return bool(len(_PARTIAL)) and any(partial_dims(v) for v in leaves if v.__class__ is DistTensor)


def complete_gradient(x):
    """``x``, or, for a tensor whose gradient is kept partial (``replicate_for_split``), a tensor of the same
    values whose gradient is complete on every rank: what code outside dispatch reads (a PyLayer, local code),
    as it computes a replicated reader's whole gradient on every rank. One shared entry per tensor: the
    complete contributions are kept on each group's first member, so the gather's reduce_scatter sums them once."""
    if x.__class__ is not DistTensor or not partial_dims(x) or not paddle.is_grad_enabled() or x.stop_gradient:
        return x
    return DistTensor._own(dict(shared(x, dict(x._locals), None, x.spec, (), x.mesh)), x.spec)


def shared(v, locs: dict, plan, spec, dims: tuple, mesh, outer=None) -> dict:
    """The locals of ``v`` laid out by ``plan`` (None: as they are) for a consumer split over mesh ``dims``,
    built once and shared by every consumer asking the same (see the module docstring). ``outer``: another
    memo key that dies with this entry."""
    if not _enabled[0]:
        locs = locs if plan is None else redistribute.execute(locs, plan)
        for m in dims:
            locs = C.mesh_groups_apply(locs, mesh, m, C.grad_all_reduce)
        return locs
    if plan is None and partial_dims(v) == frozenset(dims):
        return locs                                 # nothing to build (a memo entry would only pin ``v``)
    key = (id(v), spec, dims)
    src = tuple(locs.values())
    e = _memo(key)
    if e is not None and e.serves(src):
        return e.out
    live = [True]

    def done():
        live[0] = False
        for k in (key, outer):
            hit = _memo(k)
            if hit is not None and hit.live is live:
                del _MEMO[k]

    keep = partial_dims(v)
    for m in sorted(keep.difference(dims)):         # a complete gradient joining partial ones
        locs = C.mesh_groups_apply(locs, mesh, m, C.grad_keep_first)
    rest = [m for m in dims if m not in keep]
    if plan is not None:
        steps = redistribute.gathers_for_split(plan, rest)
        locs = redistribute.execute(locs, plan, {j: done for j in steps.values()} or None)
        rest = [m for m in rest if m not in steps]
    for m in rest:
        locs = C.mesh_groups_apply(locs, mesh, m, lambda h, r: C.grad_all_reduce(h, r, done))
    _store(key, _Entry(src, locs, live))
    return locs


def reshard_plan(src, dst):
    """The reshard plan from spec ``src`` to spec ``dst``, priced on the runtime's planning cluster."""
    from reshard import plan_reshard

    from autoparallel.comm.world import planning_cluster

    return plan_reshard(src.shape, src.dtype, src.mesh, src.placements, dst.placements, cluster=planning_cluster())


def replicate_for_split(x, m: int):
    """``x`` (a DistTensor) made replicated on mesh dim ``m`` for consumers split over ``m``: shared by
    every caller with the same ``x`` and its gradient kept partial on ``m`` until complete."""
    from autoparallel.dist_tensor import reshard
    from autoparallel.placement import Replicate

    target = x.spec.with_placements(tuple(Replicate() if i == m else p for i, p in enumerate(x.spec.placements)))
    if target == x.spec:
        return x
    if not _enabled[0]:
        return reshard(x, x.mesh, target.placements)
    key = (id(x), target, ("for_split", m))
    src = tuple(x._locals.values())
    e = _memo(key)
    if e is not None and e.serves(src):
        return e.out
    plan = reshard_plan(x.spec, target)
    if all(t.stop_gradient for t in src):
        return DistTensor(redistribute.execute(x._locals, plan), target)
    y = DistTensor._own(shared(x, dict(x._locals), plan, target, (m,), x.mesh, outer=key), target)
    inner = _memo((id(x), target, (m,)))
    _remember(_PARTIAL, y, frozenset((m,)))
    _store(key, _Entry(src, y, inner.live))
    return y


_forms.complete_gradient = complete_gradient          # DistTensor.full() / .local read marked tensors through it

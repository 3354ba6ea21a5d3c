"""What runs as a distributed backward starts (``DistTensor.backward``, ``paddle.autograd.backward``): the
retained-graph check (retained_graph.py), then the callbacks below.

The forward is over then, so every parameter's partial (data-parallel) mesh dims are known: an optimizer's
gradient reduction that has not planned its buckets yet plans them there, and the first backward already
reduces the gradients from its hooks (``p.grad`` read between the first backward and the first ``step()``
holds the data-parallel sum, as on every later step, instead of this rank's partial sum)."""
from __future__ import annotations

import weakref

from autoparallel.compat import SideData

_WAITING: "weakref.WeakSet" = weakref.WeakSet()
PARTIAL: dict = {}              # id -> weakref of each parameter whose gradient is a partial (data-parallel) sum
_NEW: list = []                                     # weakrefs of the parameters noted since the last backward


def note_partial(p) -> None:
    """``p``'s gradient is a partial sum over some mesh dim (its first split use in a forward)."""
    key = id(p)
    if key not in PARTIAL:                                      # by id: a tensor's == is elementwise
        PARTIAL[key] = weakref.ref(p, lambda _, k=key: PARTIAL.pop(k, None))
        _NEW.append(PARTIAL[key])


def new_partial() -> list:
    """The parameters that became partial since the last call (still alive)."""
    refs = list(_NEW)
    _NEW.clear()
    return [p for p in (r() for r in refs) if p is not None]


def wait(owner) -> None:
    """``owner.before_backward()`` runs as each distributed backward starts until it returns True."""
    _WAITING.add(owner)


def forget(owner) -> None:
    """``owner`` no longer reduces anything (another optimizer took its parameters over)."""
    _WAITING.discard(owner)


def run(tensors=(), retain_graph: bool = False) -> None:
    """Before ``paddle.autograd.backward(tensors, ..., retain_graph)`` of a distributed graph (``tensors``: this
    rank's shards; none on a rank outside the loss's mesh)."""
    from autoparallel.retained_graph import check_backward

    check_backward(tensors, retain_graph)
    for owner in list(_WAITING):
        if owner.before_backward(tensors):
            _WAITING.discard(owner)
    _PENDING[0] = False
    for fn in _AT_START:
        fn(tensors)                     # implicit_optimizer: a plain paddle optimizer's reduction from now on


_AT_START: list = []


def at_start(fn) -> None:
    """``fn(tensors)`` runs as every distributed backward starts (after the waiting owners), once registered."""
    if fn not in _AT_START:
        _AT_START.append(fn)


def backward(tensors, grads, retain_graph: bool, roots, **kw) -> None:
    """A distributed backward from ``roots`` (their local shards ``tensors``, seeded with ``grads``): ``run``,
    then the backward with the gradients of every cross-mesh reshard the roots depend on
    (cross_mesh_grad.py)."""
    from autoparallel import cross_mesh_grad

    run(tensors, retain_graph)
    cross_mesh_grad.backward(tensors, grads, retain_graph, roots, **kw)


_SCALED = SideData()            # local tensors of losses a paddle GradScaler scaled
_PENDING = [False]              # a GradScaler scaled a loss since the last backward started


def mark_scaled(local_tensors) -> None:
    for t in local_tensors:
        _SCALED.set(t, True)
    _PENDING[0] = True


def scaled(tensors) -> bool:
    """Whether a GradScaler scaled (any of) the tensors a backward starts from, or a loss since the last backward
    started: the backward may start from a tensor computed from the scaled loss (``(scaler.scale(loss) / k)``,
    ``.sum()``), which carries the scale but not the mark."""
    return _PENDING[0] or any(t in _SCALED for t in tensors)

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
_LOST: list = []        # this rank's cross-mesh sends whose gradient cannot come back, since its last backward


def wait(owner) -> None:
    """``owner.before_backward()`` runs as each distributed backward starts until it returns True."""
    _WAITING.add(owner)


def forget(owner) -> None:
    """``owner`` no longer reduces anything (another optimizer took its parameters over)."""
    _WAITING.discard(owner)


def run(tensors=(), retain_graph: bool = False) -> None:
    """Before ``paddle.autograd.backward(tensors, ..., retain_graph)`` of a distributed graph."""
    from autoparallel.retained_graph import check_backward

    if not tensors:
        raise NotImplementedError(
            "backward() of a tensor this rank holds no part of (it lives on a mesh of other ranks): in a launched "
            "job a gradient does not flow back across ranks through ap.reshard between meshes of different ranks "
            "(ap.simulate runs it); call backward on the ranks of the loss's mesh only (`if rank in "
            "loss.mesh.process_ids`) and pass tensors between models on disjoint ranks detached")
    if _LOST:
        why = _LOST[0]
        _LOST.clear()
        raise NotImplementedError(why)
    check_backward(tensors, retain_graph)
    if not _WAITING:
        return
    for owner in list(_WAITING):
        if owner.before_backward(tensors):
            _WAITING.discard(owner)


_SCALED = SideData()            # local tensors of losses a paddle GradScaler scaled


def mark_scaled(local_tensors) -> None:
    for t in local_tensors:
        _SCALED.set(t, True)


def scaled(tensors) -> bool:
    """Whether a GradScaler scaled (any of) the tensors a backward starts from."""
    return any(t in _SCALED for t in tensors)



def note_lost_gradient(src, mesh) -> None:
    """``ap.reshard`` of a tensor that needs a gradient to a mesh without some of its ranks, on real ranks: the
    gradient would not come back to those ranks (nothing sends it), so a loss term they also hold would train
    without it. Noted on those ranks as the tensor leaves; their next backward raises (``run``), on every rank
    before any transfer (the ranks without the loss raise there too). ``ap.simulate`` runs it."""
    import paddle

    from autoparallel.comm.world import current_world

    lost = sorted(set(src.mesh.process_ids) - set(getattr(mesh, "process_ids", src.mesh.process_ids)))
    if not lost or src.stop_gradient or not paddle.is_grad_enabled() or current_world().is_simulated:
        return
    _LOST.append(f"a tensor that needs a gradient went by ap.reshard from ranks {sorted(src.mesh.process_ids)} to "
                 f"ranks {sorted(mesh.process_ids)}: in a launched job its gradient does not flow back to ranks "
                 f"{lost}, so this backward would miss it. Pass it detached (`ap.reshard(x.detach(), ...)`), keep "
                 f"both models on the same ranks, or use strategy.pipeline_parallel for stages on different ranks")

"""A user's own ``paddle.distributed`` collectives on distributed tensors: correct, or refused by name.

A DistParameter is a real paddle Parameter holding this rank's shard, so paddle's collectives accept it and act
on the shard: ``dist.broadcast(model.fc1.weight, src=0)`` on a tensor-parallel weight copied rank 0's shard over
every other rank's (a silent wrong value), ``dist.all_reduce`` summed different shards. A DistTensor (a wrapper)
made paddle fail with ``argument (position 1) must be Tensor, but got DistTensor``.

The rule: a distributed tensor replicated on every mesh dim of more than one rank holds the same values on each
rank, as a plain tensor in a data-parallel script does; the collective runs on its local tensor and gives what it
gives on plain tensors (``all_reduce`` of a replicated loss sums equal values: divide by the world size as usual).
A Shard or Partial placement, or a group reaching ranks outside the tensor's mesh, is refused before anything
moves (TypeError / ValueError naming the call, the tensor's layout and what to use). In ``ap.simulate`` every rank
lives in this process: ``all_reduce`` and ``broadcast`` of a replicated tensor are computed over the simulated
ranks; the other collectives are refused there.
"""
from __future__ import annotations

import functools
import sys

from autoparallel import patches

# paddle.distributed collectives that take tensors (or lists of tensors)
GUARDED = ("all_reduce", "broadcast", "reduce", "all_gather", "scatter", "gather", "reduce_scatter", "alltoall",
           "alltoall_single", "send", "recv", "isend", "irecv")
_SIM_EMULATED = ("all_reduce", "broadcast")
_POINT_TO_POINT = ("send", "recv", "isend", "irecv")
NOTED_ONLY = ("all_gather_object", "broadcast_object_list", "scatter_object_list", "gather_object", "barrier")


def _dists(args, kwargs) -> list:
    from autoparallel.dist_tensor import is_dist

    found = []
    for a in list(args) + list(kwargs.values()):
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            if is_dist(x):
                found.append(x)
    return found


def _not_replicated(x) -> list:
    """(mesh dim name, placement) of every dim of more than one rank the tensor is not replicated on."""
    mesh = x.mesh
    return [(mesh.dim_names[i], p) for i, p in enumerate(x.placements)
            if mesh.shape[i] > 1 and not p.is_replicate()]


def _group_ranks(args, kwargs, world_size: int) -> list:
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if hasattr(a, "ranks") and hasattr(a, "nranks")), None)
    return list(group.ranks) if group is not None else list(range(world_size))


def check(name: str, args, kwargs, world) -> list:
    """The distributed tensors among the arguments of ``paddle.distributed.<name>``, after refusing the ones the
    collective would give a wrong value on."""
    found = _dists(args, kwargs)
    for x in found:
        kind = "DistParameter" if hasattr(x, "_ap_spec") else "DistTensor"
        layout = ", ".join(f"{p} on mesh dim {d!r}" for d, p in _not_replicated(x))
        if layout:
            raise TypeError(
                f"paddle.distributed.{name} on a {kind} of global shape {list(x.global_shape)} placed {layout}: "
                f"this rank holds a shard (or a partial sum), so the collective would mix different parts of the "
                f"tensor (broadcast: every rank would get rank src's shard). Its global value is already defined "
                f"by its placements: read it with x.full() (every rank), change its layout with ap.reshard, or call "
                f"paddle.distributed.{name} on x.full() / x.local if a per-rank value is what is meant")
        ranks = _group_ranks(args, kwargs, world.world_size)
        outside = sorted(set(ranks) - set(x.mesh.process_ids))
        if outside:
            raise ValueError(f"paddle.distributed.{name} over ranks {ranks} on a {kind} of mesh "
                             f"{x.mesh.mesh.tolist()}: ranks {outside} hold no part of it; pass a group of the "
                             f"mesh's ranks (x.mesh.get_group(dim_name))")
    if found and world.is_simulated and name not in _SIM_EMULATED:
        raise NotImplementedError(f"paddle.distributed.{name} on a distributed tensor inside ap.simulate: every "
                                  f"rank lives in this process; all_reduce and broadcast are simulated, {name} runs "
                                  f"in a launched job (python -m paddle.distributed.launch)")
    return found


def _simulated(name: str, args, kwargs, found) -> None:
    """all_reduce / broadcast of replicated tensors over the simulated ranks (every rank holds the same)."""
    import paddle

    from autoparallel.comm.world import current_world
    from autoparallel.dist_tensor import as_dist

    if name == "broadcast":
        return
    op = kwargs.get("op", args[1] if len(args) > 1 else paddle.distributed.ReduceOp.SUM)
    n = len(_group_ranks(args, kwargs, current_world().world_size))
    RO = paddle.distributed.ReduceOp
    with paddle.no_grad():
        for x in found:
            for local in as_dist(x)._locals.values():
                if op == RO.SUM:
                    paddle.assign(local * n, output=local)
                elif op == RO.PROD:
                    paddle.assign(local ** n, output=local)
                elif op not in (RO.MAX, RO.MIN, RO.AVG):
                    raise ValueError(f"paddle.distributed.all_reduce: unknown op {op!r}")


def _unwrap(a):
    from autoparallel.dist_tensor import DistTensor

    if isinstance(a, DistTensor):
        return a.local
    if isinstance(a, (list, tuple)) and any(isinstance(x, DistTensor) for x in a):
        return type(a)(x.local if isinstance(x, DistTensor) else x for x in a)
    return a


def _from_library(frame) -> bool:
    """The call comes from autoparallel or paddle itself (noted where it starts, or part of a noted call); a
    wrapper that only hands the user's call on (the monitor's timing, ``collective_forms``) is looked past."""
    while frame is not None and frame.f_code in patches.PASS_THROUGH:
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").startswith(("autoparallel.", "paddle."))


def _note(name: str, args, kwargs) -> None:
    """A collective of the user's own code goes into the collective log like the library's (comm/collective_log.py):
    one made on some ranks only is then named by the watchdog instead of pairing with another rank's next
    collective. Point-to-point calls differ by rank (send / recv) and are not noted; nor are the library's and
    paddle's own calls (they are noted where they start, or are part of a noted call). The kind and size are noted,
    not the line: ranks may make one collective from different lines (``if rank == 0: broadcast_object_list(
    [data], src=0) else: broadcast_object_list(slot, src=0)``)."""
    if name in _POINT_TO_POINT:
        return
    import paddle.distributed as dist

    from autoparallel.comm import collective_log

    if not collective_log.enabled() or not dist.is_initialized():
        return
    ranks = _group_ranks(args, kwargs, dist.get_world_size())
    if len(ranks) > 1 and dist.get_rank() in ranks:          # paddle makes nothing on a group without this rank
        x = next((a for a in args if hasattr(a, "shape") and hasattr(a, "dtype")), None)
        collective_log.LOG.note(name, ranks, None if x is None else (x.shape, x.dtype), site=False)


def _sharded_grad_owner(args, kwargs):
    """The sharded DistParameter whose gradient is among the plain tensor arguments (``dist.all_reduce(p.grad)``
    of a tensor-parallel weight: ``p.grad`` is this rank's shard of the gradient, a plain tensor), else None.
    Looked up among the parameters of live optimizer wrappers (parallel/grads.py)."""
    import paddle

    from autoparallel.parallel.grads import _SYNCS

    ptrs = {}
    for a in list(args) + list(kwargs.values()):
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(x, paddle.Tensor) and x._is_initialized():
                ptrs[x.data_ptr()] = x
    if not ptrs:
        return None
    for sync in list(_SYNCS):
        try:
            params = list(sync.params_fn())
        except AttributeError:          # a wrapper whose parameters live elsewhere (ZeRO keeps its own lists)
            continue
        for p in params:
            if not hasattr(p, "_ap_spec") or not _not_replicated(p):
                continue
            g = paddle.Tensor.grad.__get__(p)
            if g is not None and g._is_initialized() and g.data_ptr() in ptrs:
                return p
    return None


def _refuse_sharded_grad(name: str, args, kwargs) -> None:
    p = _sharded_grad_owner(args, kwargs)
    if p is not None:
        layout = ", ".join(f"{q} on mesh dim {d!r}" for d, q in _not_replicated(p))
        raise TypeError(f"paddle.distributed.{name} on the gradient of {p.name} (global shape "
                        f"{list(p.global_shape)}, placed {layout}): p.grad holds this rank's shard of the gradient, "
                        f"so the collective would mix different parts of it. Gradients of parameters distributed by "
                        f"autoparallel are reduced over the data axis by the optimizer it returned: do not sync them "
                        f"by hand")


def _wrap(name: str, orig):
    @functools.wraps(orig)
    def guarded(*args, **kwargs):
        if _from_library(sys._getframe(1)):                 # the library's transport passes its own shards
            return orig(*args, **kwargs)
        found = _dists(args, kwargs)
        if not found:
            _refuse_sharded_grad(name, args, kwargs)
            _note(name, args, kwargs)
            return orig(*args, **kwargs)
        from autoparallel.comm.world import current_world

        world = current_world()
        found = check(name, args, kwargs, world)
        if world.is_simulated:
            return _simulated(name, args, kwargs, found)
        _note(name, args, kwargs)
        return orig(*[_unwrap(a) for a in args], **{k: _unwrap(v) for k, v in kwargs.items()})

    guarded.__wrapped__ = orig
    return guarded


def install() -> None:
    import paddle.distributed as dist
    from paddle.distributed.communication import stream

    # paddle.distributed.stream.* too (the same module object) for the guarded ones
    for owners, names, make in (((dist, stream), GUARDED, _wrap), ((dist,), NOTED_ONLY, _noted)):
        for owner in owners:
            for name in names:
                orig = getattr(owner, name, None)
                if orig is None or orig in _OURS:
                    continue
                g = make(name, orig)
                _OURS.add(g)
                patches.patch(owner, name, g)


def _noted(name: str, orig):
    @functools.wraps(orig)
    def noted(*args, **kwargs):
        if not _from_library(sys._getframe(1)):
            _note(name, args, kwargs)
        return orig(*args, **kwargs)

    noted.__wrapped__ = orig
    return noted


_OURS: set = set()          # the guards installed (a re-install does not wrap them again)

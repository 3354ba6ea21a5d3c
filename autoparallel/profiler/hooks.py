"""Where ap.profile listens: module attributes wrapped while a profile is open, restored after.

    dispatch.run               "dispatch"      autoparallel's op dispatch (rule, cache, layouts, wrapping)
    dispatch._execute          "compute.ops"   the local paddle op(s) of a dispatched call
    redistribute.execute       "reshard"       a reshard's own work (slicing, padding, concatenating)
    RealTransport.<collective> "comm.overhead" the transport around a paddle.distributed call
    PipelineModule._send_*/_recv_*  "pipeline.p2p"  a pipeline's point-to-point actions
    grads._pack/_unpack, GradientSync.flush, Reducer.before/after_accumulate
                               "grad.sync"     gradient buckets: packing, unpacking, backward-hook bookkeeping
    paddle.Tensor.backward, paddle.autograd.backward
                               "compute.backward"   autograd's backward (kernels; nested hooks excluded)
    <optimizer class>.step     "compute.optimizer"  paddle optimizers and autoparallel's wrappers
    paddle.distributed.<fn>    collective      (comm/counter.py) one call, with its bytes and group
    SimTransport.<collective>  collective      (simulated world) one in-process collective

The wrappers look the originals up once, so nothing is paid when no profile is open; calls from other
threads (a watchdog's) pass through untimed.
"""
from __future__ import annotations

import contextlib
from threading import get_ident

from autoparallel.comm.cost import collective_bytes
from autoparallel.comm.sizes import nbytes

_TRANSPORT_METHODS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
_PIPELINE_ACTIONS = ("_send_f", "_recv_f", "_send_b", "_recv_b")


def _timed(tl, orig, category):
    owner = tl.owner

    def timed(*args, **kwargs):
        if get_ident() != owner:
            return orig(*args, **kwargs)
        tl.enter(category)
        try:
            return orig(*args, **kwargs)
        finally:
            tl.leave()

    return timed


def _nbytes(t) -> float:
    return float(nbytes(t))


def _sim_held(name, args) -> tuple:
    """(bytes one member holds entering, group size) of a SimTransport call's arguments."""
    if name == "send_recv":
        xs, pairs = args[0], args[1]
        return sum(_nbytes(xs[s]) for s, d in pairs if s != d), 2
    xs, ranks = args[0], list(args[1])
    if name == "all_to_all":
        return sum(_nbytes(c) for c in xs[ranks[0]]), len(ranks)
    if name == "broadcast":
        return _nbytes(xs[args[2]]), len(ranks)
    return _nbytes(xs[ranks[0]]), len(ranks)


def _sim_collective(tl, orig, name):
    def collective(self, *args):
        held, n = _sim_held(name, args)
        sent = held if name == "send_recv" else collective_bytes(name, held, n)
        ranks = tuple(sorted({r for p in args[1] for r in p})) if name == "send_recv" else tuple(args[1])
        tl.enter_collective(name)
        try:
            return orig(self, *args)
        finally:
            tl.leave_collective(name, sent, n, held, ranks)

    return collective


class _Patches:
    def __init__(self):
        self.saved = []              # (owner, attr, original or None when inherited)

    def wrap(self, owner, attr, make) -> None:
        """Replace ``owner.attr`` by ``make(original)``."""
        if not hasattr(owner, attr):
            raise RuntimeError(f"ap.profile cannot hook {getattr(owner, '__name__', owner)}.{attr}: it no longer "
                               f"exists (update autoparallel/profiler/hooks.py)")
        orig = owner.__dict__.get(attr, getattr(owner, attr)) if isinstance(owner, type) else getattr(owner, attr)
        self.saved.append((owner, attr, owner.__dict__.get(attr) if isinstance(owner, type) else orig))
        setattr(owner, attr, make(orig))

    def time(self, tl, owner, attr, category) -> None:
        self.wrap(owner, attr, lambda orig: _timed(tl, orig, category))

    def restore(self) -> None:
        for owner, attr, orig in reversed(self.saved):
            if orig is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, orig)
        self.saved.clear()


def _optimizer_classes() -> list:
    """paddle's optimizer classes that define ``step`` and autoparallel's optimizer wrappers."""
    import paddle

    from autoparallel.parallel import amp, optimizer, sharding

    found, todo = [], [paddle.optimizer.Optimizer]
    while todo:
        cls = todo.pop()
        if "step" in cls.__dict__ and cls not in found:
            found.append(cls)
        todo.extend(cls.__subclasses__())
    for cls in (optimizer.ShardedOptimizer, sharding.ZeroOptimizer, amp.AmpOptimizer):
        if "step" in cls.__dict__ and cls not in found:
            found.append(cls)
    return found


def _patch_training(p, tl) -> None:
    import paddle

    from autoparallel.parallel import grads, reducer

    p.time(tl, paddle.Tensor, "backward", "compute.backward")
    p.time(tl, paddle.autograd, "backward", "compute.backward")
    for cls in _optimizer_classes():
        p.time(tl, cls, "step", "compute.optimizer")
    for name in ("_pack", "_unpack"):
        p.time(tl, grads, name, "grad.sync")
    p.time(tl, grads.GradientSync, "flush", "grad.sync")
    for name in ("before_accumulate", "after_accumulate"):
        p.time(tl, reducer.Reducer, name, "grad.sync")


@contextlib.contextmanager
def installed(tl):
    """Wrap every hook point for timeline ``tl``; yields the comm/counter.py log of paddle.distributed calls."""
    from autoparallel import dispatch, redistribute
    from autoparallel.comm import transport
    from autoparallel.comm.counter import count_comm
    from autoparallel.parallel.pipeline import runtime

    p = _Patches()
    try:
        p.time(tl, dispatch, "run", "dispatch")
        p.time(tl, dispatch, "_execute", "compute.ops")
        p.time(tl, redistribute, "execute", "reshard")
        for name in _TRANSPORT_METHODS:
            p.time(tl, transport.RealTransport, name, "comm.overhead")
            p.wrap(transport.SimTransport, name, lambda orig, name=name: _sim_collective(tl, orig, name))
        for name in _PIPELINE_ACTIONS:
            p.time(tl, runtime.PipelineModule, name, "pipeline.p2p")
        _patch_training(p, tl)
        with count_comm(observer=tl) as log:
            yield log
    finally:
        p.restore()

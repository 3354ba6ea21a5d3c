"""One-element results readable on any rank alone: a Partial scalar is reduced where every rank makes it.

A loss is a one-element tensor that is Partial over the data axes (each rank holds its batch's term) and
reading it -- ``float(loss)``, ``loss.item()``, ``print(loss)``, ``f"{loss}"``, ``if loss < 0.1:`` -- needs
the sum. If that sum were taken at read time, ``if rank == 0: print(loss.item())`` would make a collective
on rank 0 alone. Instead, dispatch hands every one-element output whose placements hold a Partial to
``settle``, which reshards it to Replicate right there, in the forward, where every rank passes: reads are
then local on every rank. The reduction runs outside autograd and the result is tied to ``t`` by
``t + (reduced - t).detach()``: the gradient is the all_reduce's adjoint (the identity for a sum) and the
graph holds no collective (a retained graph can be backwarded again). Partial(max/min) results are left as
they are. Cost: one all_reduce of one element per such result, made at creation instead of at the first read (free when the value is read on every rank anyway, as a training loop's
``float(loss)`` does; ``tools/bench_agreement.py`` measures it). Results of more than one element keep their
placements: gathering them is the user's collective (comm/agreement.py refuses it on some ranks only).
``AP_SCALAR_REDUCE=off`` keeps one-element results Partial.
"""
from __future__ import annotations


import paddle

from autoparallel.comm.world import current_world
from autoparallel.compat import building_static_program
from autoparallel.placement import Partial, Replicate
from autoparallel.switch import env_on

_TARGETS: dict = {}          # spec -> placements to settle to (None: leave as is)
_LIMIT = 4096


def enabled() -> bool:
    return env_on("AP_SCALAR_REDUCE", True)


def _target(spec):
    partial = [p for p in spec.placements if isinstance(p, Partial)]
    if spec.numel != 1 or not partial or any(p.reduce_type not in ("sum", "avg") for p in partial):
        return None                          # max/min: the gradient routes to the winner; left to the reader
    return tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements)


def target(spec):
    """The placements a one-element result with ``spec`` is settled to, or None."""
    try:
        return _TARGETS[spec]
    except KeyError:
        pass
    if len(_TARGETS) > _LIMIT:
        _TARGETS.clear()
    got = _TARGETS[spec] = _target(spec)
    return got


def settle(t):
    """``t`` itself, or -- a one-element Partial(sum/avg) result of an eager op -- ``t`` reduced to Replicate.

    The reduction runs without autograd; the result's local value is ``reduced + (f * t - (f * t).detach())``
    (``f``: the product of 1/n over the avg dims): exactly the reduced value, bit for bit on every rank (a finite
    x - x is 0; ``t + (reduced - t)`` rounds differently per rank), with the all_reduce's adjoint (the identity
    for a sum) as its gradient and no PyLayer in the graph (paddle crashes backwarding a PyLayer's node twice): a
    graph backwarded with ``retain_graph=True`` can be backwarded
    again, as before."""
    placements = target(t._spec)
    if placements is None or not t._locals or not paddle.in_dynamic_mode() or building_static_program() \
            or not enabled():
        return t
    mesh = t._spec.mesh
    if current_world().is_simulated and len(t._locals) < mesh.size:
        return t                                 # one simulated rank alone (a gradient hook): no collective
    from autoparallel.dist_tensor import DistTensor, reshard

    reduced = reshard(t.detach(), mesh, placements)
    f = 1.0
    for d, p in enumerate(t._spec.placements):
        if isinstance(p, Partial) and p.reduce_type == "avg":
            f /= mesh.shape[d]
    out = {}
    for r, x in t._locals.items():
        if x.stop_gradient:
            out[r] = reduced._locals[r]
        else:
            mine = x * f if f != 1.0 else x
            out[r] = _plus_tie(reduced._locals[r], mine)
    return DistTensor._own(out, reduced._spec)


def _plus_tie(reduced, mine):
    """``reduced + _tie(mine)``; float16/bfloat16 in float32 and cast back (exact: the tie is 0), as paddle has no CPU
    add kernel for them and a one-process loss needs none."""
    if mine.dtype not in (paddle.float16, paddle.bfloat16):
        return reduced + _tie(mine)
    return (reduced.astype("float32") + _tie(mine.astype("float32"))).astype(mine.dtype)


def _tie(mine):
    """0 with the identity gradient. ``mine - mine.detach()`` is nan for a non-finite term (an overflowing loss on
    one rank): there a zero forward with the identity backward keeps the reduced inf and hands that rank's inf/nan
    gradient on (masking it to 0 would drop the rank's gradient and hide the overflow from the loss scaler)."""
    if bool(paddle.isfinite(mine).all()):
        return mine - mine.detach()
    return _ZeroTie.apply(mine)


class _ZeroTie(paddle.autograd.PyLayer):
    @staticmethod
    def forward(ctx, x):
        return paddle.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        return g

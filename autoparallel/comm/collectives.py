"""Shape-aware, autograd-aware collectives over one group of a mesh dim.

Each function takes ``xs``: {rank: local tensor} for the group members this process holds and
``ranks``: the group in mesh order, and returns {rank: tensor} for the same members. Uneven shards are
padded to the chunk size before communicating, validated, and trimmed after (gloo aborts or silently
mis-sizes an uneven all_gather). Every collective is a PyLayer whose backward is its adjoint under the
gradient convention of DistTensor: a rank's local gradient is the slice of the true gradient for a
Shard placement and the whole true gradient for Replicate and Partial placements.

    forward                     backward
    all_gather  (S -> R)        slice        (take my chunk of the replicated gradient)
    slice       (R -> S)        all_gather
    all_reduce  (P -> R)        identity     (avg: scale 1/n; max/min: route to the winning rank)
    reduce_scatter (P -> S)     all_gather
    all_to_all  (S(a) -> S(b))  all_to_all   (S(b) -> S(a))
    to_partial  (R -> P)        identity for sum; all_reduce(sum) for avg/max/min

For a Partial tensor the local gradient is the derivative with respect to this rank's term:
the true gradient for P(sum), 1/n of it for P(avg), and for P(max)/P(min) the true gradient on the
rank holding the extreme (ties split evenly) and zero elsewhere.
"""
from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from autoparallel.comm.sizes import numel
from autoparallel.comm.transport import transport_for
from autoparallel.comm.world import current_world
from autoparallel.local_mode import local_mode


class _Comm(PyLayer):
    """Runs ``fwd`` on {rank: tensor} and ``bwd`` on {rank: grad}; tensors travel in ``order``."""

    @staticmethod
    def forward(ctx, fwd, bwd, order, *ts):
        ctx.fwd, ctx.bwd, ctx.order = fwd, bwd, order
        ctx.stopped = tuple(t.stop_gradient for t in ts)
        with paddle.no_grad():
            outs = fwd(dict(zip(order, ts)))
        return tuple(outs[r] for r in order)

    @staticmethod
    def backward(ctx, *gs):
        if paddle.is_grad_enabled() and any(not g.stop_gradient for g in gs):
            return _for_inputs(ctx, _differentiable_backward(ctx, gs))
        with paddle.no_grad(), local_mode():
            outs = ctx.bwd(dict(zip(ctx.order, gs)))
        return _for_inputs(ctx, tuple(outs[r] for r in ctx.order))


def _for_inputs(ctx, grads: tuple) -> tuple:
    """None in place of the gradient of a member's tensor that needed none (paddle's PyLayer refuses a gradient
    for an input whose stop_gradient was set: a rank's local computed from constants only, beside members whose
    locals need gradients)."""
    return tuple(None if stopped else g for stopped, g in zip(ctx.stopped, grads))


def _differentiable_backward(ctx, gs):
    """The backward of a ``create_graph=True`` pass (``paddle.grad`` of a gradient penalty, a Hessian): the
    adjoint runs as a collective itself, whose own adjoint is the forward (the pairs in the table above are
    adjoint both ways under the gradient convention), so higher derivatives flow through the communication.
    P(max)/P(min) (a data-dependent routing) is refused."""
    if getattr(ctx.fwd, "nonlinear", False):
        raise NotImplementedError("a second derivative through an all_reduce(max/min) (a Partial('max'/'min') "
                                  "reduction) is not supported; reduce with sum or avg on that path")
    with local_mode():
        outs = _run_local(dict(zip(ctx.order, gs)), ctx.bwd, ctx.fwd)
    return tuple(outs[r] for r in ctx.order)


def _run(xs, fwd, bwd):
    with local_mode():
        return _run_local(xs, fwd, bwd)


def _run_local(xs, fwd, bwd):
    order = list(xs)
    if not order:
        return {}
    ts = [xs[r] for r in order]
    if not paddle.in_dynamic_mode():                   # lowered into a paddle static program (graph/jit.py)
        from autoparallel.graph.jit import static_comm
        return static_comm(xs, fwd, bwd)
    if all(t.stop_gradient for t in ts):
        with paddle.no_grad():
            return fwd(dict(xs))
    return dict(zip(order, _Comm.apply(fwd, bwd, order, *ts)))


# ---- shape helpers ---------------------------------------------------------------------------------
def _narrow(x, axis, start, stop):
    return paddle.slice(x, axes=[axis], starts=[start], ends=[stop])


def _trim(x, axis, n):
    """``x`` cut to ``n`` along ``axis`` (itself when already that long; only for inputs of a concat)."""
    return x if x.shape[axis] == n else _narrow(x, axis, 0, n)


def _pad_to(x, axis, size):
    n = x.shape[axis]
    if n == size:
        return x
    if n > size:
        raise ValueError(f"collective invariant broken: a shard of {n} along axis {axis} exceeds the chunk size {size}")
    shape = list(x.shape)
    shape[axis] = size - n
    return paddle.concat([x, paddle.zeros(shape, dtype=x.dtype)], axis=axis)


def _check_sizes(xs, ranks, axis, sizes):
    for r, x in xs.items():
        k = ranks.index(r)
        if x.shape[axis] != sizes[k]:
            raise ValueError(f"rank {r} holds {x.shape[axis]} rows along axis {axis}, the layout says {sizes[k]}")


def _empty(like, axis, size):
    shape = list(like.shape)
    shape[axis] = size
    return paddle.zeros(shape, dtype=like.dtype)


# ---- raw (no autograd) implementations ------------------------------------------------------------
def _gather_raw(xs, ranks, axis, sizes):
    _check_sizes(xs, ranks, axis, sizes)
    total, c = sum(sizes), max(sizes) if sizes else 0
    some = next(iter(xs.values()))
    if c == 0 or _numel_without(some, axis) == 0:
        return {r: _empty(x, axis, total) for r, x in xs.items()}
    padded = {r: _pad_to(x, axis, c) for r, x in xs.items()}
    got = transport_for(current_world()).all_gather(padded, ranks)
    return {r: paddle.concat([_trim(p, axis, s) for p, s in zip(parts, sizes)], axis=axis)
            for r, parts in got.items()}


def _numel_without(x, axis):
    n = 1
    for i, s in enumerate(x.shape):
        if i != axis:
            n *= s
    return n


def _slice_raw(xs, ranks, axis, sizes):
    out = {}
    for r, x in xs.items():
        k = ranks.index(r)
        start = sum(sizes[:k])
        out[r] = _narrow(x, axis, start, start + sizes[k])
    return out


def _reduce_raw(xs, ranks, op):
    some = next(iter(xs.values()))
    if numel(some) == 0 or len(ranks) == 1:
        return {r: x.clone() for r, x in xs.items()}
    return transport_for(current_world()).all_reduce(xs, ranks, op)


def _reduce_scatter_raw(xs, ranks, axis, sizes, op):
    n, c = len(ranks), max(sizes)
    some = next(iter(xs.values()))
    if c == 0 or numel(some) == 0 or n == 1:
        return _slice_raw(_reduce_raw(xs, ranks, op), ranks, axis, sizes)
    padded = {r: _pad_to(x, axis, n * c) for r, x in xs.items()}
    got = transport_for(current_world()).reduce_scatter(padded, ranks, op, axis)
    return {r: _narrow(got[r], axis, 0, sizes[ranks.index(r)]) for r in got}


def _all_to_all_raw(xs, ranks, split_axis, concat_axis, split_sizes, concat_sizes):
    """Member k splits along ``split_axis`` into chunks of ``split_sizes`` and sends chunk j to member j;
    member j concatenates what it receives along ``concat_axis`` (member k's piece has concat_sizes[k])."""
    _check_sizes(xs, ranks, concat_axis, concat_sizes)
    cs, cc = max(split_sizes), max(concat_sizes)
    some = next(iter(xs.values()))
    if cs == 0 or cc == 0 or _numel_without(some, concat_axis) == 0:
        out = {}
        for r, x in xs.items():
            k = ranks.index(r)
            y = _empty(x, split_axis, split_sizes[k])
            out[r] = _empty(y, concat_axis, sum(concat_sizes))
        return out
    chunks = {}
    for r, x in xs.items():
        pieces, start = [], 0
        for s in split_sizes:
            p = _narrow(x, split_axis, start, start + s)
            start += s
            pieces.append(_pad_to(_pad_to(p, split_axis, cs), concat_axis, cc))
        chunks[r] = pieces
    got = transport_for(current_world()).all_to_all(chunks, ranks)
    out = {}
    for r, parts in got.items():
        k = ranks.index(r)
        trimmed = [_narrow(_narrow(p, split_axis, 0, split_sizes[k]), concat_axis, 0, concat_sizes[j])
                   for j, p in enumerate(parts)]
        out[r] = paddle.concat(trimmed, axis=concat_axis)
    return out


# ---- public, differentiable collectives -------------------------------------------------------------
def all_gather(xs, ranks, axis, sizes):
    """S(axis) -> R over ``ranks``; member k holds ``sizes[k]`` rows along ``axis``."""
    return _run(xs, lambda v: _gather_raw(v, ranks, axis, sizes), lambda g: _slice_raw(g, ranks, axis, sizes))


def slice_shard(xs, ranks, axis, sizes):
    """R -> S(axis): each member keeps its chunk (no communication)."""
    return _run(xs, lambda v: _slice_raw(v, ranks, axis, sizes), lambda g: _gather_raw(g, ranks, axis, sizes))


def all_reduce(xs, ranks, op="sum"):
    """P(op) -> R over ``ranks``."""
    if op in ("sum",):
        bwd = lambda g: dict(g)
    elif op == "avg":
        bwd = lambda g: {r: t / len(ranks) for r, t in g.items()}
    else:
        saved = {}

        def fwd_mm(v):
            out = _reduce_raw(v, ranks, op)
            saved.update({r: (v[r] == out[r]).astype(v[r].dtype) for r in v})
            return out

        def bwd_mm(g):                       # split ties evenly between the winners
            ties = _reduce_raw(dict(saved), ranks, "sum")
            return {r: t * saved[r] / paddle.clip(ties[r], min=1.0) for r, t in g.items()}

        fwd_mm.nonlinear = True
        return _run(xs, fwd_mm, bwd_mm)
    return _run(xs, lambda v: _reduce_raw(v, ranks, op), bwd)


def reduce_scatter(xs, ranks, axis, sizes, op="sum"):
    """P(op) -> S(axis) over ``ranks``."""
    if op not in ("sum", "avg"):
        return slice_shard(all_reduce(xs, ranks, op), ranks, axis, sizes)
    scale = (1.0 / len(ranks)) if op == "avg" else 1.0
    return _run(xs, lambda v: _reduce_scatter_raw(v, ranks, axis, sizes, op),
                lambda g: {r: t * scale for r, t in _gather_raw(g, ranks, axis, sizes).items()})


def all_to_all(xs, ranks, src_axis, dst_axis, src_sizes, dst_sizes):
    """S(src_axis) -> S(dst_axis): member k holds src_sizes[k] along src_axis and ends with dst_sizes[k]
    along dst_axis."""
    return _run(xs, lambda v: _all_to_all_raw(v, ranks, dst_axis, src_axis, dst_sizes, src_sizes),
                lambda g: _all_to_all_raw(g, ranks, src_axis, dst_axis, src_sizes, dst_sizes))


def to_partial(xs, ranks, op="sum"):
    """R -> P(op): sum keeps the value on the group's first member and zeros elsewhere; avg/max/min keep it."""
    def fwd(v):
        if op != "sum":
            return {r: t.clone() for r, t in v.items()}
        return {r: t.clone() if ranks.index(r) == 0 else paddle.zeros_like(t) for r, t in v.items()}

    bwd = (lambda g: dict(g)) if op == "sum" else (lambda g: _reduce_raw(g, ranks, "sum"))
    return _run(xs, fwd, bwd)


def broadcast(xs, ranks, src):
    """Every member gets ``src``'s tensor (not differentiable; used for initialisation)."""
    with paddle.no_grad():
        return transport_for(current_world()).broadcast(xs, ranks, src)


def send_recv(xs, pairs, recv_shapes, dtype):
    """Point-to-point: for each (src, dst) pair, dst receives src's tensor (recv_shapes: {dst: shape}).
    Differentiable in the simulated world (the adjoint sends the gradient back); on real ranks only a pair that
    stays on its rank (a copy kept by a rank of both meshes) is."""
    like = {d: (list(s), dtype) for d, s in recv_shapes.items()}
    world = current_world()
    if world.is_simulated and any(not t.stop_gradient for t in xs.values()):
        outs = _SendRecv.apply(*[xs[s] for s, _ in pairs])
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        return {d: t for (_, d), t in zip(pairs, outs)}
    own = {d: xs[s].clone() for s, d in pairs if s == d and s in xs}
    with paddle.no_grad():
        return {**transport_for(world).send_recv(xs, [(s, d) for s, d in pairs if s != d], like), **own}


class _SendRecv(PyLayer):
    @staticmethod
    def forward(ctx, *ts):
        return tuple(t.clone() for t in ts)

    @staticmethod
    def backward(ctx, *gs):
        return tuple(gs)



def _then(done, fn):
    """``fn`` preceded by ``done()`` (a fan-out entry learning its backward ran), or ``fn`` itself."""
    if done is None:
        return fn

    def run(g):
        done()
        return fn(g)
    return run


def grad_all_reduce(xs, ranks, done=None):
    """Identity forward, all_reduce(sum) backward (Megatron's f): feeds a replicated tensor into an op
    that is split over ``ranks``, whose local gradients are partial sums."""
    return _run(xs, lambda v: {r: t.clone() for r, t in v.items()},
                _then(done, lambda g: _reduce_raw(g, ranks, "sum")))


def gather_for_split(xs, ranks, axis, sizes, done=None):
    """S(axis) -> R feeding ops split over ``ranks`` (Megatron's sequence-parallel g): all_gather forward,
    reduce_scatter(sum) backward, as the incoming local gradients are partial sums."""
    return _run(xs, lambda v: _gather_raw(v, ranks, axis, sizes),
                _then(done, lambda g: _reduce_scatter_raw(g, ranks, axis, sizes, "sum")))


def grad_keep_first(xs, ranks):
    """Identity forward; backward keeps the gradient on the group's first member and zeros it elsewhere:
    turns a complete (replicated) gradient into partial sums, for a tensor whose gradient is reduced later."""
    return _run(xs, lambda v: {r: t.clone() for r, t in v.items()},
                lambda g: {r: t if ranks.index(r) == 0 else paddle.zeros_like(t) for r, t in g.items()})


def mesh_groups_apply(xs, mesh, dim, fn):
    """Apply a group collective ``fn(held, ranks)`` to every group of mesh dim ``dim``."""
    out = dict(xs)
    for ranks in mesh.all_groups(dim):
        held = {r: xs[r] for r in ranks if r in xs}
        if held:
            out.update(fn(held, ranks))
    return out


def mesh_max(values, mesh, dims=None):
    """``values`` (a float32 array) all-reduced with max over each mesh dim of ``dims`` (default: all) in turn, in
    the mesh's own groups (a flat group of a sub-mesh's ranks need not exist): over every dim, the maximum over the
    whole mesh, on every one of its ranks (this rank's, a real rank of the mesh)."""
    rank = current_world().rank
    xs = {rank: paddle.to_tensor(values)}
    for d in range(mesh.ndim) if dims is None else dims:
        xs = mesh_groups_apply(xs, mesh, d, lambda v, ranks: _reduce_raw(v, ranks, "max"))
    return xs[rank]


class _Pick(PyLayer):
    @staticmethod
    def forward(ctx, n, *ts):
        ctx.n = n
        return paddle.assign(ts[0])

    @staticmethod
    def backward(ctx, g):
        return tuple(g for _ in range(ctx.n))


def pick_replicated(xs: dict):
    """The simulated world's one tensor for a value replicated over the held ranks ``xs`` ({rank: copy}): the
    lowest rank's copy, whose gradient reaches every copy (each rank's local gradient of a replicated tensor is
    the whole gradient, as each real rank's own copy receives it); reading only the lowest rank's copy would
    leave the other ranks' shards upstream without a gradient."""
    ranks = sorted(xs)
    ts = [xs[r] for r in ranks]
    if len(ts) == 1 or not paddle.is_grad_enabled() or all(t.stop_gradient for t in ts):
        return ts[0]
    with local_mode():
        return _Pick.apply(len(ts), *ts)

"""Gradients through ``ap.reshard`` between meshes of different ranks (the dygraph pipeline form of paddle's
documentation: layers on their own meshes, activations moved by ``ap.reshard``).

Every rank runs the same program, so every rank makes every cross-mesh reshard and calls ``loss.backward()``.
A transfer that can carry a gradient (a floating tensor, gradients enabled, some message between two ranks)
leaves a ``Transfer`` record on every rank, numbered in program order, and every distributed tensor computed
from the moved tensor names the records it depends on (``ancestry``: dispatch and ``reshard`` carry them, on
the ranks that hold no data too). A backward reads the records its tensors depend on, the same on every
rank, and walks them newest first:

* a rank that received the tensor sends the gradient of what it received (zeros if nothing reached it) back
  to the source rank given by ``grad_pairs``, once every backward pass that can reach it has run;
* a source rank receives that gradient and continues its own backward from the tensor it sent.

A rank's passes are merged: its loss and the sent tensors whose gradients have arrived run as one
``paddle.autograd.backward`` until the next record it has to send a gradient for. A tensor received but
never used in the loss is not in its ancestry: no gradient goes back and nobody waits (its gradient is zero).
"""
from __future__ import annotations

import itertools
import weakref

import paddle

from autoparallel.compat import SideData

_ANCESTRY = SideData()              # DistTensor -> frozenset of the Transfer records it depends on
_SOURCES = SideData()               # one-element DistTensor of a pipeline's logits -> its one-element inputs
_NEW: list = []                     # records made by the reshard running now (reshard takes them)
_SEQ = itertools.count()
LIVE = [False]                      # a record was ever made in this process: dispatch carries ancestry
_RECEIVED: "weakref.WeakSet" = weakref.WeakSet()       # records whose received tensor this rank holds
_FLOATS = ("float16", "bfloat16", "float32", "float64")


def grad_pairs(pairs, src_ids, dst_ids) -> tuple:
    """``(destination, source)`` for every source rank: whose gradient goes back to it. A destination
    holding a copy of a source's tensor sends it back (the first one, when a source fed several: every copy of a
    replicated tensor holds the whole gradient); a source that sent nothing (more source than destination
    ranks of a whole tensor) gets it from destination ``k % len(dst_ids)`` at its flat position k."""
    first: dict = {}
    for s, d in pairs:
        first.setdefault(s, d)
    return tuple((first.get(s, dst_ids[k % len(dst_ids)]), s) for k, s in enumerate(src_ids))


def unsupported(src_ids, dst_ids, pairs):
    """Why a transfer's gradient cannot come back on real ranks, or None."""
    shared = sorted(set(src_ids) & set(dst_ids))
    if shared and any(s != d for s, d in pairs):
        return (f"the gradient of an ap.reshard from ranks {list(src_ids)} to ranks {list(dst_ids)}: meshes that "
                f"share some ranks ({shared}) but not all do not send a gradient back across ranks in a launched "
                f"job (disjoint meshes and meshes over the same ranks do; ap.simulate runs it). Move it in two "
                f"steps through a mesh of the source ranks, or pass it detached")
    return None


class Transfer:
    """One cross-mesh move that can carry a gradient, on this rank: ``sent`` is this rank's local before the
    send (a source rank), ``buf`` the leaf it received (a destination rank that got a message)."""

    __slots__ = ("seq", "src_ids", "dst_ids", "back", "why", "sent", "buf", "done", "__weakref__")

    def __init__(self, src_ids, dst_ids, pairs):
        self.seq = next(_SEQ)
        self.src_ids, self.dst_ids = tuple(src_ids), tuple(dst_ids)
        self.back = tuple(p for p in grad_pairs(pairs, self.src_ids, self.dst_ids) if p[0] != p[1])
        self.why = unsupported(self.src_ids, self.dst_ids, pairs)
        self.sent = self.buf = None
        self.done = False

    def exchange(self, me: int):
        """Send this rank's gradients back, receive its own: the received gradient (or None)."""
        from autoparallel.comm.transport import transport_for
        from autoparallel.comm.world import current_world

        pairs = [p for p in self.back if me in p]
        xs, like = {}, {}
        if self.buf is not None:
            g = self.buf.grad
            if any(d == me for d, _ in pairs):
                xs[me] = (paddle.zeros_like(self.buf) if g is None else g.detach()).contiguous()
        if self.sent is not None and any(s == me for _, s in pairs):
            like[me] = (list(self.sent.shape), self.sent.dtype)
        if not pairs:
            return None
        with paddle.no_grad():
            got = transport_for(current_world()).send_recv(xs, pairs, like)
        return got.get(me) if me in like else None


def real_send(xs: dict, pairs, shapes, dtype, src_ids, dst_ids) -> dict:
    """A ``SEND_RECV`` step on real ranks: ``xs`` holds this rank's local if it is a source rank. The move as
    before (``comm.collectives.send_recv``), plus its record when a gradient can come back."""
    from autoparallel.comm import collectives as C
    from autoparallel.comm import groups
    from autoparallel.comm.world import current_world

    groups.ensure_pair_groups(list(pairs) + [(s, d) for d, s in grad_pairs(pairs, src_ids, dst_ids)])
    senders = {s: xs[s] for s, _ in pairs if s in xs}
    out = C.send_recv(senders, pairs, shapes, dtype)
    if not (paddle.is_grad_enabled() and dtype in _FLOATS and any(s != d for s, d in pairs)):
        return out
    rec = Transfer(src_ids, dst_ids, pairs)
    LIVE[0] = True
    _NEW.append(rec)
    me = current_world().rank
    if me in xs:
        rec.sent = xs[me]
    if any(d == me and s != me for s, d in pairs):
        rec.buf = out[me]
        rec.buf.stop_gradient = False
        out[me] = rec.buf.clone()          # not a leaf: in-place ops on it stay legal
        _RECEIVED.add(rec)
    return out


# ---- ancestry ----------------------------------------------------------------------------------------------
def ancestry(t) -> frozenset:
    return _ANCESTRY.get(t, frozenset())


def follow(src, run, *args):
    """``out = run(src, *args)`` (``ap.reshard``'s body): it depends on what ``src`` depends on and on the move
    it made, if any."""
    _NEW.clear()
    out = run(src, *args)
    new = frozenset(_NEW)
    _NEW.clear()
    got = ancestry(src) | new
    if got and out is not src:
        _ANCESTRY.set(out, got)
    return out


def carry(args, kwargs, out) -> None:
    """After a dispatched op: its distributed outputs depend on what its distributed inputs depend on."""
    got = frozenset()
    for v in list(args) + list(kwargs.values()):
        for u in (v if isinstance(v, (list, tuple)) else (v,)):
            a = _ANCESTRY.get(u)
            if a:
                got = got | a
    if not got:
        return
    keeps = any(getattr(r, "sync_values", None) is not None for r in got)
    for o in (out if isinstance(out, (list, tuple)) else (out,)):
        if o is not None and hasattr(o, "_locals"):
            _ANCESTRY.set(o, ancestry(o) | got)
            if keeps and o._spec.numel == 1:
                _SOURCES.set(o, tuple(u for v in list(args) + list(kwargs.values())
                                      for u in (v if isinstance(v, (list, tuple)) else (v,))
                                      if hasattr(u, "_locals") and u._spec.numel == 1))


def one_element_sources(roots) -> list:
    """The one-element distributed tensors the one-element ``roots`` were computed from by dispatched ops
    (``loss`` of ``(loss / accum).backward()``), roots first, in the same
    order on every rank (the roots' own computation, not what a rank computed beside it)."""
    out, seen, todo = [], set(), [t for t in roots if t._spec.numel == 1]
    while todo:
        t = todo.pop(0)
        if id(t) in seen:
            continue
        seen.add(id(t))
        out.append(t)
        todo.extend(_SOURCES.get(t, ()))
    return out


def synced_item(t):
    """``t.item()`` from the record ``t`` depends on that syncs values (a pipeline's logits, external_loss.py), or
    None (``DistTensor.item`` as before); a value kept on ``t`` (value_cache.py) first, read locally."""
    from autoparallel import value_cache

    kept = value_cache.get(t)
    if kept is not None:
        return kept
    rec = next((r for r in ancestry(t) if getattr(r, "synced_item", None) is not None), None)
    return None if rec is None else rec.synced_item(t)


def refuse_grad(outputs) -> None:
    """``paddle.grad`` does not cross meshes: refused on every rank when an output depends on a transfer."""
    if any(not r.done for o in outputs for r in ancestry(o)):
        raise NotImplementedError("paddle.grad through an ap.reshard between meshes of different ranks in a "
                                  "launched job is not supported (loss.backward() is; ap.simulate runs both)")


# ---- backward ----------------------------------------------------------------------------------------------
def backward(ts, gs, retain_graph: bool, roots, **kw) -> None:
    """``paddle.autograd.backward(ts, gs)`` of this rank's shards of ``roots`` (the distributed tensors a
    backward starts from), with every cross-mesh transfer they depend on: see the module docstring. A rank
    holding no part of the roots and no transfer they depend on has nothing to do."""
    from autoparallel.comm.world import current_world

    recs = sorted({r for t in roots for r in ancestry(t) if not r.done}, key=lambda r: r.seq)
    if not recs:
        if ts:
            _flush([list(ts), list(gs)], retain_graph, kw)
        _check_unreached(())
        return
    why = next((r.why for r in recs if r.why), None)
    if why is None and retain_graph:
        why = next((getattr(r, "retain_why", None) for r in recs if getattr(r, "retain_why", None)), None)
    if why is not None:                 # every rank holds every record: refused on all of them, before any message
        raise NotImplementedError(why)
    me, seeds = current_world().rank, [list(ts), list(gs)]
    _check_retained([r.sent for r in recs if r.sent is not None], retain_graph)
    check_passes(pass_seeds(recs, me, list(ts)))
    sync = next((r for r in recs if getattr(r, "sync_values", None) is not None), None)
    if sync is not None:                # the loss's value on every rank (pipeline/external_loss.py)
        sync.sync_values(roots)
    for rec in reversed(recs):
        if getattr(rec, "resume", None) is not None:       # a pipeline's backward (pipeline/external_loss.py)
            _flush(seeds, retain_graph, {})                # the loss graph down to the logits, first
            rec.resume()
            continue
        if rec.buf is not None and any(d == me for d, _ in rec.back):
            _flush(seeds, True, {})     # everything that can reach the received tensor, before its gradient goes
        g = rec.exchange(me)
        if g is not None and not rec.sent.stop_gradient:
            seeds[0].append(rec.sent)
            seeds[1].append(g)
    _flush(seeds, retain_graph, kw)
    for r in recs:
        r.done = r.done or not retain_graph
        if r.buf is not None:           # sent, or a copy no source reads back (one of several): dropped
            r.buf.clear_gradient(False)
    _check_unreached(recs)


def pass_seeds(recs, me: int, ts) -> list:
    """The tensors each of this rank's backward passes starts from, in order (``backward`` runs one pass
    before each gradient it sends, and a last one): its shards of the loss first, then what it sent."""
    passes, cur = [], list(ts)
    for rec in reversed(recs):
        if rec.buf is not None and any(d == me for d, _ in rec.back):
            passes.append(cur)
            cur = []
        if rec.sent is not None and any(s == me for _, s in rec.back) and not rec.sent.stop_gradient:
            cur.append(rec.sent)
    return [p for p in passes + [cur] if p]


def check_passes(passes) -> None:
    """Two passes reaching the same collective (a paddle PyLayer) would run its backward twice, which crashes
    paddle 3.3: refused on this rank before any message (the loop-back form whose sent tensor also feeds a loss
    term through a collective)."""
    if len(passes) < 2:
        return
    from autoparallel.retained_graph import _pylayer_nodes

    seen: set = set()
    for p in passes:
        nodes = _pylayer_nodes(p)
        if seen & nodes:
            raise NotImplementedError(
                "this rank's backward would run a collective's backward twice: a tensor it sent by ap.reshard to "
                "another mesh also reaches the loss on this rank through a collective, and its gradient comes back "
                "only after this rank has sent the gradient of a tensor it received later (paddle 3.3 crashes "
                "re-running a collective's backward). Give the loss term on the sent tensor its own forward, or "
                "pass the sent tensor detached to that term")
        seen |= nodes


def _check_retained(sent, retain_graph) -> None:
    """The retained-graph check (retained_graph.py) over what this rank sent, before any message: a second
    backward through a kept graph is refused here rather than crash the process in paddle."""
    from autoparallel.retained_graph import check_backward

    if sent:
        check_backward(list({id(t): t for t in sent}.values()), retain_graph)


def _flush(seeds, retain_graph, kw) -> None:
    ts, gs = seeds
    merged: dict = {}                   # a tensor sent twice is one seed with the sum of its gradients
    for t, g in zip(ts, gs):
        merged[id(t)] = (t, g if id(t) not in merged else merged[id(t)][1] + g)
    if merged:       # not under local_mode: a recompute replay in this backward runs the forward on DistTensors
        paddle.autograd.backward([t for t, _ in merged.values()], [g for _, g in merged.values()],
                                 retain_graph=retain_graph, **kw)
    ts.clear()
    gs.clear()


def _check_unreached(recs) -> None:
    """A received tensor reached by this backward although the roots do not name its transfer (it got there
    through a path that does not carry the records, such as a user's own local computation): its gradient
    would never go back, so this is an error, not a silent miss."""
    named = set(recs)
    for rec in list(_RECEIVED):
        if rec not in named and rec.buf is not None and rec.buf.grad is not None:
            rec.buf.clear_gradient(False)
            raise RuntimeError(
                f"a gradient reached the tensor this rank received by ap.reshard from ranks {list(rec.src_ids)} "
                f"(move {rec.seq}{', already backwarded' if rec.done else ''}), "
                f"but the tensor backward started from does not record that move (it was computed from the "
                f"received tensor's local shard outside autoparallel's ops, or the move was already backwarded "
                f"without retain_graph=True): the gradient cannot go back to ranks {list(rec.src_ids)}")


# ---- the simulated world: the same gradients as real ranks, in one autograd graph ----------------------------
def sim_send(xs: dict, pairs, shapes, dtype, src_ids, dst_ids) -> dict:
    """Every destination of ``pairs`` receives its source's tensor; the gradient that goes back to each source
    is the one ``grad_pairs`` names (before: every copy's gradient was summed, so a whole tensor sent to two
    ranks got twice its gradient, and a source that sent nothing got none)."""
    from paddle.autograd import PyLayer

    from autoparallel.comm import collectives as C

    order = [s for s in src_ids if s in xs]
    if not paddle.is_grad_enabled() or all(xs[s].stop_gradient for s in order):
        return C.send_recv({s: xs[s] for s, _ in pairs}, pairs, shapes, dtype)
    back = dict((s, d) for d, s in grad_pairs(pairs, src_ids, dst_ids))
    dests = [d for _, d in pairs]
    pick = [dests.index(back[s]) if back[s] in dests else None for s in order]

    class _Send(PyLayer):
        @staticmethod
        def forward(ctx, *ts):
            ctx.shapes = [(t.shape, t.dtype) for t in ts]
            return tuple(ts[order.index(s)].clone() for s, _ in pairs)

        @staticmethod
        def backward(ctx, *g):
            return tuple(paddle.zeros(shape, dtype) if k is None or g[k] is None else g[k]
                         for k, (shape, dtype) in zip(pick, ctx.shapes))

    outs = _Send.apply(*[xs[s] for s in order])
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return dict(zip(dests, outs))

"""paddle's functional autograd over distributed tensors: ``paddle.grad`` (``paddle.autograd.grad``) and
``paddle.autograd.backward``.

A DistTensor's autograd graph is the graphs of its local shards, so ``paddle.grad`` runs once over every held
shard of every output and input; each input's gradient comes back as a DistTensor in the gradient layout of
``DistTensor.grad`` (its placements with Partial read as Replicate: a rank's local gradient is the slice of the
true gradient for Shard and the whole gradient otherwise). ``grad_outputs`` given as DistTensors are resharded
to their output's gradient layout, plain tensors (global values) laid out there.
"""
from __future__ import annotations

import paddle

from autoparallel import cross_mesh_grad
from autoparallel.comm import fanout
from autoparallel.dist_tensor import (DistParameter, DistTensor, _grad_placements, as_dist, is_dist, reshard,
                                      shard_tensor)
from autoparallel.dist_tensor_forms import backward_seeds
from autoparallel.local_mode import local_mode
from autoparallel.placement import Partial


def _seq(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _seed(out, g):
    """The local seeds of one output, in rank order (None without a gradient)."""
    ranks = sorted(out._locals)
    if g is None:
        return [None] * len(ranks)
    if not (is_dist(g) or isinstance(g, paddle.Tensor)):
        raise TypeError(f"paddle.grad: grad_outputs entries are tensors or None, got {type(g).__name__}")
    if not is_dist(g) and list(g.shape) != out.shape:
        raise ValueError(f"paddle.grad: a plain grad_outputs entry is the global gradient of its output, "
                         f"shape {out.shape}; got shape {list(g.shape)}")
    return backward_seeds(out, as_dist(g) if is_dist(g) else g, ranks, reshard, shard_tensor)


def _flatten(items) -> tuple:
    """(flat local tensors, per item: None for a plain tensor, else the DistTensor view and its ranks)."""
    flat, where = [], []
    for t in items:
        if is_dist(t):
            d = as_dist(t)
            ranks = sorted(d._locals)
            where.append((d, ranks, _partial_dims(t)))
            flat.extend(d._locals[r] for r in ranks)
        else:
            where.append(None)
            flat.append(t)
    return flat, where


def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False, only_inputs=True,
         allow_unused=False, no_grad_vars=None, **kwargs):
    outs, ins = _seq(outputs), _seq(inputs)
    cross_mesh_grad.refuse_grad(outs)
    gos = [None] * len(outs) if grad_outputs is None else _seq(grad_outputs)
    if len(gos) != len(outs):
        raise ValueError(f"paddle.grad: grad_outputs needs one entry per output ({len(outs)}), got {len(gos)}")
    flat_out, flat_seed = [], []
    for o, g in zip(outs, gos):
        if is_dist(o):
            d = as_dist(o)
            flat_out.extend(d._locals[r] for r in sorted(d._locals))
            flat_seed.extend(_seed(d, g))
        else:
            if is_dist(g):
                raise TypeError("paddle.grad: a distributed grad_outputs entry for a plain output")
            flat_out.append(o)
            flat_seed.append(g)
    flat_in, where = _flatten(ins)
    skip = None if no_grad_vars is None else _flatten(_seq(no_grad_vars) if not isinstance(no_grad_vars, set)
                                                      else list(no_grad_vars))[0]
    seeds = None if all(s is None for s in flat_seed) else flat_seed
    end_hold = _hold_zero3() if create_graph else None
    try:
        with local_mode():
            res = paddle.grad(flat_out, flat_in, seeds, retain_graph=retain_graph, create_graph=create_graph,
                              only_inputs=only_inputs, allow_unused=allow_unused, no_grad_vars=skip, **kwargs)
    except ValueError as e:
        if end_hold is not None:
            end_hold()
        if "PyLayer__Comm" not in str(e):
            raise
        raise NotImplementedError(
            "paddle.grad over distributed tensors: a collective on the way from the outputs reads a tensor that "
            "needs a gradient but is not among `inputs` (paddle.grad cannot prune a custom autograd node's "
            "inputs); ask for the gradients of every tensor that needs one on that path (e.g. all parameters), "
            "or use loss.backward() and read .grad") from None
    except BaseException:
        if end_hold is not None:
            end_hold()
        raise
    out = _regroup(list(res), where)
    if end_hold is not None:
        _end_with(out, end_hold)
    return out


def _hold_zero3():
    from autoparallel.parallel.zero_params import hold

    return hold()


def _end_with(grads: list, end) -> None:
    """``end`` runs once every returned gradient (and so the graph built for it) is gone."""
    import weakref

    live = [g for g in grads if g is not None]
    if not live:
        end()
        return
    left = [len(live)]

    def one():
        left[0] -= 1
        if left[0] == 0:
            end()
    for g in live:
        weakref.finalize(g, one)


def _regroup(res: list, where: list) -> list:
    out, i = [], 0
    for w in where:
        if w is None:
            out.append(res[i])
            i += 1
            continue
        d, ranks, partial = w
        gs = res[i:i + len(ranks)]
        i += len(ranks)
        if any(g is None for g in gs):
            out.append(None)
            continue
        places = [Partial("sum") if k in partial else p for k, p in enumerate(_grad_placements(d.placements))]
        out.append(DistTensor(dict(zip(ranks, gs)), d.spec.with_placements(tuple(places))))
    return out


def _partial_dims(t) -> frozenset:
    """The mesh dims on which a parameter's local gradient is a partial sum: the forward used it in ops split
    there (data parallel), and its gradient is reduced there only by the optimizer's buckets. A
    gradient that ``paddle.grad`` returns is read before any such reduction, so it carries Partial there (its
    true value is the sum over the dim; ``g.full()`` or any op needing it whole reduces it). So is the gradient of
    an input gathered for column-parallel layers (``fanout.replicate_for_split``) on the dim it was gathered on."""
    if isinstance(t, DistParameter):
        return frozenset(getattr(t, "_ap_partial_dims", ()) or ())
    return fanout.partial_dims(t)


def backward(tensors, grad_tensors=None, retain_graph=False, dump_backward_graph_path=None):
    """paddle.autograd.backward over distributed tensors: each one's shards with its seeds (ones, or the given
    gradient laid out in its gradient layout, as ``DistTensor.backward``), in one backward pass."""
    ts = _seq(tensors)
    gs = [None] * len(ts) if grad_tensors is None else _seq(grad_tensors)
    if len(gs) != len(ts):
        raise ValueError(f"paddle.autograd.backward: grad_tensors needs one entry per tensor ({len(ts)}), "
                         f"got {len(gs)}")
    flat_t, flat_g, roots = [], [], []
    for t, g in zip(ts, gs):
        if not is_dist(t):
            flat_t.append(t)
            flat_g.append(g)
            continue
        d = as_dist(t)
        roots.append(d)
        ranks = sorted(d._locals)
        flat_t.extend(d._locals[r] for r in ranks)
        if g is None:
            flat_g.extend(paddle.ones_like(d._locals[r]) for r in ranks)
        else:
            flat_g.extend(backward_seeds(d, g, ranks, reshard, shard_tensor))
    kw = {} if dump_backward_graph_path is None else {"dump_backward_graph_path": dump_backward_graph_path}
    from autoparallel import backward_start

    backward_start.backward(flat_t, flat_g, retain_graph, roots, **kw)

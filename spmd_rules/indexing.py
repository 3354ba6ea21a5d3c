"""getitem (``x[index]``), tril, triu.

getitem handles ints, slices, None, Ellipsis and ONE advanced index (a list of ints or an integer
DistSpec, whose dims replace the indexed dim in place, numpy-style). A dim keeps its sharding only
when the index takes all of it (a full slice ``:``, ``0:n``, ...); an int, a partial slice or an
advanced index on a sharded dim needs it R. The local index equals the global one (full slices take
the whole local shard). Linear in x (a Partial passes). A slice of a block-sharded dim (``S(d,blocks=..)``)
that takes a run of whole blocks stays local (each rank slices its rows of those blocks).

tril/triu keep any sharding: with rows or columns sharded, the local ``diagonal`` shifts by this rank's
row offset minus its column offset (``local_attrs``).
"""
from __future__ import annotations

import numbers

import numpy as np

from autoparallel.core.placement import Partial, Replicate, Shard
from autoparallel.core.spec import DistSpec

from spmd_rules.blocks import aligned_pieces, block_aware, local_bounds, piece_placement, unblock
from spmd_rules.einsum import ALL, labels_result
from spmd_rules.registry import register_spmd_rule
from spmd_rules.result import SpmdResult
from spmd_rules.utils import check_spec


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _advanced(v) -> bool:
    return isinstance(v, (DistSpec, list, np.ndarray))


def _mask(it) -> bool:
    """A boolean index: a bool tensor, a python list or numpy array of bools (its output size depends on it)."""
    if isinstance(it, DistSpec):
        return it.dtype == "bool"
    return isinstance(it, (list, np.ndarray)) and len(it) > 0 and np.asarray(it).dtype == np.bool_


def index_plan(x: DistSpec, index):
    """(x labels, output labels, output shape, index spec or None, index labels)."""
    op = "getitem"
    items = list(index) if isinstance(index, tuple) else [index]
    for it in items:
        if isinstance(it, (bool, np.bool_)):
            raise NotImplementedError(f"{op}: boolean scalar indices are not supported")
        if not (it is None or it is Ellipsis or _is_int(it) or isinstance(it, slice) or _advanced(it)):
            raise TypeError(f"{op}: unsupported index item {type(it).__name__} {it!r}: expected int, slice, "
                            f"None, Ellipsis, a list of ints or an integer DistSpec")
    if sum(it is Ellipsis for it in items) > 1:
        raise IndexError(f"{op}: an index can only have a single ellipsis")
    if sum(_advanced(it) for it in items) > 1:
        raise NotImplementedError(f"{op}: more than one advanced (list/tensor) index is not supported")
    consumed = sum(1 for it in items if it is not None and it is not Ellipsis)
    if consumed > x.ndim:
        raise IndexError(f"{op}: too many indices ({consumed}) for a tensor of rank {x.ndim}")
    if Ellipsis in [it for it in items if it is Ellipsis]:
        k = [i for i, it in enumerate(items) if it is Ellipsis][0]
        items = items[:k] + [slice(None)] * (x.ndim - consumed) + items[k + 1:]
    else:
        items = items + [slice(None)] * (x.ndim - consumed)
    xl, ol, shape = [], [], []
    idx_spec, idx_labels = None, ()
    d = 0
    for it in items:
        if it is None:
            ol.append(None)
            shape.append(1)
            continue
        n = x.shape[d]
        if _is_int(it):
            if not -n <= it < n:
                raise IndexError(f"{op}: index {it} is out of range for dim {d} of size {n} (shape {list(x.shape)})")
            xl.append(None)
        elif isinstance(it, slice):
            for b in (it.start, it.stop, it.step):
                if b is not None and not _is_int(b):
                    raise TypeError(f"{op}: slice bounds must be ints or None, got {it!r}")
            if it.step == 0:
                raise ValueError(f"{op}: slice step cannot be zero")
            start, stop, step = it.indices(n)
            length = len(range(start, stop, step))
            full = step == 1 and start == 0 and length == n
            xl.append(d if full else None)
            ol.append(d if full else None)
            shape.append(length)
        elif isinstance(it, DistSpec):
            if it.dtype not in ("int64", "int32"):
                raise NotImplementedError(f"{op}: only integer tensor indices are supported (a {it.dtype} mask "
                                          f"gives a data-dependent shape)")
            idx_spec = it
            idx_labels = tuple(f"i{j}" for j in range(it.ndim))
            xl.append(None)
            ol.extend(idx_labels)
            shape.extend(it.shape)
        else:
            arr = np.asarray(it)
            if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
                raise NotImplementedError(f"{op}: only integer list indices are supported, got {it!r}")
            if arr.size and (arr.min() < -n or arr.max() >= n):
                raise IndexError(f"{op}: list index out of range for dim {d} of size {n}")
            xl.append(None)
            ol.extend([None] * arr.ndim)
            shape.extend(arr.shape)
        d += 1
    return tuple(xl), tuple(ol), tuple(shape), idx_spec, idx_labels


@register_spmd_rule("getitem")
@block_aware
def getitem(x, index):
    check_spec("getitem", "x", x)
    if _is_int(index) and x.ndim and _row_shards(x):
        return _row_of_shard(x, index)
    items = list(index) if isinstance(index, tuple) else [index]
    if sum(_advanced(it) for it in items) > 1 or any(_mask(it) for it in items):
        from spmd_rules.routing import replicate_all     # several advanced indices, or a mask: gathered

        return replicate_all("getitem", [x] + [it for it in items if isinstance(it, DistSpec)])
    blocked = _block_getitem(x, index)
    if blocked is not None:
        return blocked
    x = unblock(x)                       # any other index on a block-sharded dim: gathered first
    xl, ol, shape, idx, il = index_plan(x, index)
    specs, labs = [x], [xl]
    if idx is not None:
        specs.append(idx)
        labs.append(il)
    return labels_result("getitem", specs, labs, [ol], [(shape, x.dtype)], linear={0})


def _basic_items(x, index):
    """The index as one item per x dim (Ellipsis expanded) with the output position of each, or None when
    it holds anything but slices, ints and None."""
    items = list(index) if isinstance(index, tuple) else [index]
    if not all(it is None or it is Ellipsis or _is_int(it) or isinstance(it, slice) for it in items):
        return None
    consumed = sum(1 for it in items if it is not None and it is not Ellipsis)
    if consumed > x.ndim or sum(it is Ellipsis for it in items) > 1:
        return None
    if any(it is Ellipsis for it in items):
        k = items.index(Ellipsis)
        items = items[:k] + [slice(None)] * (x.ndim - consumed) + items[k + 1:]
    else:
        items = items + [slice(None)] * (x.ndim - consumed)
    return items


def _block_getitem(x, index):
    """``x[..., a:b]`` on a block-sharded dim where [a, b) is a run of whole blocks: each member takes its
    rows of those blocks (no communication); one block comes out ``S(d)``, several ``S(d,blocks=..)``."""
    dims = [d for d in range(x.ndim) if x.block_mesh_dim(d) is not None]
    items = _basic_items(x, index) if dims else None
    if items is None:
        return None
    d = dims[0]
    i = x.block_mesh_dim(d)
    p, n = x.placements[i], x.mesh.shape[i]
    pos, out_pos, item_at = 0, 0, None
    for j, it in enumerate(items):
        if it is None:
            out_pos += 1
            continue
        if pos == d:
            item_at = j
            break
        out_pos += 0 if _is_int(it) else 1
        pos += 1
    it = items[item_at]
    if not isinstance(it, slice):
        return None
    start, stop, step = it.indices(x.shape[d])
    pieces = aligned_pieces(p.blocks, [(start, stop)]) if step == 1 else None
    if pieces is None:
        return None
    first = [sum(p.blocks[:k]) for k in range(len(p.blocks))].index(start)
    lo, hi = local_bounds(p.blocks, n, range(first, first + len(pieces[0])))
    base = getitem(unblock(x), index)
    req = base.inputs[0]
    req = req.with_placements(req.placements[:i] + (p,) + req.placements[i + 1:])
    o = base.outputs[0]
    o = o.with_placements(o.placements[:i] + (piece_placement(out_pos, pieces[0]),) + o.placements[i + 1:])
    local = tuple(items[:item_at]) + (slice(lo, hi),) + tuple(items[item_at + 1:])
    return SpmdResult((req,), (o,), None, lambda coords: {"index": local})


@register_spmd_rule("setitem")
def setitem(x, index, value):
    """``x[index] = value`` as an out-of-place op (the runtime rebinds ``x`` to the result).

    Basic indices (ints, slices, None, Ellipsis): a dim the index takes whole keeps its sharding (the global
    index is then also the local one), any other dim must be R; a tensor value shares the sharding of the
    region it fills (a broadcast dim stays whole). Tensor indices: x, the indices and the value gathered to
    R, the result replicated. An in-place write into a parameter is resharded back to its own layout."""
    check_spec("setitem", "x", x)
    items = list(index) if isinstance(index, tuple) else [index]
    if any(_advanced(it) for it in items):
        specs = [x] + [it for it in items if isinstance(it, DistSpec)] + ([value] if isinstance(value, DistSpec) else [])
        rep = [s.with_placements(tuple(Replicate() for _ in s.placements)) for s in specs]
        return SpmdResult(rep, (rep[0],), "setitem")
    xl, ol, shape, _, _ = index_plan(x, index)
    specs, labs = [x], [xl]
    if isinstance(value, DistSpec):
        if len(value.shape) > len(shape):
            raise ValueError(f"setitem: a value of shape {list(value.shape)} cannot fill a region of shape "
                             f"{list(shape)}")
        off = len(shape) - len(value.shape)
        specs.append(value)
        labs.append(tuple(ol[off + j] if value.shape[j] == shape[off + j] else None
                          for j in range(len(value.shape))))
    return labels_result("setitem", specs, labs, [xl], [(x.shape, x.dtype)], linear=None, local_op="setitem")


def _row_shards(x) -> list:
    """Mesh dims splitting dim 0 of ``x`` (none when some placement is Partial)."""
    if x.dtype == "bool" or any(isinstance(p, Partial) for p in x.placements):
        return []                   # a bool row cannot be a sum of terms
    return [m for m, p in enumerate(x.placements) if isinstance(p, Shard) and p.dim == 0]


def _row_of_shard(x, i):
    """``x[i]`` with dim 0 sharded: the rank holding row i returns it, the others zeros, so the result is a
    Partial(sum) on the mesh dims splitting dim 0 -- no communication (iterating a batch-sharded tensor,
    reading one routing count)."""
    n = x.shape[0]
    if not -n <= i < n:
        raise IndexError(f"getitem: index {i} is out of range for dim 0 of size {n} (shape {list(x.shape)})")
    i %= n
    placements = tuple(Partial("sum") if isinstance(p, Shard) and p.dim == 0 else
                       Shard(p.dim - 1) if isinstance(p, Shard) else p for p in x.placements)
    out = DistSpec(x.mesh, placements, tuple(x.shape[1:]), x.dtype)

    def attrs(coords):
        start, stop = x.local_range(coords, 0)
        return {"row": i - start if start <= i < stop else None}

    return SpmdResult((x,), (out,), "row_of_shard", attrs)


def _tri(op):
    def rule(x, diagonal=0, name=None):
        check_spec(op, "x", x)
        if x.ndim < 2:
            raise ValueError(f"{op}: x must have rank >= 2, got shape {list(x.shape)}")
        labels = tuple(range(x.ndim))
        res = labels_result(op, [x], [labels], [labels], [(x.shape, x.dtype)], linear=ALL)
        req = res.inputs[0]
        r, c = x.ndim - 2, x.ndim - 1
        if not any(isinstance(p, Shard) and p.dim in (r, c) for p in req.placements):
            return res

        def attrs(coords):
            return {"diagonal": diagonal + req.local_range(coords, r)[0] - req.local_range(coords, c)[0]}

        return SpmdResult(res.inputs, res.outputs, None, attrs)

    rule.__name__ = op
    register_spmd_rule(op, rule)


_tri("tril")
_tri("triu")

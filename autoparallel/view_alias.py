"""Paddle's view ops (basic slicing, reshape, transpose, flatten, squeeze, ...) share storage with their input,
so an in-place op on a view changes the tensor it came from, and the other way round. A DistTensor's local
shards never alias. So a write through a view is carried back into its bases where the view op can be
inverted (basic indexing: ``base[index] = view``; the reshape family: a reshape; transpose: the inverse
permutation), and every other live tensor sharing the storage (a sibling view, a view of a tensor written in
place) is marked stale: the first routed op, ``full()`` or ``reshard`` reading it raises ``NotImplementedError``
naming the write, never a stale value. docs/fuzzing_ops.md has the measured view/copy table.

Only views of DistTensors and distributed parameters are tracked; a view keeps its base alive (as shared storage
does) until it dies."""
from __future__ import annotations

import weakref

# ops whose paddle result is a view of their first input (checked on paddle 3.3: expand, split, chunk and
# tensor_split copy; advanced indexing copies)
VIEW_OPS = frozenset({"reshape", "view", "view_as", "transpose", "matrix_transpose", "flatten", "squeeze",
                      "unsqueeze", "getitem", "slice", "strided_slice", "narrow", "diagonal", "unbind",
                      "unflatten", "moveaxis", "as_strided"})
# paddle's reshape of a non-contiguous tensor copies: a reshape of a (maybe) strided view is not linked
RESHAPES = frozenset({"reshape", "view", "view_as", "flatten", "unflatten"})
STRIDING = frozenset({"transpose", "matrix_transpose", "diagonal", "moveaxis", "getitem", "slice", "strided_slice",
                      "narrow", "unbind", "as_strided"})

# keyed by id (a DistTensor's == is elementwise, so weak dicts/sets cannot hold it); entries die with the tensor.
# record() only notes each view's base (one dict entry per view op, on the dispatch path); who shares storage
# with whom (one root and every view below it) is worked out when an in-place op writes, which is rare.
_REFS: dict = {}          # id -> weakref of a view, or of a root marked stale
_STALE: dict = {}         # id -> the in-place call that wrote its storage through another tensor
_STRIDED: set = set()     # ids of views that may be non-contiguous in paddle
_PARENT: dict = {}        # id of a view -> (its base, op, index / base shape / perm, or None: not invertible);
                          # a view keeps its base alive, as paddle's shared storage does
_VIEWS: dict = {}         # id of a base -> how many live views _PARENT names it in (an in-place op elsewhere
                          # returns at once)
_BUSY = [False]
WRITE_BACK = frozenset({"getitem", "transpose", "reshape", "view", "flatten", "unflatten", "squeeze", "unsqueeze"})


def _track(t) -> int:
    k = id(t)
    if k not in _REFS:
        _REFS[k] = weakref.ref(t, lambda _r, k=k: _forget(k))
    return k


def _forget(k) -> None:
    _REFS.pop(k, None)
    _STALE.pop(k, None)
    _STRIDED.discard(k)
    p = _PARENT.pop(k, None)
    if p is not None:
        b = id(p[0])
        _VIEWS[b] -= 1
        if not _VIEWS[b]:
            del _VIEWS[b]


def _is_basic_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) and not isinstance(i, bool) for i in items)


def _leading_slice(index) -> bool:
    """A basic index touching only dim 0 with step 1 (``t[2]``, ``t[1:3]``): a contiguous view."""
    return isinstance(index, int) or isinstance(index, slice) and index.step in (None, 1)


def record(op: str, args, outs, DistTensor) -> None:     # noqa: N803 - the class, passed by dispatch
    """After a routed call: note the DistTensor outputs of a view op as views of its DistTensor input."""
    if op not in VIEW_OPS or not args:
        return
    base = args[0]
    if not (type(base) is DistTensor or hasattr(base, "_ap_spec")) or \
            (op == "getitem" and not _is_basic_index(args[1] if len(args) > 1 else 0)):
        return                          # a DistTensor's or a distributed parameter's (``_ap_spec``) views only
    if op in RESHAPES and (id(base) in _STRIDED or not base.shape):     # paddle copies a 0-d tensor's reshape
        return
    strided = id(base) in _STRIDED or op in STRIDING and not (op == "getitem" and _leading_slice(args[1]))
    shape = base._ap_spec.shape if hasattr(base, "_ap_spec") else base.shape     # a parameter's .shape is its shard's
    info = args[1] if op in ("getitem", "transpose") and len(args) > 1 else list(shape)
    if op == "getitem" and info is None:
        info = (None,)                      # x[None]: the index, not "cannot be inverted"
    if op not in WRITE_BACK or (op == "transpose" and not isinstance(info, (list, tuple))):
        info = None
    for o in outs if isinstance(outs, (list, tuple)) else (outs,):
        if type(o) is DistTensor and o is not base:
            v = _track(o)
            if strided:
                _STRIDED.add(v)
            if v not in _PARENT:
                _VIEWS[id(base)] = _VIEWS.get(id(base), 0) + 1
            _PARENT[v] = (base, op, info)


def _root(t):
    p = _PARENT.get(id(t))
    while p is not None:
        t = p[0]
        p = _PARENT.get(id(t))
    return t


def _family(t) -> dict:
    """id -> tensor of every live tensor sharing ``t``'s storage: its root and the root's views."""
    root = _root(t)
    out = {id(root): root}
    for k in list(_PARENT):
        ref = _REFS.get(k)
        o = ref() if ref is not None else None
        if o is not None and _root(o) is root:
            out[k] = o
    return out


def written(path: str, target) -> None:
    """After an in-place op on ``target``: the write goes back into the bases it is a view of where the view
    op can be inverted (basic indexing: a setitem; reshape family: a reshape; transpose: the inverse
    permutation), as paddle's shared storage would carry it; every other live tensor sharing the storage is
    now stale."""
    if _BUSY[0] or (id(target) not in _PARENT and id(target) not in _VIEWS):
        return
    family = _family(target)
    if len(family) < 2 or family.get(id(target)) is not target:
        return
    done, cur = {id(target)}, target
    _BUSY[0] = True
    try:
        while True:
            p = _PARENT.get(id(cur))
            base = p[0] if p and p[2] is not None else None
            if base is None or id(base) in _STALE or (base.is_leaf and not base.stop_gradient and _grad_on()):
                break
            _write_back(p[1], p[2], base, cur)
            done.add(id(base))
            cur = base
    finally:
        _BUSY[0] = False
    for j, t in family.items():
        if j in done:
            _STALE.pop(j, None)
        else:
            _STALE[_track(t)] = path


def _grad_on() -> bool:
    """Outside ``paddle.no_grad()`` a leaf that requires a gradient is not written in place (paddle refuses)."""
    import paddle

    return paddle.is_grad_enabled()


def _write_back(op, info, base, view) -> None:
    if op == "getitem":
        base[info] = view                   # routed setitem (its own rebind is ignored while _BUSY)
        return
    if op == "transpose":
        new = view.transpose(sorted(range(len(info)), key=lambda i: info[i]))
    else:
        new = view.reshape(info)
    if hasattr(base, "_ap_spec"):           # a distributed parameter stays the same Parameter: written in its layout
        base[...] = new
        return
    base._locals, base._spec = new._locals, new._spec


def any_stale() -> bool:
    return bool(_STALE)


def check_reads(op: str, leaves) -> None:
    """Before a routed call: refuse reading a tensor whose storage was written through another tensor."""
    if not _STALE:
        return
    for v in leaves:
        path = _STALE.get(id(v))
        if path is not None and _REFS[id(v)]() is v:
            raise NotImplementedError(
                f"{op}: this distributed tensor {list(v.shape)} shares storage (in paddle) with a view or base "
                f"that {path} changed in place; distributed tensors never share storage with their views, so its "
                f"value here would be stale. Write the update into the tensor itself (x[index] = value, or the "
                f"in-place op on x) or use the out-of-place result")

"""The dispatch cache: what one call signature of a routed op needs, planned once.

A call's key holds everything its plan depends on: the rule (re-registering an op gives a new one), the
dotted path called, the world (kind, rank, size, backend), the epoch of the cluster reshards are priced on, and the
arguments with every tensor replaced by its layout -- a DistTensor by its DistSpec (mesh, placements,
global shape, dtype), a DistParameter by ``("param", spec)``, a plain tensor by ``("plain", shape,
dtype)`` -- and every other argument by ``(type, value)``, lists and tuples entered, keyword order kept.
Equal keys give the same rule result, so the plan made for the first call serves every later one: the
rule's result, the reshard plan of each input, the mesh dims whose gradient needs an all_reduce, the held
ranks and each rank's local-call overrides. A call whose arguments have no hashable value (numpy arrays,
tensors inside slices or dicts) is planned afresh every time.

Per call only data-dependent work remains: executing reshards, gradient hooks (whether an input wants a
gradient is read from its ``stop_gradient`` on every call, so grad mode is never part of the key), building
each rank's arguments from the call's own values, the local op.
Overrides from a rule's ``local_attrs`` are computed once per rank and shared by later calls (rules are
pure; local implementations must not mutate their arguments).
"""
from __future__ import annotations


import paddle

from autoparallel import backward_start, redistribute
from autoparallel.comm import collectives as C
from autoparallel.comm import fanout
from autoparallel.dist_tensor import DistParameter, DistTensor
from autoparallel.param_detach import detached_param
from autoparallel.spec import DistSpec, normalize_dtype
from autoparallel.switch import turned_off
from reshard import cache as reshard_cache
from spmd_rules.registry import flatten_specs, replace_specs

_CACHE: dict = {}
_CACHE_LIMIT = 8192             # plans per table (_CACHE, _WRITTEN); a full table keeps its 3/4 most used (_shrink)
_ATOMS = frozenset({int, float, bool, str, bytes, complex, type(None), type(Ellipsis)})
_DIST, _PARAM, _PLAIN = 0, 1, 2
_enabled = [True]


class _Uncacheable(Exception):
    """An argument without a stable key."""


# ---- keys ------------------------------------------------------------------------------------------------
def call_key(args, kwargs, leaves: list):
    """The argument part of a call's key, appending the tensor leaves to ``leaves`` in the order
    ``flatten_specs`` visits them; None when some argument has no key (``leaves`` is then incomplete)."""
    try:
        a = tuple([_arg_key(v, leaves) for v in args])
        return a, tuple([(k, _arg_key(v, leaves)) for k, v in kwargs.items()]) if kwargs else ()
    except (_Uncacheable, TypeError, ValueError):     # ValueError: a dtype without a spec (the plan says why)
        return None


def _arg_key(v, leaves):
    t = v.__class__
    if t is DistTensor:
        leaves.append(v)
        return v._spec
    if t in _ATOMS:
        return t, v
    if t is list or t is tuple:
        return (t, *[_arg_key(x, leaves) for x in v])
    if isinstance(v, paddle.Tensor):
        leaves.append(v)
        if isinstance(v, DistParameter):
            spec = getattr(v, "_ap_spec", None)
            if spec is None:
                raise _Uncacheable          # held as a plain tensor, yet marked like a parameter
            return "param", spec
        return "plain", tuple(v.shape), normalize_dtype(v.dtype)
    if isinstance(v, (list, tuple)):
        return (t, *[_arg_key(x, leaves) for x in v])
    return _const_key(v)


def _const_key(v):
    """Key of a value where no tensor leaf is looked for (slices, dicts, other objects)."""
    t = v.__class__
    if t in _ATOMS:
        return t, v
    if isinstance(v, (paddle.Tensor, DistTensor, DistSpec)):
        raise _Uncacheable
    if isinstance(v, (list, tuple)):
        return (t, *[_const_key(x) for x in v])
    if t is slice:
        return slice, _const_key(v.start), _const_key(v.stop), _const_key(v.step)
    if isinstance(v, dict):
        return (t, *[(_const_key(k), _const_key(x)) for k, x in v.items()])
    hash(v)                     # TypeError: unhashable, no key
    return t, v


def full_key(rule, path: str, world, args_key, pinned=None):
    """The whole key, or None when the call cannot be cached."""
    if args_key is None or not _enabled[0]:
        return None
    key = (rule, path, world.__class__, world.rank, world.world_size, world.backend,
           reshard_cache.cluster_epoch(), args_key)
    return key if pinned is None else key + (id(pinned),)


def find(rule, path: str, world, args_key, pinned=None):
    """``(key, cached plan or None)``; the key is None when the call cannot be cached."""
    key = full_key(rule, path, world, args_key, pinned)
    if key is None:
        return None, None
    plan = _CACHE.get(key)
    if plan is None:
        return key, None
    plan.used = True
    if pinned is not None and plan.res is not pinned:
        return key, None
    return key, plan


# ---- calls as written ------------------------------------------------------------------------------------
# A call is bound (paddle's aliases, keyword -> position, argument maps) before its key is taken. The bound
# form is a function of the written call's key (binding reads types, ranks and values, all in the key), so
# the written key can map straight to the plan and a recipe rebuilding the bound arguments.
_WRITTEN: dict = {}


def written_key(rule, path: str, world, args_key):
    """The key of a call as written (None: not cacheable)."""
    key = full_key(rule, path, world, args_key)
    return None if key is None else ("written",) + key


def find_written(key):
    """``(plan, Rebind)`` stored for a written call's key, or None."""
    hit = _WRITTEN.get(key)
    if hit is not None:
        hit[1].used = True
    return hit


def store_written(written, plan, call, bound) -> None:
    """Remember how the written ``call`` (args, kwargs) became ``bound`` (args, kwargs, leaves) and its plan;
    a bound form holding something not traceable to the written call (a new tensor) is not remembered."""
    key, leaves = written
    rebind = Rebind.of(call[0], call[1], leaves, *bound)
    if rebind is None:
        return
    if len(_WRITTEN) >= _CACHE_LIMIT:
        _shrink(_WRITTEN, _rebind_of)
    _WRITTEN[key] = (plan, rebind)


_ARG, _KW, _CONST = 0, 1, 2


class Rebind:
    """How a written call becomes its bound form: each bound argument is a written positional argument, a
    written keyword argument, or a constant holding no tensor (a python scalar, or a value the binding
    computed from the key: ``shape`` from ``reshape(b, s, h)``); the bound call's tensor leaves are indices
    into the written call's. None (not remembered) where that is ambiguous (see ``_source``)."""

    __slots__ = ("args", "kwargs", "perm", "same", "used")

    @classmethod
    def of(cls, wargs, wkwargs, wleaves, bargs, bkwargs, bleaves):
        try:
            srcs = [_source(v, wargs, wkwargs) for v in bargs]
            kw = [(k, _source(v, wargs, wkwargs)) for k, v in bkwargs.items()]
            perm = [_only([i for i, w in enumerate(wleaves) if w is b]) for b in bleaves]
        except _Uncacheable:
            return None
        r = cls.__new__(cls)
        r.args, r.kwargs, r.perm, r.used = tuple(srcs), tuple(kw), perm, False
        r.same = (not kw and not wkwargs and len(srcs) == len(wargs)
                  and all(s == (_ARG, i) or _same_atom(s, w) for i, (s, w) in enumerate(zip(srcs, wargs)))
                  and perm == list(range(len(wleaves))))
        return r

    def apply(self, args, kwargs, leaves):
        """``(args, kwargs, leaves)`` of the bound call, from a written call with the recipe's key."""
        if self.same:
            return tuple(args), {}, leaves
        a = tuple([_take(s, args, kwargs) for s in self.args])
        k = {n: _take(s, args, kwargs) for n, s in self.kwargs}
        return a, k, [leaves[i] for i in self.perm]


def _source(v, wargs, wkwargs):
    """Where bound argument ``v`` comes from. A python scalar is a constant (its value is in the key); any other
    object is the written argument it is (the call's own object every time: a list the caller may change
    later is not kept), ambiguous when it fills several written slots (``x * x``: a later call with the same
    key may pass two tensors); an object the binding made is a constant when it holds no tensor."""
    if v.__class__ in _ATOMS:
        return _CONST, v
    found = [(_ARG, i) for i, w in enumerate(wargs) if w is v] + [(_KW, n) for n, w in wkwargs.items() if w is v]
    if found:
        return _only(found)
    if flatten_specs([v], None, is_leaf=_is_tensor_leaf):
        raise _Uncacheable              # a tensor the binding made (or a container it rebuilt around one)
    return _CONST, v


def _same_atom(src, w) -> bool:
    """A constant scalar where the written call has the same one (an equal key has it there every time)."""
    return src[0] == _CONST and w.__class__ in _ATOMS and w.__class__ is src[1].__class__ and w == src[1]


def _only(found):
    if len(found) != 1:
        raise _Uncacheable
    return found[0]


def _take(src, args, kwargs):
    kind, x = src
    return args[x] if kind == _ARG else kwargs[x] if kind == _KW else x


def store(key, plan) -> None:
    if key is None:
        return
    if len(_CACHE) >= _CACHE_LIMIT:
        _shrink(_CACHE, _itself)
    _CACHE[key] = plan


def _itself(v):
    return v


def _rebind_of(v):
    return v[1]


def _shrink(table: dict, holder) -> None:
    """Make room in a full table, second-chance style (an approximation of LRU whose hit path only sets a
    mark): keep the entries hit since the last shrink, newest first, then the newest others, up to 3/4 of
    the limit; clear the marks. Variable input shapes multiply the keys (the global shape is part of every
    spec), so a table that was emptied when full would plan every shape again after each fill."""
    items = list(table.items())
    keep = _CACHE_LIMIT * 3 // 4
    hit = [i for i, (_, v) in enumerate(items) if holder(v).used]
    chosen = hit[len(hit) - keep:] if len(hit) > keep else hit
    if len(chosen) < keep:
        others = [i for i, (_, v) in enumerate(items) if not holder(v).used]
        chosen = sorted(chosen + others[max(0, len(others) - (keep - len(chosen))):])
    table.clear()
    for i in chosen:
        k, v = items[i]
        holder(v).used = False
        table[k] = v


def clear() -> None:
    """Forget every cached plan."""
    _CACHE.clear()
    _WRITTEN.clear()


def size() -> int:
    return len(_CACHE)


def disabled():
    """Plan every call afresh (and store nothing) inside the block."""
    return turned_off(_enabled)


# ---- plans -----------------------------------------------------------------------------------------------
def leaf_kind(v) -> int:
    """How dispatch holds a leaf: a DistTensor, a DistParameter with a spec, or a plain tensor (replicated)."""
    if v.__class__ is DistTensor:
        return _DIST
    if isinstance(v, DistParameter) and hasattr(v, "_ap_spec"):
        return _PARAM
    return _PLAIN


def _plain_locals(v, held) -> dict:
    """A plain tensor is the same value on every rank. A simulated world holds one object for every rank's copy:
    it is the first rank's copy, so only the first rank's use reaches its gradient (on real ranks each copy
    gets its own rank's; summing every simulated rank's would count a replicated use once per rank)."""
    owner = detached_param(v)
    if owner is not None:               # p.detach() of a distributed parameter: its shards (dispatch._to_dist)
        return {r: t.detach() for r, t in owner._ap_locals.items()}
    if len(held) < 2 or v.stop_gradient:
        return dict.fromkeys(held, v)
    rest = v.detach()
    rest.stop_gradient = False              # a leaf of its own: the other ranks' gradients land there
    return {r: v if i == 0 else rest for i, r in enumerate(held)}


def moves_no_data(src: DistSpec, dst: DistSpec) -> bool:
    """Only local slices / R->P zeroing: the parameter's gradient stays a partial sum on the other
    dims, so it can join the bucketed reduction instead of an eager all_reduce."""
    return all(a == b or (a.is_replicate() and not b.is_replicate())
               for a, b in zip(src.placements, dst.placements))


def _is_tensor_leaf(v) -> bool:
    return isinstance(v, (DistTensor, paddle.Tensor))


def _slots(items) -> tuple:
    """``(position, n)`` for every argument holding tensor leaves: n = 0 for a tensor itself, else the
    number of leaves inside (a list or tuple)."""
    out = []
    for pos, v in items:
        if _is_tensor_leaf(v):
            out.append((pos, 0))
        else:
            n = len(flatten_specs([v], None, is_leaf=_is_tensor_leaf))
            if n:
                out.append((pos, n))
    return tuple(out)


_reshard_plan = fanout.reshard_plan


class CallPlan:
    """One call signature's layout decisions (see the module docstring)."""

    __slots__ = ("res", "mesh", "held", "kinds", "reshards", "grad_dims", "marks", "quiet", "rep_dims", "derives", "arg_slots",
                 "kw_slots", "overrides", "direct", "used")

    def __init__(self, rule, res, mesh, leaves, src_specs, args, kwargs, world):
        split = [m for m in res.split_mesh_dims() if mesh.shape[m] > 1]
        self.res, self.mesh, self.used = res, mesh, False
        self.kinds = tuple(leaf_kind(v) for v in leaves)
        self.reshards = tuple(None if s == req else _reshard_plan(s, req) for s, req in zip(src_specs, res.inputs))
        self.grad_dims = tuple(tuple(m for m in split if req.placements[m].is_replicate()) for req in res.inputs)
        self.quiet = tuple(moves_no_data(s, req) for s, req in zip(src_specs, res.inputs))
        self.rep_dims = tuple(tuple(m for m in range(mesh.ndim) if mesh.shape[m] > 1 and m not in split
                                    and req.placements[m].is_replicate()) for req in res.inputs)
        self.marks = tuple(isinstance(v, DistParameter) and q for v, q in zip(leaves, self.quiet))
        self.derives = _derives(rule, res, self.kinds, self.quiet)
        self.held = tuple(world.local_ranks(mesh.process_ids))
        self.arg_slots = _slots(enumerate(args))
        self.kw_slots = _slots(kwargs.items())
        self.overrides = {r: rule.local_overrides(res, len(args), mesh.coords_of(r)) for r in self.held}
        self.direct = (not kwargs and len(self.held) == 1 and all(n == 0 for _, n in self.arg_slots)
                       and all(p is None for p in self.reshards) and not any(self.grad_dims)
                       and not any(self.rep_dims) and _PLAIN not in self.kinds
                       and self.overrides[self.held[0]] == ((), {}))

    def _direct(self, leaves, args) -> dict:
        """``calls`` when nothing moves or is marked: one held rank, every input already in the layout the
        rule requires, no gradient reduction, no per-rank override, tensors only as positional arguments
        (the common elementwise / view / norm call on a real rank)."""
        r = self.held[0]
        a = list(args)
        try:
            for (i, _), v, kind in zip(self.arg_slots, leaves, self.kinds):
                a[i] = (v._locals if kind == _DIST else v._ap_locals)[r]
        except KeyError:            # a shard this rank does not hold: the general path names it
            self._missing(self._inputs(leaves), r)
        return {r: (tuple(a), {})}

    # ---- per call -----------------------------------------------------------------------------------
    def calls(self, leaves, args, kwargs) -> dict:
        """{rank: (args, kwargs)} of the local op: inputs resharded, the call's own values elsewhere."""
        if self.direct and not fanout.any_partial(leaves):
            return self._direct(leaves, args)
        locs = self._inputs(leaves)
        out = {}
        for r in self.held:
            try:
                vals = [loc[r] for loc in locs]
            except KeyError:
                self._missing(locs, r)
            out[r] = self._fill(args, kwargs, vals, r)
        return out

    def _inputs(self, leaves) -> list:
        """{rank: local} of every leaf in the layout the rule requires; on split mesh dims where it stays
        replicated its gradient is made complete (one all_reduce in backward, shared by every consumer:
        comm/fanout.py), or, for a parameter used directly, marked as a partial sum there (the data-parallel
        runtime reduces it in buckets). Under ``no_grad`` nothing is shared: an input built without a graph and
        served to a later consumer that records one gave that consumer's input no gradient; nor is a parameter
        marked (a use without a graph adds nothing to its gradient: a frozen reference model's forward)."""
        out = []
        grad = paddle.is_grad_enabled()
        for k, v in enumerate(leaves):
            kind = self.kinds[k]
            locs = v._locals if kind == _DIST else v._ap_locals if kind == _PARAM else _plain_locals(v, self.held)
            plan = self.reshards[k]
            dims = self.grad_dims[k]
            if grad and self.quiet[k] and (dims or self.rep_dims[k]) and self.derives is None:   # a cast passes it on
                p = v if kind == _PARAM else fanout.derived_param(v) if kind == _DIST else None
                if p is not None and p._ap_spec.mesh == self.mesh and not p.stop_gradient:
                    locs = locs if plan is None else redistribute.execute(locs, plan)
                    out.append(self._param_use(p, locs, dims, self.rep_dims[k]))
                    continue
            if (dims or kind == _DIST and fanout.partial_dims(v)) and grad and kind != _PARAM \
                    and not all(t.stop_gradient for t in locs.values()):   # a partial gradient's readers too
                out.append(fanout.shared(v, locs, plan, self.res.inputs[k], dims, self.mesh))
                continue
            if plan is not None:
                locs = redistribute.execute(locs, plan)
            if dims and grad and not all(t.stop_gradient for t in locs.values()):   # no_grad: no contribution
                if self.marks[k]:
                    v._ap_partial_dims = getattr(v, "_ap_partial_dims", frozenset()) | frozenset(dims)
                    if isinstance(v, DistParameter):
                        backward_start.note_partial(v)
                else:
                    for m in dims:
                        locs = C.mesh_groups_apply(locs, self.mesh, m, C.grad_all_reduce)
            out.append(locs)
        return out

    def _param_use(self, p, locs, dims, rep) -> dict:
        return param_use(p, locs, self.mesh, dims, rep)

    def _missing(self, locs, r):
        for loc, spec in zip(locs, self.res.inputs):
            if r not in loc:
                DistTensor._own(loc, spec).local_of(r)          # raises the reason
        raise AssertionError("unreachable")

    def _fill(self, args, kwargs, vals, r):
        a = list(args)
        kw = dict(kwargs)
        _put(kw, self.kw_slots, vals, _put(a, self.arg_slots, vals, 0))
        by_pos, by_kw = self.overrides[r]
        for i, value in by_pos:
            a[i] = value
        if by_kw:
            kw.update(by_kw)
        return tuple(a), kw


RANDOM = ("dropout", "rand", "bernoulli", "multinomial", "poisson", "normal", "uniform")


def _derives(rule, res, kinds, quiet):
    """Index of the leaf the output is a local function of, when it can pass a partial gradient through: one
    tensor leaf (a parameter, or a tensor that may derive from one; other arguments are constants) laid out
    without moving data, the output in the same placements, no randomness. On the replicated mesh dims every
    member applies the same Jacobian, so the sum of the members' gradients crosses it unchanged
    (comm/fanout.note_derived): ``weight.float()``, ``1.0 + weight``, ``weight.reshape(...)``."""
    name = getattr(rule, "name", "") or ""
    if len(kinds) != 1 or kinds[0] == _PLAIN or not quiet[0] or any(w in name for w in RANDOM):
        return None
    if len(res.outputs) != 1 or res.outputs[0] is None or \
            getattr(res.outputs[0], "placements", None) != res.inputs[0].placements:
        return None
    return 0


def _refill(v, vals):
    return replace_specs((v,), None, vals, is_leaf=_is_tensor_leaf)[0][0]


def _put(into, slots, vals, j: int) -> int:
    """Writes ``vals`` from index ``j`` on into the (key, leaf count) ``slots`` of ``into`` (the argument list
    or the keyword dict): a lone tensor (count 0) as is, a container refilled; returns the next index."""
    for key, n in slots:
        if n == 0:
            into[key] = vals[j]
            j += 1
        else:
            into[key] = _refill(into[key], vals[j:j + n])
            j += n
    return j


def param_use(p, locs, mesh, dims, rep) -> dict:
    """A parameter ``p`` read (directly or through a cast / view) by an op split over ``dims`` and
    replicated over ``rep``: every contribution to its gradient on a mesh dim must be in one state. The
    first use decides per dim -- split: partial sums, reduced in the data-parallel buckets; replicated:
    complete -- and later uses follow it: a split use of a complete dim reduces its own contribution (all_reduce
    in backward), a replicated use of a partial dim keeps its complete contribution on the group's first
    member only."""
    partial = getattr(p, "_ap_partial_dims", frozenset())
    complete = getattr(p, "_ap_complete_dims", frozenset())
    for m in dims:
        if m in complete and m not in partial:
            locs = C.mesh_groups_apply(locs, mesh, m, C.grad_all_reduce)
        elif m not in partial:
            partial = p._ap_partial_dims = partial | {m}
            if isinstance(p, DistParameter):
                backward_start.note_partial(p)
    for m in rep:
        if m in partial:
            locs = C.mesh_groups_apply(locs, mesh, m, C.grad_keep_first)
        elif m not in complete:
            complete = p._ap_complete_dims = complete | {m}
    return locs
